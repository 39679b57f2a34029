"""What a trained model is worth: zero-shot classification, retrieval and the linear probe (`evaluate`), the
embedding index and its search (`index`), and the run's plots (`plot`)."""
