"""Which spelling of the collective pipeliner's modes this jax's XLA takes as compile options.

jax 0.11's XLA refuses the `xla_gpu_enable_pipelined_*` booleans as compile options
(`jscale/xla_flags.py`); its DebugOptions hold `xla_gpu_pipeline_{all_gather,all_reduce,
reduce_scatter}` of enum CollectivePipeliningMode instead. This compiles a trivial function
with each candidate value and prints which XLA parses (`python3 scripts/gpu_session.py run
pipeline_modes`; seconds, no GPU work). Under jax 0.10 every one is refused: the field is new.
"""

import jax
import jax.numpy as jnp

CANDIDATES = ("COLLECTIVE_PIPELINING_MODE_ON", "COLLECTIVE_PIPELINING_MODE_OFF", "on", "ON", 2,
              True)


def main() -> None:
  lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(4))
  print(f"jax {jax.__version__}")
  for value in CANDIDATES:
    try:  # a probe: what XLA's option parser accepts is the finding
      lowered.compile(compiler_options={"xla_gpu_pipeline_all_gather": value})
      print(f"takes   {value!r}")
    except Exception as e:  # pylint: disable=broad-except
      print(f"refuses {value!r}: {str(e).splitlines()[0][:120]}")


if __name__ == "__main__":
  main()
