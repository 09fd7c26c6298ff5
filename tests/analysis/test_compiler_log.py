"""`jscale.analysis.compiler_log`: XLA's remat warning read from what the compiler writes to
file descriptor 2, every other line passed on."""

import os

from jscale.analysis import compiler_log

LINE = ("W1128 02:55:17.308228    9211 hlo_rematerialization.cc:3231] Can't reduce memory use "
        "below 68.33GiB (73367548986 bytes) by rematerialization; only reduced to 95.61GiB "
        "(102656804077 bytes), down from 95.61GiB (102656935140 bytes) originally\n")


def test_the_remat_warning_is_read_and_other_lines_pass_on(capfd):
  with compiler_log.remat_shortfalls() as found:
    os.write(2, b"I0000 something else\n")
    os.write(2, LINE.encode())
  assert found == [compiler_log.RematShortfall(73367548986, 102656804077)]
  err = capfd.readouterr().err
  assert "something else" in err and "rematerialization" not in err
