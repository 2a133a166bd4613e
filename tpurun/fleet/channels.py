"""What a relayed operation is made of on this machine: channels (`Chan`: one program on one worker, what hears
its bytes and its end), opened and acted on by a tree of relays (`Channels`, which `Relays` is), and the three
shapes the operations give them: a program left running with its stdin open (`RelaySession`, for `open`), a
byte pipe to one worker's helper (`RelayPipe`, for `converse`) and a helper on many workers spoken to at once
(`RelayChorus`, for `chorus`). The frames that carry them are relay_wire's."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from tpurun.errors import UnreachableError
from tpurun.fleet.interface import Chorus, Session
from tpurun.worker import relay_wire

PIPE_BYTES = 4 << 20  # what one relayed pipe holds unread, at most: beyond, its link's reader waits (backpressure
# up the tree, as a relay's own queues do)


@dataclass
class Chan:
    """One channel: the worker it runs on and what hears its bytes and its end."""

    worker: int
    out: Callable[[bytes], None]
    err: Callable[[bytes], None]
    end: Callable[[int | None, str], None]  # (exit code, or None and why it never ran or was lost)


class Channels(Protocol):
    """A tree that opens channels and acts on them (`Relays`)."""

    def open_chans(
        self, argvs: Mapping[int, Sequence[str]], envs: Mapping[int, Mapping[str, str]], make: Callable[[int], Chan]
    ) -> dict[int, int]:
        """ARGVS[w] on each worker w (with ENVS[w] added), a channel each, MAKE(w) hearing it: {worker: channel}."""
        ...

    def act(self, kind: int, numbers: Collection[int], data: bytes = b"") -> None:
        """KIND (INPUT with DATA, CLOSE) on every channel of NUMBERS still open."""
        ...

    def drop(self, numbers: Collection[int]) -> None:
        """Stop reading the channels of NUMBERS and end their stdin; nothing of theirs is heard any more."""
        ...


class RelaySession(Session):
    """A program left running on one worker through the relays, its stdin open."""

    def __init__(self, tree: Channels, worker: int) -> None:
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
                    self.tree.drop([self.number])
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


class RelayPipe:
    """ARGV on one worker through the relays as a byte `Pipe` (download's helper): what it writes waits here
    until read, PIPE_BYTES at most. Its methods raise UnreachableError once the channel was lost."""

    def __init__(self, tree: Channels, worker: int, argv: Sequence[str]) -> None:
        self.tree = tree
        self.buf = bytearray()
        self.err = bytearray()
        self.rc: int | None = None
        self.why = ""
        self.done = self.dropped = False
        self.changed = threading.Condition()
        opened = tree.open_chans({worker: argv}, {}, lambda w: Chan(w, self._out, self.err.extend, self._end))
        self.number = opened[worker]

    def _out(self, data: bytes) -> None:
        with self.changed:
            while len(self.buf) >= PIPE_BYTES and not self.dropped:
                self.changed.wait(1.0)
            if not self.dropped:
                self.buf.extend(data)
                self.changed.notify_all()

    def _end(self, rc: int | None, why: str) -> None:
        with self.changed:
            self.rc, self.why, self.done = rc, why, True
            self.changed.notify_all()

    def _lost(self) -> None:
        if self.done and self.rc is None:
            raise UnreachableError(self.why or "the connection was lost")

    def send(self, data: bytes) -> None:
        with self.changed:
            self._lost()
            if self.done or self.dropped:
                raise UnreachableError("the program had ended")
        self.tree.act(relay_wire.INPUT, [self.number], data)

    def recv(self, n: int) -> bytes:
        with self.changed:
            while not self.buf and not self.done and not self.dropped:
                self.changed.wait(1.0)
            if not self.buf:
                self._lost()
                return b""
            got = bytes(self.buf[:n])
            del self.buf[:n]
            self.changed.notify_all()  # room again for what waits to come up
            return got

    def close_write(self) -> None:
        self.tree.act(relay_wire.CLOSE, [self.number])

    def close(self) -> None:
        with self.changed:
            if self.dropped:
                return
            self.dropped = True
            self.buf.clear()
            self.changed.notify_all()
        if not self.done:
            self.tree.drop([self.number])

    def ended(self) -> tuple[int | None, bytes]:
        deadline = time.monotonic() + 2  # (as an SSH channel's exit status is waited for)
        with self.changed:
            while not self.done and time.monotonic() < deadline:
                self.changed.wait(0.1)
            return (self.rc, bytes(self.err)) if self.done else (None, b"")


class RelayChorus(Chorus):
    """A helper on many workers through the relays: `say` is one frame per root's link for all it reaches."""

    def __init__(self, tree: Channels, argv: Sequence[str], workers: list[int]) -> None:
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
