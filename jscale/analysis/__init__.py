"""Reading what a compiled step does, without running it: `hlo` (collectives and their bytes
from the optimized HLO), `volume` (their communication volume in the playbook's convention),
`dots` (every matmul's dtypes from the lowered StableHLO), `introspect` (compile a config's
step: memory analysis, HLO), `gpu_target` (GPUs to compile for without one), `plots` and
`tables` (benchmark tables: markdown plus CSV). It never imports the planner (`jscale.plan`),
which reads compiled programs through it."""
