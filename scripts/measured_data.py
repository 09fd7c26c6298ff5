"""The measured GPU train-step rows (22), each with the code, config and GPU it ran on, as the
sources record them. `measured_rows.py` compiles them; `tests/predict/test_measured_rows.py` checks them.

Sources (figures copied verbatim; per-step values are derived in properties):
* H100_MD = results/h100_measured/h100_2026-11-23.md (1x H100 80GB HBM3, main at 29f9f33, jax
  0.11.2): "Train step, landed code" (commit 29f9f33), "Same, with an experimental change" and
  "With the same experimental change" (29f9f33 + scripts/patches/29f9f33_bf16_dots.patch: the
  layer einsum and the head without preferred_element_type=float32). All rows: configs/tiny.yaml
  model.preset=llama3_1b model.dtype=bfloat16 train.seq_len=4096 + the row's settings. At
  29f9f33 model.attention_impl defaulted to xla, so cudnn / pallas rows name it.
* The two H100 profiles (2 steps, kernel time summed per stream; "GPU op time"):
  h100_profile_llama3_1b_main.txt (row h100_main_cudnn_selective_b4: 988 ms / 2 steps vs
  16384 / 32,667 tok/s = 502 ms) and h100_profile_llama3_1b_bf16_dots.txt (row
  h100_bf16_cudnn_selective_b4: 559 ms / 2 vs 283 ms).
* H200 (1x H200, main at 6f9fa39, jax 0.11.2): results/h200_measured/bench_train*.csv/.md and
  bench_moe_gpu*.csv/.md; exact overrides from first.log / second.log (train.output_dir left
  out); launched by `python -m jscale.train`, whose xla_flags.apply set the overlap flags and
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 (29f9f33's launcher set no fraction: JAX's 0.75).
"""

from __future__ import annotations

import dataclasses

from jscale import hardware

H100_MD = "results/h100_measured/h100_2026-11-23.md"
H200 = "results/h200_measured/"
PATCH = "scripts/patches/29f9f33_bf16_dots.patch"
# bf16 dense, H100 / H200 SXM: the MFU denominator of every source
PEAK_TFLOPS = hardware.GPUS["h100"].peak_flops["bf16"] / 1e12


@dataclasses.dataclass(frozen=True)
class Row:
  """One measured train step. `overrides` are in the row's commit's config keys and go after
  `--config configs/tiny.yaml`. `profile_ms` is a profile's per-category total over
  `profile_steps` steps (category names as that profile's tool wrote them)."""
  name: str
  device: str  # "H100" | "H200"
  target: str  # jscale.analysis.gpu_target name
  commit: str
  patch: str | None  # applied with `git apply` to the commit's tree
  overrides: tuple[str, ...]
  batch: int
  seq: int
  tokens_per_s: float
  mfu: float  # the project's figure: model FLOPs (6N + attention) / PEAK_TFLOPS
  peak_gib: float | None  # device peak_bytes_in_use
  source: str
  mem_fraction: float  # XLA_PYTHON_CLIENT_MEM_FRACTION of the run (XLA's memory limit)
  config: str = "configs/tiny.yaml"
  measured_step_s: float | None = None  # where the source gives it (else from tokens/s)
  profile_ms: dict[str, float] | None = None
  profile_steps: int = 2
  shares: dict[str, float] | None = None  # fraction of the traced span per category (H200)
  gemm_in_other_ms: float | None = None  # per step: listed gemm kernels the profile put in "other"
  note: str = ""

  @property
  def step_s(self) -> float:
    return self.measured_step_s or self.batch * self.seq / self.tokens_per_s

  @property
  def category_ms(self) -> dict[str, float] | None:
    """Per-step milliseconds by category, where a profile's text gives them."""
    if self.profile_ms is None:
      return None
    return {k: v / self.profile_steps for k, v in self.profile_ms.items()}


def _h100(name, settings, batch, tok_s, mfu, peak, source, *, patch=PATCH, seq=4096,
          preset="llama3_1b", **kw) -> Row:
  overrides = (f"model.preset={preset}", "model.dtype=bfloat16", f"train.seq_len={seq}",
               *settings, f"train.batch_size={batch}")
  return Row(name, "H100", "h100x1", "29f9f33", patch, overrides, batch, seq, tok_s, mfu, peak,
             f"{H100_MD}: {source}", 0.75, **kw)


_H200_COMMON = ("model.dtype=bfloat16", "train.seq_len=4096", "checkpoint.every=0",
                "train.eval_every=0", "data.val_fraction=0", "logging.progress=false",
                "logging.tensorboard=false", "train.warmup_steps=5")
_H200_TAIL = ("train.steps=15", "logging.every=5", "train.profile_steps=[11,12]")
_SHARES = ("gemm", "attention", "collectives", "elementwise", "copies", "idle")


