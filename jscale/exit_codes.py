"""The exit statuses of jscale's commands, one home for all of them (docs/usage.md). A leaf: it
imports no jscale module, so the launcher (`jscale.distributed`) and the run share them
without importing each other."""

BAD_INPUT = 2  # a config error or bad argument, one line naming it, before anything compiled
NONFINITE = 3  # a non-finite loss or gradient norm with train.on_nan=stop
PEERS_MISSING = 69  # not every process reached the coordinator (distributed.init_timeout_s)
UNSAVED = 74  # the run's last checkpoint did not read back, saved twice (sysexits' EX_IOERR)
PREEMPTED = 75  # stopped by SIGTERM / SIGINT after saving: rerun the command to resume
INTERRUPTED = 130  # a second Ctrl-C: exited at once, unsaved
