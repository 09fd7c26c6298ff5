"""Bytes crossing nodes under expert parallelism: the flat dropless exchange against DeepSeek-V3's
node-limited one (`model.moe.exchange`, `jscale.parallel.expert_exchange`).

Two figures:
  * rows (from the routing, per token and MoE layer, forward): what the GPU's ragged
    all-to-all moves across nodes. Flat: one row per chosen expert on another node;
    node-limited: one per chosen group on another node. Sigmoid affinities of N(0, 1) logits,
    no bias, for the 8-device test shape and DeepSeek-V3's (64 GPUs as 8 nodes of 8).
  * compiled (per device and step, forward and backward, of the exchange alone at a DeepSeek-
    like layer on 8 devices as 2 nodes of 4): bytes to other nodes from the HLO's replica
    groups (`hlo.bytes_across_nodes`): XLA:CPU's padded all-to-alls and, with the CUDA plugin,
    XLA:GPU's ragged buffers for 8 H100s (their capacity: an upper bound).

    JAX_PLATFORMS=cpu python scripts/node_limited_bytes.py [--out results/node_limited_dispatch]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after the environment is set)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jscale.analysis import gpu_target, hlo  # noqa: E402
from jscale.model import moe_dispatch as md  # noqa: E402
from jscale.model import router  # noqa: E402
from jscale.parallel import expert_exchange as ex  # noqa: E402

# (name, devices, devices per node, experts, top-k, groups, topk_group)
ROUTINGS = [("test shape: 2 nodes x 4", 8, 4, 16, 4, 2, 1),
            ("2 nodes x 4, 64 experts, top-6", 8, 4, 64, 6, 2, 1),
            ("DeepSeek-V3: 8 nodes x 8, 256 experts, top-8", 64, 8, 256, 8, 8, 4)]
# The compiled layer: tokens per device, model, expert hidden, experts, top-k (2 groups, top 1).
LAYER = dict(t=4096, d=7168, f=2048, e=64, k=6)


def crossing_rows(ids_TK: np.ndarray, n_dev: int, per_node: int, n_experts: int,
                  n_group: int) -> tuple[float, float]:
  """(flat, node-limited) rows sent to other nodes per token: tokens split evenly over the
  devices in order, device j on node j // per_node, expert e on device e // (E / n_dev)."""
  t = ids_TK.shape[0]
  node_T = np.arange(t) // (t // n_dev) // per_node
  expert_node_TK = ids_TK // (n_experts // n_dev) // per_node
  flat = np.sum(expert_node_TK != node_T[:, None])
  group_TK = ids_TK // (n_experts // n_group)  # a group per node when n_group = nodes
  chosen = [set(g) - {n} for g, n in zip(group_TK.tolist(), node_T.tolist())]
  return flat / t, sum(map(len, chosen)) / t


def rows_table(tokens: int = 1 << 16) -> list[dict]:
  out = []
  for name, n_dev, per_node, e, k, g, tg in ROUTINGS:
    logits = jax.random.normal(jax.random.key(0), (tokens, e))
    ids = np.asarray(router.group_limited_top_k(jax.nn.sigmoid(logits), k, g, tg))
    flat, limited = crossing_rows(ids, n_dev, per_node, e, g)
    out.append(dict(routing=name, top_k=k, topk_group=tg, flat=flat, node_limited=limited))
  return out


def _step(exchange, devices, dtype):
  def body(x, ids, gates, w):
    return jax.grad(lambda x, gates, w: jnp.sum(exchange(x, ids, gates, w).astype(jnp.float32)),
                    (0, 1, 2))(x, gates, w)
  ws = md.ExpertWeights(P("expert"), P("expert"))
  rows = P("expert")
  return jax.jit(jax.shard_map(body, mesh=Mesh(np.array(devices), ("expert",)),
                               in_specs=(rows, rows, rows, ws), out_specs=(rows, rows, ws),
                               check_vma=False))


def compiled_bytes(devices, native: bool) -> dict[str, int]:
  """Bytes per device and step sent to the other node, per exchange."""
  n, c, dt = len(devices), LAYER, jnp.bfloat16
  sds = lambda *s, dtype=dt: jax.ShapeDtypeStruct(s, dtype)
  args = (sds(n * c["t"], c["d"]), sds(n * c["t"], c["k"], dtype=jnp.int32),
          sds(n * c["t"], c["k"], dtype=jnp.float32),
          md.ExpertWeights(sds(c["e"], c["d"], 2, c["f"]), sds(c["e"], c["f"], c["d"])))
  exchanges = {
      "flat": lambda x, i, g, w: ex.dropless_exchange(x, i, g, w, dt, ex.Peers.whole("expert", n),
                                                      native)[0],
      "node_limited": lambda x, i, g, w: ex.node_limited_exchange(x, i, g, w, dt, "expert", n, 2,
                                                                  1, native)[0]}
  out = {}
  for name, fn in exchanges.items():
    text = _step(fn, devices, dt).lower(*args).compile().as_text()
    out[name] = sum(hlo.bytes_across_nodes(col, n // 2) for col in hlo.collectives(text)
                    if col.kind in ("all-to-all", "ragged-all-to-all"))
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="results/node_limited_dispatch")
  args = parser.parse_args()
  lines = ["# Bytes crossing nodes: flat vs node-limited expert dispatch",
           "", "Generated by `JAX_PLATFORMS=cpu python scripts/node_limited_bytes.py`.", "",
           "## Rows sent to other nodes per token and MoE layer (forward; what the GPU's ragged",
           "all-to-all moves)", "",
           "| routing | top-k | topk_group | flat | node-limited | ratio |", "|---|---|---|---|---|---|"]
  for r in rows_table():
    lines.append(f"| {r['routing']} | {r['top_k']} | {r['topk_group']} | {r['flat']:.2f} | "
                 f"{r['node_limited']:.2f} | {r['flat'] / r['node_limited']:.2f}x |")
  c = LAYER
  lines += ["", f"## Compiled: GB per device and step to the other node (8 devices as 2 nodes of "
            f"4; one layer, {c['t']} tokens per device, d {c['d']}, {c['e']} experts of "
            f"{c['f']}, top-{c['k']}, bf16; exchange forward and backward)", "",
            "| compiler | flat | node-limited | ratio |", "|---|---|---|---|"]
  targets = [("XLA:CPU (padded all-to-all)", jax.devices()[:8], False)]
  if gpu_target.available():
    targets.append(("XLA:GPU 8xH100 (ragged buffers: upper bound)",
                    gpu_target.devices("h100x8"), True))
  for name, devices, native in targets:
    b = compiled_bytes(devices, native)
    lines.append(f"| {name} | {b['flat'] / 1e9:.3f} | {b['node_limited'] / 1e9:.3f} | "
                 f"{b['flat'] / b['node_limited']:.2f}x |")
  text = "\n".join(lines) + "\n"
  with open(args.out + ".md", "w", encoding="utf-8") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  main()
