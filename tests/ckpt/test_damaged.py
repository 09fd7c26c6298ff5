"""A damaged checkpoint met by every command: `jscale.ckpt.integrity` names each kind of damage
(arrays, their index, the run metadata, the data position) on a real run's checkpoint; train
falls back to the newest intact step saying so in one line (a rerun that finds its steps
"already reached" too); eval, generate and convert refuse in one line naming `--step N`; a step
written by another number of processes is never moved; a run's last save is read back and
saved again when it does not. One 2-step run (a checkpoint each step) is shared; each test
damages a copy of it."""

from __future__ import annotations

import contextlib
import glob
import io
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import small_config
from jscale import config_cli, exit_codes
from jscale import eval as eval_cli
from jscale import generate as generate_cli
from jscale import runtime
from jscale import train as train_lib
from jscale.ckpt import checkpoint as ckpt_lib
from jscale.ckpt import init_from, integrity, params_io
from jscale.config import ConfigError
from jscale.convert import hf_weights
from jscale.convert.__main__ import main as convert_main
from jscale.data import make_train_iterator
from jscale.model import llama

RUN = ["train.steps=2", "checkpoint.every=1", "train.eval_every=0", "logging.tensorboard=false",
       "model.n_layers=1"]


def _truncate(path: str) -> None:
  os.truncate(path, os.path.getsize(path) // 2)


def _largest_value_file(step_dir: str) -> str:
  files = glob.glob(os.path.join(step_dir, "state", "ocdbt.process_0", "d", "*"))
  return max(files, key=os.path.getsize)


def _write(path: str, text: str) -> None:
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)


# name -> (what it does to a step dir, the part the finding names)
DAMAGE = {
    "every_array_file_truncated": (lambda d: [_truncate(f) for f in glob.glob(
        os.path.join(d, "state", "**", "d", "*"), recursive=True)], "arrays"),
    "one_value_file_truncated": (lambda d: _truncate(_largest_value_file(d)), "arrays"),
    "value_files_deleted": (lambda d: shutil.rmtree(os.path.join(d, "state", "ocdbt.process_0")),
                            "arrays"),
    "array_index_deleted": (lambda d: os.remove(os.path.join(d, "state", "_METADATA")),
                            "array index"),
    "run_metadata_cut": (lambda d: _write(os.path.join(d, "meta", "metadata"), '{"config": {'),
                         "run metadata"),
    "data_position_cut": (lambda d: _write(os.path.join(d, "data", "process_0-of-1.json"), "{"),
                          "data position"),
    "data_position_deleted": (lambda d: os.remove(os.path.join(d, "data", "process_0-of-1.json")),
                              "data position"),
}


def _cfg(out, data_cache, *extra):
  return small_config(None, f"train.output_dir={out}", f"data.cache_dir={data_cache}", *RUN,
                      *extra)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_cache):
  """A run dir with intact checkpoints at steps 1 and 2."""
  out = tmp_path_factory.mktemp("damaged") / "run"
  with contextlib.redirect_stdout(io.StringIO()):
    train_lib.run(_cfg(out, data_cache))
  return out


@pytest.fixture
def run_copy(trained, tmp_path):
  """A copy of the trained run to damage: (run dir, its checkpoints dir)."""
  out = tmp_path / "run"
  shutil.copytree(trained, out)
  return out, str(out / "checkpoints")


