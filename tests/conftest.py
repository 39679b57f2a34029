import pytest


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # Nothing may be fetched from a model hub in tests; libraries must use local files only.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