def _h200(name, settings, batch, csv, tok_s, mfu, step_s, peak, shares, **kw) -> Row:
  return Row(name, "H200", "h200x1", "6f9fa39", None, (*_H200_COMMON, *settings, *_H200_TAIL),
             batch, 4096, tok_s, mfu, peak, f"{H200}{csv}", 0.9, measured_step_s=step_s,
             shares=dict(zip(_SHARES, shares)), **kw)


_CUDNN = "model.attention_impl=cudnn"
_PALLAS = ("model.attention_impl=pallas", "model.norm_impl=pallas")
_SEL, _NONE, _FULL = "train.remat=selective", "train.remat=none", "train.remat=full"
_MOE = ("model.vocab_size=32768", "model.moe.n_experts=8", "model.moe.top_k=2",
        "model.moe.d_ff=2048")
_LANDED, _EXP, _MORE = ("Train step, landed code", "Same, with an experimental change",
                        "With the same experimental change")
_H100_GEMM_NOTE = ("the profile's tool counted nvjet_* (cuBLAS) gemm kernels as "
                   "'fusion/elementwise/other'; gemm_in_other_ms sums those in its top-40 list")
_MOE_NOTE = ("batch 4, selective, cuDNN: issue 20's shape as the README states it (16 layers, "
             "d 2048, 8 experts of d_ff 2048, top-2, seq 4096, batch 4) and the measured peak; "
             "the note names no attention: cudnn assumed like its other rows")

