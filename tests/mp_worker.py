"""One process of a multi-process test: `python tests/mp_worker.py [distributed.key=value ...]`.

Started several times (directly by tests/run/test_distributed.py, or by scripts/launch_local.py,
which appends the distributed.* overrides), with JAX_PLATFORMS=cpu and its own
--xla_force_host_platform_device_count. Calls jscale.distributed.initialize (twice: it is
idempotent), builds a global batch over a 1-D "data" mesh of every process's devices from
`local_rows(process_index)`, runs jitted reductions over it and prints one `RESULT {json}` line.
"""

import json
import sys

import numpy as np

ROWS_PER_DEVICE = 2
SEQ = 3


def local_rows(process_index: int, n_rows: int) -> np.ndarray:
  """Process `process_index`'s rows (distinct across processes), [n_rows, SEQ] int32."""
  return (np.arange(n_rows * SEQ, dtype=np.int32).reshape(n_rows, SEQ) +
          1000 * (process_index + 1))


def main(argv: list[str]) -> int:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  from jscale import distributed  # pylint: disable=import-outside-toplevel
  from jscale.config_load import load_config  # pylint: disable=import-outside-toplevel

  cfg = load_config(None, argv)
  distributed.initialize(cfg.distributed)
  distributed.initialize(cfg.distributed)  # idempotent

  pi = jax.process_index()
  mesh = jax.make_mesh((jax.device_count(),), ("data",),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  sharding = NamedSharding(mesh, P("data"))
  n_local = ROWS_PER_DEVICE * jax.local_device_count()
  tokens = local_rows(pi, n_local)
  batch = distributed.global_batch(
      {"tokens": tokens, "weights": np.full((n_local,), pi + 1, np.float32)}, sharding)

  @jax.jit
  def reduce(b):
    rows = b["tokens"].shape[0]
    row_sums = jnp.sum(b["tokens"], axis=1)  # stays sharded over "data"
    index = jnp.arange(rows, dtype=jnp.int32)
    # The row-index-weighted sum checks the order: process p's rows are the p-th block.
    return jnp.sum(row_sums), jnp.sum(row_sums * index), jnp.sum(b["weights"])

  total, weighted, weights = reduce(batch)
  result = {
      "process_index": pi,
      "process_count": jax.process_count(),
      "device_count": jax.device_count(),
      "local_device_count": jax.local_device_count(),
      "global_shape": list(batch["tokens"].shape),
      "sharding_spec": str(batch["tokens"].sharding.spec),
      "sum": int(total),
      "weighted_sum": int(weighted),
      "weights_sum": float(weights),
      "is_main": distributed.is_main(),
      "cpu_collectives": jax.config.jax_cpu_collectives_implementation,
      "cuda_visible_devices": jax.config.read("jax_cuda_visible_devices"),
  }
  print("RESULT " + json.dumps(result), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
