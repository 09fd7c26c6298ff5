"""A training run's lifecycle around the step: the run directory (new run, resume or refusal,
the metadata a resume compares with), what the run resolved to (the startup summary and
`run.json`), the loop (steps, logging, evaluation, checkpoints) and preemption (signals, exit
codes, agreement across processes). `python -m jscale.train` (`jscale.train`) drives them."""
