"""A training run: the loop (`loop`), one step (`step`), resume (`resume`), optimiser and schedule (`optim`),
metrics and trackers (`tracking`), and the run's guards: agreement between processes (`agree`), preemption
(`preempt`), device-side step checks (`stepcheck`), the output directory's lock (`runlock`), FSDP2 (`fsdp`), the
weight average (`ema`), the checks before step 1 (`preflight`), a distillation teacher (`teacher`) and stored
teacher embeddings (`reinforce`)."""
