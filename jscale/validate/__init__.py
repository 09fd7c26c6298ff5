"""Every check of a config: a ConfigError naming the key and the fix, before anything compiles.

- `check_config(cfg)` (`values.py`): the values alone, no devices (`load_config` runs it at
  load). Every `Literal` key anywhere in the config is checked by `choices.py`, one rule.
- `check_mesh(cfg, mesh)` (`on_mesh.py`): the parallel layout and kernels against the model on
  a mesh's devices (`runtime.build` runs both), and the keys that would have no effect there
  (`no_ops.py`: refused, or a line of `no_op_warnings(cfg, mesh)` the trainer prints).
- `check_runtime(cfg)` (`machine.py`): this machine's backend and files (tokenizer, init_from
  checkpoint); the trainer runs it before building anything.

By topic: `kernels.py` (attention, norm and grouped-matmul kernels on a backend), `experts.py`
(experts and their exchange), `deepseek.py` (DeepSeek-V3's routing, MLA, MTP), `choices.py`
and `values.py` (a config's values alone). Lower layers
check their own arguments with plain ValueErrors (the context token order, FP8 targets) or say
why not (the kernels' and the pipeline schedules' `why_not`); here those become ConfigErrors
naming the key.
"""

from jscale.validate.kernels import check_backend, flash_attention_why_not
from jscale.validate.machine import check_runtime
from jscale.validate.on_mesh import check_mesh, no_op_warnings
from jscale.validate.values import check_config

__all__ = ["check_backend", "check_config", "check_mesh", "check_runtime",
           "flash_attention_why_not", "no_op_warnings"]
