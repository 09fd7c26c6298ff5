"""jscale.run.directory: new run / resume / refusal, decided from the files before anything
compiles; and metrics.jsonl and TensorBoard kept one series across resumes."""

import glob
import json
import os
import struct

import pytest

from conftest import small_config
from jscale import config as config_lib
from jscale import metrics
from jscale.run import directory as run_dir
from jscale.config import ConfigError


def _fake_checkpoint(cfg, step, saved_cfg=None):
  """A step directory as the Checkpointer writes it (state/ + meta/metadata)."""
  d = os.path.join(cfg.train.output_dir, "checkpoints", str(step))
  os.makedirs(os.path.join(d, "state"))
  os.makedirs(os.path.join(d, "meta"))
  with open(os.path.join(d, "meta", "metadata"), "w", encoding="utf-8") as f:
    json.dump(run_dir.metadata(saved_cfg or cfg, ["python", "-m", "jscale.train"]), f)


def test_new_run_then_resume_line(tmp_path):
  cfg = small_config(tmp_path)
  p = run_dir.plan(cfg)
  assert (p.step, p.replace) == (None, False)
  assert p.line() == f"starting a new run in {tmp_path}/run"
  _fake_checkpoint(cfg, 3)
  _fake_checkpoint(cfg, 6)
  os.makedirs(tmp_path / "run" / "checkpoints" / "9.orbax-checkpoint-tmp-1" / "state")
  p = run_dir.plan(cfg)
  assert p.line() == f"resuming {tmp_path}/run from step 6" and p.changed == []


def test_mismatch_lists_every_differing_key_with_both_values(tmp_path):
  cfg = small_config(tmp_path)
  _fake_checkpoint(cfg, 4)
  changed = small_config(tmp_path, "model.n_layers=3", "model.d_ff=96", "train.batch_size=4",
                         "data.seed=7", "train.steps=20", "mesh.fsdp=2", "logging.every=5")
  with pytest.raises(ConfigError) as e:
    run_dir.plan(changed)
  msg = str(e.value)
  for line in ("model.n_layers: 2 in the checkpoint, 3 now", "model.d_ff: 128 in the checkpoint, "
               "96 now", "train.batch_size: 8 in the checkpoint, 4 now",
               "data.seed: 0 in the checkpoint, 7 now"):
    assert line in msg
  assert "train.steps" not in msg and "mesh.fsdp" not in msg  # allowed changes are not refused
  assert "train.output_dir=<new dir>" in msg and "checkpoint.overwrite=true" in msg
  # The allowed ones alone: resume, each change listed.
  p = run_dir.plan(small_config(tmp_path, "train.steps=20", "mesh.fsdp=2", "model.dtype=bfloat16"))
  assert [k for k, _, _ in p.changed] == ["mesh.fsdp", "model.dtype", "train.steps"]
  assert "  changed since the checkpoint: train.steps 6 -> 20" in run_dir.changed_lines(p)
  # FP8 settings shape the state only when FP8 is on (its amax histories).
  p = run_dir.plan(small_config(tmp_path, "fp8.amax_history=8"))
  assert [k for k, _, _ in p.changed] == ["fp8.amax_history"]
  with pytest.raises(ConfigError, match="fp8.enabled: false in the checkpoint, true now"):
    run_dir.plan(small_config(tmp_path, "fp8.enabled=true"))


def test_interleaved_pipeline_fixes_the_stage_count(tmp_path):
  cfg = small_config(tmp_path, "model.n_layers=4", "mesh.stage=2", "pipeline.virtual_stages=2",
                     "pipeline.schedule=interleaved")
  _fake_checkpoint(cfg, 2)
  with pytest.raises(ConfigError, match="mesh.stage: 2 in the checkpoint, 4 now"):
    run_dir.plan(small_config(tmp_path, "model.n_layers=4", "mesh.stage=4",
                              "pipeline.virtual_stages=2", "pipeline.schedule=interleaved"))


def test_resume_false_is_refused_at_start_and_overwrite_moves_aside(tmp_path):
  cfg = small_config(tmp_path)
  _fake_checkpoint(cfg, 6)
  (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
  with pytest.raises(ConfigError, match=r"checkpoint.resume=false, but .* \(up to step 6\)"):
    run_dir.plan(small_config(tmp_path, "checkpoint.resume=false"))
  with pytest.raises(ConfigError, match="needs checkpoint.resume=false"):
    small_config(tmp_path, "checkpoint.overwrite=true")
  over = small_config(tmp_path, "checkpoint.resume=false", "checkpoint.overwrite=true")
  p = run_dir.plan(over)
  assert (p.step, p.replace) == (None, True)
  moved = run_dir.prepare(over, p)
  assert sorted(os.listdir(moved)) == ["checkpoints", "metrics.jsonl"]
  assert os.listdir(os.path.join(moved, "checkpoints")) == ["6"]  # nothing deleted
  assert run_dir.plan(cfg).step is None  # the directory is free again


def test_saved_metadata_holds_config_version_command(tmp_path):
  cfg = small_config(tmp_path)
  meta = run_dir.metadata(cfg, ["python", "-m", "jscale.train", "train.lr=3e-4"])
  assert meta["config"] == config_lib.to_dict(cfg)
  assert meta["command"] == "python -m jscale.train train.lr=3e-4"
  assert meta["jscale"]


def test_metrics_trim_keeps_one_series(tmp_path):
  path = tmp_path / "metrics.jsonl"
  rows = [{"step": s, "loss": 1.0 / s, "nonfinite_steps": s // 4} for s in range(1, 9)]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "lo')  # torn line
  assert metrics.trim_metrics(str(path), 5) == 1  # the nonfinite count carried on
  assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
  assert metrics.trim_metrics(str(tmp_path / "absent.jsonl"), 5) == 0


def _tensorboard_scalars(log_dir) -> dict[int, float]:
  """step -> "loss" as TensorBoard shows it: event files in order, each record a TFRecord
  (length, crc, Event, crc); a SessionLog START at step s discards the events written before it
  at steps >= s (tensorboardX's `purge_step`)."""
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel
  shown: dict[int, float] = {}
  for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):  # by time
    data = open(path, "rb").read()
    at = 0
    while at < len(data):
      (n,) = struct.unpack("<Q", data[at:at + 8])
      event = event_pb2.Event.FromString(data[at + 12:at + 12 + n])
      at += 16 + n
      if event.HasField("session_log") and event.session_log.status == event.session_log.START:
        shown = {s: v for s, v in shown.items() if s < event.step}
      for value in event.summary.value:
        if value.tag == "loss":
          shown[event.step] = value.simple_value
  return shown


def test_tensorboard_keeps_one_series_across_a_resume(tmp_path):
  first = metrics.MetricsWriter(str(tmp_path), tensorboard=True)
  for step in range(1, 9):
    first.write(step, {"loss": float(step)})
  first.close()  # the resume may come within the same second: its events go to another file
  resumed = metrics.MetricsWriter(str(tmp_path), start_step=4, tensorboard=True)
  for step in range(5, 7):
    resumed.write(step, {"loss": 10.0 + step})
  resumed.close()
  assert _tensorboard_scalars(tmp_path / "tensorboard") == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0,
                                                            5: 15.0, 6: 16.0}
  assert [json.loads(l)["step"] for l in open(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_an_output_dir_that_is_a_file_is_refused_by_name(tmp_path):
  path = tmp_path / "not_a_dir"
  path.write_text("x")
  cfg = small_config(tmp_path, f"train.output_dir={path}")
  with pytest.raises(ConfigError, match=r"train.output_dir=.* is a file: give a directory"):
    run_dir.plan(cfg)
