"""A training run: the loop (`loop`), what it runs on (`runtime`: processes, batch, steps, precision), its parts
built once (`build`), one step (`step`: forward, loss, the finite-loss decision, backward, update), reports and the
end of a run (`finish`), resume (`resume`), optimiser and schedule (`optim`), metrics and trackers (`tracking`),
and the run's guards: agreement between processes (`agree`), preemption (`preempt`), the output directory's lock
(`runlock`), FSDP2 (`fsdp`), the weight average (`ema`), the checks before step 1 (`preflight`), a distillation
teacher (`teacher`) and stored teacher embeddings (`reinforce`)."""
