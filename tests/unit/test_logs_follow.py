"""`logs --follow` shows a burst's last lines when its streams go quiet, not when the next line comes: a read
with no record flushes what the output holds (the lines of a job that then waits would otherwise stay unseen,
as a TorchTPU job's last reports once did)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from tpurun.cli.output import Renderer
from tpurun.job.control import _Viewer
from tpurun.transport.runner import Worker
from tpurun.worker import protocol


class Shown:
    """LINES as `logs` prints them (a real Renderer), with what reached stdout kept."""

    def __init__(self) -> None:
        self.renderer = Renderer(colour=False)
        self.out: list[str] = []
        self.renderer._write_buffer = self._write  # type: ignore[method-assign]

    def _write(self) -> None:
        self.out += self.renderer.buffer
        self.renderer.buffer.clear()

    def name_workers(self, names: dict[int, str]) -> None:
        self.renderer.names = names

    def lines(self, worker: int, lines: list[tuple[int, str]]) -> None:
        self.renderer.lines(worker, lines)

    def flush(self) -> None:
        self.renderer.flush()

    def waiting(self, waiting) -> None:
        pass


def test_a_quiet_read_shows_what_a_follow_holds():
    shown = Shown()
    target = SimpleNamespace(workers=[Worker(0, "127.0.0.1")])
    viewer = _Viewer(SimpleNamespace(workers=[0]), target, shown, threading.Event(), follow=True)  # type: ignore[arg-type]
    burst = [protocol.Line(0, 0, o, protocol.Source.OUT, 1.0, f"report {o}") for o in (1, 2, 3)]
    shown.renderer.last_flush = float("inf")  # its last write just now, however slow this machine: lines are held
    viewer._take(0, burst)  # to be written with what follows
    assert shown.out == []
    viewer._take(0, [])  # the stream is quiet: the rest is shown now
    assert shown.out == [f"[w0/c0] report {o}\n" for o in (1, 2, 3)]