def _call(fn, argv) -> tuple[int, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = fn(argv)
  return code, out.getvalue() + err.getvalue()


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_each_damage_is_named(run_copy, name):
  _, ckpts = run_copy
  assert integrity.check_step(ckpts, 2, processes=1) is None
  damage, part = DAMAGE[name]
  damage(os.path.join(ckpts, "2"))
  found = integrity.check_step(ckpts, 2, processes=1)
  assert found is not None and found.damaged and found.part == part, found
  line = found.line()
  assert "\n" not in line and line.startswith(f"checkpoint step 2 in {ckpts} is damaged: ")
  assert integrity.check_step(ckpts, 1, processes=1) is None  # the step before is untouched


def test_shares_split_the_reading_and_the_index_alone_reads_no_value(run_copy):
  _, ckpts = run_copy
  _truncate(_largest_value_file(os.path.join(ckpts, "2")))
  assert integrity.check_step(ckpts, 2, read_arrays=False) is None
  whole = integrity.check_step(ckpts, 2)
  parts = [integrity.check_step(ckpts, 2, share=(i, 2)) for i in range(2)]
  count = lambda f: int(f.detail.split(" of ")[0]) if f else 0
  assert count(whole) > 0 and sum(map(count, parts)) == count(whole)


def test_another_process_count_resumes_one_global_position_and_refuses_two(run_copy):
  """A step written by 1 process checks out for 2: its position is global. Written by 2 at
  different positions (not jscale's train iterator) it is refused for 1, and nothing moves."""
  _, ckpts = run_copy
  assert integrity.check_step(ckpts, 2, processes=2) is None
  data = os.path.join(ckpts, "2", "data")
  assert integrity.global_position(os.path.join(ckpts, "2")) == {"next_index": 2}
  before = sorted(os.listdir(ckpts))
  os.rename(os.path.join(data, "process_0-of-1.json"), os.path.join(data, "process_0-of-2.json"))
  _write(os.path.join(data, "process_1-of-2.json"), '{"next_index": 3}')
  with pytest.raises(ConfigError, match="written by 2 processes at different positions, and "
                     "this run has 1; resume it with 2.*nothing was moved"):
    ckpt_lib.newest_intact(ckpts, read_arrays=True)
  assert sorted(os.listdir(ckpts)) == before


@pytest.mark.parametrize("name", ["one_value_file_truncated", "run_metadata_cut",
                                  "data_position_deleted"])
def test_train_falls_back_and_a_finished_rerun_checks_its_last_step(run_copy, data_cache, name):
  out, ckpts = run_copy
  damage, part = DAMAGE[name]
  damage(os.path.join(ckpts, "2"))
  path = out.parent / "run.yaml"
  _write(str(path), config_cli.to_yaml(_cfg(out, data_cache)))
  # The same command again: train.steps=2 is "already reached", but step 2 does not read back.
  code, printed = _call(train_lib.main, ["--config", str(path)])
  assert code == 0, printed
  assert "Traceback" not in printed and "already reached" not in printed
  warnings = [line for line in printed.splitlines() if line.startswith("warning:")]
  assert len(warnings) == 1 and f"checkpoint step 2 in {ckpts} is damaged: {part}: " in \
      warnings[0] and warnings[0].endswith("resuming from step 1 instead")
  assert f"resuming {out} from step 1" in printed and "done: step 2" in printed
  assert integrity.check_step(ckpts, 2, processes=1) is None  # trained and saved again
  assert [d.split(".")[0] for d in os.listdir(ckpts) if ".damaged-" in d] == ["2"]


@pytest.mark.parametrize("command", ["eval", "generate", "convert"])
def test_commands_name_the_damaged_step_and_the_newest_intact(run_copy, command, tmp_path):
  """They read the parameters only: a lost data position is no concern of theirs (the first
  call), a lost array index is."""
  out, ckpts = run_copy
  DAMAGE["data_position_deleted"][0](os.path.join(ckpts, "2"))
  fn, argv = {"eval": (eval_cli.main, ["--model", str(out)]),
              "generate": (generate_cli.main, ["--model", str(out), "--prompt", "def ",
                                               "--max-new-tokens", "2"]),
              "convert": (convert_main, ["jscale-to-hf", "--ckpt", str(out), "--out",
                                         str(tmp_path / "hf")])}[command]
  code, printed = _call(fn, argv)
  assert code == 0, printed
  shutil.rmtree(tmp_path / "hf", ignore_errors=True)
  DAMAGE["array_index_deleted"][0](os.path.join(ckpts, "2"))
  code, printed = _call(fn, argv)
  assert code == exit_codes.BAD_INPUT and "Traceback" not in printed, printed
  errors = [line for line in printed.splitlines() if f"checkpoint step 2 of run {out}" in line]
  assert len(errors) == 1 and "is damaged: array index: " in errors[0]
  assert errors[0].endswith("the newest step that reads back is 1: pass --step 1")
  shutil.rmtree(tmp_path / "hf", ignore_errors=True)
  code, printed = _call(fn, argv + ["--step", "1"])
  assert code == 0, printed


def test_last_save_is_read_back_and_saved_again(tmp_path, data_cache):
  cfg = _cfg(tmp_path / "run", data_cache)
  rt = runtime.build(cfg)
  state = rt.init_state()
  data = make_train_iterator(cfg.data, cfg.train.seq_len, cfg.train.batch_size, 0, 1)
  ckptr = ckpt_lib.Checkpointer(cfg, {"config": {}})
  assert ckptr.save(3, state, data, force=True)
  ckptr.wait()
  DAMAGE["one_value_file_truncated"][0](os.path.join(ckptr.directory, "3"))
  warnings = []
  assert ckptr.check_last(state, data, warnings.append) is None
  ckptr.close()
  assert len(warnings) == 1 and warnings[0].endswith("saving step 3 again")
  assert integrity.check_step(ckptr.directory, 3, processes=1) is None
  assert [d.split(".")[0] for d in os.listdir(ckptr.directory) if ".damaged-" in d] == ["3"]


def test_init_from_a_damaged_params_checkpoint_or_hf_file(tmp_path, data_cache):
  cfg = small_config(None, "model.n_layers=1")
  params_io.save_params(str(tmp_path / "params"), llama.create(cfg.model), cfg.model)
  start = _cfg(tmp_path / "run", data_cache, f"checkpoint.init_from={tmp_path / 'params'}")
  init_from.check(start)
  _truncate(max(glob.glob(str(tmp_path / "params" / "params" / "**" / "d" / "*"),
                          recursive=True), key=os.path.getsize))
  with pytest.raises(ConfigError, match=r"checkpoint.init_from=.* is damaged: arrays: "):
    init_from.check(start)


def test_a_truncated_safetensors_file_is_named(tmp_path):
  save_file({"a": np.ones((64, 64), np.float32)}, str(tmp_path / hf_weights.SINGLE))
  hf_weights.SafetensorsReader(str(tmp_path))
  _truncate(str(tmp_path / hf_weights.SINGLE))
  with pytest.raises(ConfigError, match=r"model.safetensors is damaged \(safetensors: "):
    hf_weights.SafetensorsReader(str(tmp_path))


def test_two_copies_moved_aside_in_one_second_keep_apart(tmp_path):
  targets = []
  for copy in range(2):
    os.makedirs(tmp_path / "5" / "state")
    (tmp_path / "5" / "state" / "x").write_text(str(copy))
    targets.append(ckpt_lib.move_aside(str(tmp_path), 5))
  assert len(set(targets)) == 2 and all(os.path.isdir(t) for t in targets)
  assert ckpt_lib.complete_steps(str(tmp_path)) == []  # moved-aside copies are not steps
