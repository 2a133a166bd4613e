"""Shared fixtures: the Cloud TPU emulator (tpurun.emulator.pytest_plugin).

The tests that press Ctrl-C send SIGINT to a tpurun they started. A shell without job control that runs the
suite in the background (`scripts/test &`) starts it with SIGINT ignored; every process the tests start would
inherit that, and Python then installs no KeyboardInterrupt, so those tests would see a Ctrl-C that does
nothing. Giving this process a handler makes the processes it starts begin with the default again."""

import signal

pytest_plugins = ["tpurun.emulator.pytest_plugin"]

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
