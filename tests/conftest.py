"""Shared fixtures: the Cloud TPU emulator (tpurun.emulator.pytest_plugin).

The tests that press Ctrl-C send SIGINT to a tpurun they started. A shell without job control that runs the
suite in the background (`scripts/test &`) starts it with SIGINT ignored; every process the tests start would
inherit that, and Python then installs no KeyboardInterrupt, so those tests would see a Ctrl-C that does
nothing. Giving this process a handler makes the processes it starts begin with the default again."""

import signal

pytest_plugins = ["tpurun.emulator.pytest_plugin"]

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items):
    """The integration files first, the short files of the other directories after them, each file's tests in
    their order. scripts/test hands whole files to two processes in the order collected (--dist loadfile,
    --no-loadscope-reorder): a file of minutes begun last would be the suite's tail while the other process
    idles, and many short files at the end even the two out. (pytest-xdist's own order, most tests first,
    starts the many short unit files first and the long integration files of few tests last.)"""
    first = ("integration", "reliability", "emulator", "cli")
    items.sort(key=lambda item: next((i for i, d in enumerate(first) if f"/tests/{d}/" in str(item.path)), len(first)))
