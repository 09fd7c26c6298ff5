"""Reading what a compiled step does, without running it: `hlo` (collectives and their bytes
from the optimized HLO), `volume` (the playbook's communication volume to compare with),
`dots` (every matmul's dtypes from the lowered StableHLO), `introspect` (compile a config's
step: memory analysis, HLO) and `report` (benchmark tables)."""