ROWS: tuple[Row, ...] = (
    _h100("h100_main_xla_selective_b4", ("model.attention_impl=xla", _SEL), 4, 10210, 0.085,
          54.7 / 1.073741824, _LANDED, patch=None,
          note="peak written '54.7 GB (remat warning: can't fit 57 GiB)': GB, as the compiled "
          "step's 50.7 GiB and XLA's 'below 57.06GiB' at 0.75 of the H100 confirm"),
    _h100("h100_main_cudnn_selective_b4", (_CUDNN, _SEL), 4, 32667, 0.271, 42.6, _LANDED,
          patch=None, profile_ms={"matmul(gemm)": 610.5, "fusion/elementwise/other": 218.0,
                                  "attention(cudnn/flash)": 105.0, "reduce": 42.6,
                                  "copy/transpose": 12.1},
          gemm_in_other_ms=(22.00 + 3.16) / 2,
          note="profile: results/h100_measured/h100_profile_llama3_1b_main.txt; "
          + _H100_GEMM_NOTE),
    _h100("h100_main_pallas_selective_b4", (*_PALLAS, _SEL), 4, 27770, 0.231, 42.6, _LANDED,
          patch=None),
    _h100("h100_main_cudnn_none_b2", (_CUDNN, _NONE), 2, 29175, 0.242, 44.4, _LANDED,
          patch=None),
    _h100("h100_main_cudnn_full_b8", (_CUDNN, _FULL), 8, 31511, 0.262, 47.9, _LANDED,
          patch=None),
    _h100("h100_main_cudnn_vocab32k_selective_b4", (_CUDNN, _SEL, "model.vocab_size=32768"), 4,
          36547, 0.260, 32.0, _LANDED, patch=None),
    _h100("h100_bf16_cudnn_selective_b4", (_CUDNN, _SEL), 4, 57952, 0.48, None, _EXP,
          profile_ms={"fusion/elementwise/other": 334.8, "attention(cudnn/flash)": 113.3,
                      "matmul(gemm)": 64.0, "reduce": 31.7, "copy/transpose": 15.2},
          gemm_in_other_ms=(46.38 + 44.90 + 43.76 + 40.11 + 21.98 + 21.51 + 8.69 + 8.53
                            + 3.24) / 2,
          note="MFU written '~48%', peak '-'; profile: results/h100_measured/"
          "h100_profile_llama3_1b_bf16_dots.txt; " + _H100_GEMM_NOTE),
    _h100("h100_bf16_cudnn_selective_b8", (_CUDNN, _SEL), 8, 58950, 0.490, 55.3, _EXP),
    _h100("h100_bf16_cudnn_none_b2", (_CUDNN, _NONE), 2, 47239, 0.392, 42.0, _EXP),
    _h100("h100_bf16_pallas_selective_b4", (*_PALLAS, _SEL), 4, 43470, 0.361, 35.6, _EXP),
    _h100("h100_bf16_3b_cudnn_full_b2", (_CUDNN, _FULL), 2, 17543, 0.379, 49.4, _EXP,
          preset="llama3_3b"),
    _h100("h100_bf16_8b8L_cudnn_full_b1", ("model.n_layers=8", _CUDNN, _FULL), 1, 26179, 0.382,
          40.7, _EXP, preset="llama3_8b"),
    _h100("h100_bf16_manual_cudnn_selective_b4", ("parallel.collectives=manual", _CUDNN, _SEL),
          4, 56889, 0.473, 35.2, _MORE),
    _h100("h100_bf16_seq16k_cudnn_selective_b1", (_CUDNN, _SEL), 1, 38757, 0.417, 35.1, _MORE,
          seq=16384),
    _h100("h100_bf16_moe_dropless_b4", (*_MOE, _CUDNN, _SEL), 4, 20226, 0.095, 39.8, _MORE,
          note="dropless at 29f9f33: jax.lax.ragged_dot; MFU on active parameters; " + _MOE_NOTE),
    _h100("h100_bf16_moe_capacity125_b4", (*_MOE, "model.moe.dispatch=capacity",
                                           "model.moe.capacity_factor=1.25", _CUDNN, _SEL), 4,
          42392, 0.198, 35.4, _MORE, note="MFU on active parameters; " + _MOE_NOTE),
    _h200("h200_1b_selective_b8", ("model.preset=llama3_1b", "train.batch_size=8", _SEL), 8,
          "bench_train.csv", 63430.77387060983, 0.5269201285571528, 0.5165946747999997,
          45.88984680175781, (0.6194319442208757, 0.17922822103577885, 0.0,
                              0.15181179999174618, 0.04519903278617054, 0.0049307086595229595),
          profile_ms={"gemm": 636.47, "attention": 184.16, "collectives": 0.0,
                      "elementwise/fusion": 155.99, "copies": 46.44, "idle": 5.07},
          note="profile: bench_train.md (span 1027.5 ms / 2 steps)"),
    _h200("h200_1b_selective_b4", ("model.preset=llama3_1b", "train.batch_size=4", _SEL), 4,
          "bench_train_second.csv", 61736.151482641406, 0.5128428819458216, 0.2653874529999939,
          32.2446391582489, (0.5992329875963501, 0.17651684570312864, 0.0, 0.17686625140187548,
                             0.03943013406822746, 0.008882950837630379),
          profile_ms={"gemm": 320.42, "attention": 94.39, "collectives": 0.0,
                      "elementwise/fusion": 94.57, "copies": 21.08, "idle": 4.75},
          note="profile: bench_train_second.md (span 534.7 ms / 2 steps)"),
    _h200("h200_1b_selective_b4_pallas", ("model.preset=llama3_1b", "train.batch_size=4", _SEL,
                                          *_PALLAS), 4,
          "bench_train_second.csv", 59136.850470516285, 0.4912504601623266, 0.27705229260000125,
          32.294578313827515, (0.5608059338620462, 0.21913210458180532, 0.0,
                               0.177883976971049, 0.03341547360245321, 0.008787413333942914),
          profile_ms={"gemm": 307.15, "attention": 120.02, "collectives": 0.0,
                      "elementwise/fusion": 97.43, "copies": 18.30, "idle": 4.81},
          note="pallas at 6f9fa39: the Hopper (Mosaic GPU) attention and RMSNorm; profile: "
          "bench_train_second.md (span 547.7 ms / 2 steps)"),
    _h200("h200_8b8L_selective_b2", ("model.preset=llama3_8b", "model.n_layers=8",
                                     "train.batch_size=2", _SEL), 2,
          "bench_train.csv", 36631.54728563173, 0.5340656957362993, 0.22363237719999915,
          46.83926749229431, (0.6698320844052641, 0.08322493388790206, 0.0,
                              0.21010710520928766, 0.0290985386442561, 0.008310227498146082),
          profile_ms={"gemm": 295.90, "attention": 36.76, "collectives": 0.0,
                      "elementwise/fusion": 92.82, "copies": 12.85, "idle": 3.67},
          note="profile: bench_train.md (span 441.8 ms / 2 steps)"),
    _h200("h200_moe_dropless_pallas", ("model.preset=llama3_1b", *_MOE, "train.batch_size=4",
                                       _SEL, "model.moe.gemm=pallas"), 4,
          "bench_moe_gpu.csv", 76488.62246679989, 0.3580614057857939, 0.21420179200000006,
          41.30324459075928, (0.48863228085770305, 0.20726368126540806, 0.0,
                              0.24553018845650493, 0.04282652063349754, 0.02059953110716308),
          note="MFU on active parameters; no category ms in the source, shares only"),
    _h200("h200_moe_capacity125", ("model.preset=llama3_1b", *_MOE, "train.batch_size=4", _SEL,
                                   "model.moe.dispatch=capacity",
                                   "model.moe.capacity_factor=1.25"), 4,
          "bench_moe_gpu_second.csv", 74659.59181486996, 0.34949927895785166,
          0.2194493647999934, 43.594752073287964,
          (0.3820351789509865, 0.17697405814780973, 0.0, 0.3706869286543653,
           0.06102424409242397, 0.011057789321676113),
          note="MFU on active parameters; no category ms in the source, shares only"),
)


def by_name(name: str) -> Row:
  """The row called `name`; KeyError listing the names otherwise."""
  for row in ROWS:
    if row.name == name:
      return row
  raise KeyError(f"no row {name!r}: one of {', '.join(r.name for r in ROWS)}")
