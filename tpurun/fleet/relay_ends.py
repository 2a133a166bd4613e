"""What a relayed operation is made of on this machine: a channel (`Chan`: one program on one worker, what
hears its bytes and its end), a program left running with its stdin open (`RelaySession`, for `open`) and a
helper on many workers spoken to at once (`RelayChorus`, for `chorus`). The tree that carries them is
`relays.Relays`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tpurun.errors import UnreachableError
from tpurun.fleet.interface import Chorus, Session
from tpurun.worker import relay_wire

if TYPE_CHECKING:
    from tpurun.fleet.relays import Link, Relays


@dataclass
class Chan:
    """One channel: the worker it runs on and what hears its bytes and its end."""

    worker: int
    out: Callable[[bytes], None]
    err: Callable[[bytes], None]
    end: Callable[[int | None, str], None]  # (exit code, or None and why it never ran or was lost)
    link: Link | None = None


class RelaySession(Session):
    """A program left running on one worker through the relays, its stdin open."""

    def __init__(self, tree: Relays, worker: int) -> None:
        self.tree, self.worker = tree, worker
        self.number = 0
        self.buf = bytearray()
        self.err = bytearray()
        self.rc: int | None = None
        self.error = ""
        self.done = threading.Event()
        self.changed = threading.Condition()
        self.waited = 0.0

    def took(self, data: bytes) -> None:
        with self.changed:
            self.buf.extend(data)
            self.changed.notify_all()

    def took_err(self, data: bytes) -> None:
        self.err.extend(data)

    def ended_with(self, rc: int | None, why: str) -> None:
        with self.changed:
            self.rc, self.error = rc, why
            self.done.set()
            self.changed.notify_all()

    def wait_line(self, deadline: float) -> str | None:
        self.waited = max(0.0, deadline - time.monotonic())
        with self.changed:
            while b"\n" not in self.buf:
                if self.done.is_set():
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    self.tree.act(relay_wire.DROP, [self.number])
                    why = f"its agent did not answer within {self.waited:.0f} s"
                    self.rc, self.error = None, why
                    self.done.set()
                    raise UnreachableError(why)
                self.changed.wait(min(left, 0.2))
            line, _, rest = bytes(self.buf).partition(b"\n")
            self.buf[:] = rest
            return line.decode()

    def line(self, say: bytes | None, wait: float) -> str | None:
        if say is None:
            self.tree.act(relay_wire.CLOSE, [self.number])
        else:
            self.tree.act(relay_wire.INPUT, [self.number], say)
        return self.wait_line(time.monotonic() + wait)

    def alive(self) -> bool:
        return not self.done.is_set()

    def ended(self) -> tuple[int, str]:
        self.done.wait()
        if self.rc is None:
            return -1, self.error
        return self.rc, self.err.decode("utf-8", "replace")

    def release(self) -> None:
        self.tree.act(relay_wire.CLOSE, [self.number])

    def wait_end(self, deadline: float) -> None:
        self.done.wait(max(0.0, deadline - time.monotonic()))


class RelayChorus(Chorus):
    """A helper on many workers through the relays: `say` is one frame per root's link for all it reaches."""

    def __init__(self, tree: Relays, argv: Sequence[str], workers: list[int]) -> None:
        super().__init__()
        self.tree = tree
        self.err: dict[int, bytearray] = {}
        self.failed: dict[int, str] = {}
        self.why: dict[int, str] = {}  # why the connection to a worker's helper was lost

        def make(w: int) -> Chan:
            out, err = self.out.setdefault(w, bytearray()), self.err.setdefault(w, bytearray())

            def took(data: bytes) -> None:
                with self.changed:
                    out.extend(data)
                    self.changed.notify_all()

            def end(rc: int | None, why: str) -> None:
                with self.changed:  # a connection lost: why, in place of the helper's stderr
                    self.ends[w] = (rc, bytes(err) if rc is not None else why.encode())
                    self.why[w] = why
                    self.changed.notify_all()

            return Chan(w, took, err.extend, end)

        self.numbers = tree.open_chans({w: argv for w in workers}, {}, make)
        self.workers = [w for w in workers if w not in self.ends]
        self.failed = {w: self.why.get(w, "") for w, (rc, _) in self.ends.items() if rc is None}

    def say(self, workers: Collection[int], data: bytes) -> None:
        self.tree.act(relay_wire.INPUT, [self.numbers[w] for w in workers if w not in self.ends], data)

    def close(self) -> None:
        self.tree.act(relay_wire.CLOSE, list(self.numbers.values()))
