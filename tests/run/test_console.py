"""The console of a run, as a real `python -m jscale.train` process prints it: in a terminal (a
pty) the progress bar stays below one plain line per logged step and per eval; into a pipe
(SLURM, nohup) only the lines, no carriage return; `logging.progress=false` drops the bar, not
the lines. The `done:` line says what its val loss covered."""

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest

from conftest import ROOT, TINY_RUN
from jscale.run import console

STEPS = 12


def _in_a_terminal(out, cache, env) -> str:
  """TINY_RUN with stdout and stderr on a terminal (a pty of 120 columns); what it printed."""
  argv = [sys.executable, "-m", "jscale.train", "--config", "configs/tiny.yaml", *TINY_RUN,
          f"train.output_dir={out}", f"data.cache_dir={cache}"]
  main, child = pty.openpty()
  fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a terminal's size
  proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=child, stderr=child,
                          stdin=subprocess.DEVNULL)
  os.close(child)
  chunks = []
  while True:
    try:
      data = os.read(main, 65536)
    except OSError:  # EIO: the child closed the terminal
      break
    if not data:
      break
    chunks.append(data)
  os.close(main)
  assert proc.wait(timeout=300) == 0, b"".join(chunks)[-3000:]
  return b"".join(chunks).decode("utf-8", "replace")


def _lines(text: str) -> list[str]:
  """The plain lines: what is between line ends, less any bar drawn before them."""
  return [line.split("\r")[-1] for line in text.replace("\r\n", "\n").split("\n")]


def _check_lines(text: str) -> None:
  lines = _lines(text)
  steps = [l for l in lines if re.match(rf"step +\d+/{STEPS}  loss ", l)]
  assert [l.split("/")[0].split()[-1] for l in steps] == ["4", "8", "12"], lines
  assert all(re.search(r"grad \S+  lr \S+  [\d,]+ tok/s  \S+ s/step", l) for l in steps), steps
  assert "eta " in steps[0] and "eta " not in steps[-1]  # the last step has nothing left
  evals = [l for l in lines if l.startswith("eval ")]
  assert evals == [f"eval {s:>2}/{STEPS}  val_loss {v}  (2 batches, 256 tokens of the val split)"
                   for s, v in zip((6, 12), re.findall(r"val_loss (\S+)  \(", " ".join(evals)))]
  done = next(l for l in lines if l.startswith("done: "))
  assert re.search(r"val_loss \S+ \(2 batches, 256 tokens of the val split\)", done), done


def test_in_a_terminal_the_bar_stays_below_the_lines(tmp_path, data_cache, child_env):
  text = _in_a_terminal(tmp_path, data_cache, child_env)
  _check_lines(text)
  assert re.search(rf"\d+/{STEPS} \[", text)  # tqdm's bar was drawn
  # The bar redraws with \r on its own line; a plain line never shares one with the bar.
  for line in _lines(text):
    assert not re.search(r"\|.*step", line) or not line.startswith(("step ", "eval ")), line


def test_into_a_pipe_only_lines(tiny_run):
  _, text = tiny_run
  assert "\r" not in text
  _check_lines(text)


def test_progress_false_drops_the_bar_not_the_lines(monkeypatch, capsys):
  main, child = pty.openpty()
  with os.fdopen(child, "w") as terminal:
    monkeypatch.setattr(sys, "stderr", terminal)
    shown = console.Console(STEPS, 0, progress=True)
    quiet = console.Console(STEPS, 0, progress=False)
    assert shown._bar is not None and quiet._bar is None  # pylint: disable=protected-access
    shown.close()
    quiet.write(4, {"loss": 2.5, "grad_norm": 1.0, "lr": 1e-3})
    quiet.close()
  os.close(main)
  assert capsys.readouterr().out == "step  4/12  loss 2.5000  grad 1  lr 1.00e-03\n"


@pytest.mark.parametrize("seconds, text", [(7.4, "7s"), (125, "2m05s"), (3725, "1h02m")])
def test_durations(seconds, text):
  assert console.duration(seconds) == text


def test_a_step_line_on_a_gpu_names_mfu_and_memory():
  row = {"loss": 2.5, "grad_norm": 0.91, "lr": 3e-4, "step_time_s": 0.5,
         "tokens_per_sec": 65536.0, "mfu": 0.527, "peak_memory_bytes": 60 * 2**30,
         "nonfinite_steps": 0}
  assert console.step_line(100, 1000, row) == (
      "step  100/1000  loss 2.5000  grad 0.91  lr 3.00e-04  65,536 tok/s  0.5 s/step  "
      "mfu 52.7%  mem 60.0 GiB  eta 7m30s")
