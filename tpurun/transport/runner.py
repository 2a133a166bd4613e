"""How tpurun reaches a worker, whatever the transport: the `Worker` it is, and a `Runner` that runs a
program there in one of three modes:

* `run`: to completion in its own process group, its lines to a sink as they are printed, stopped (and
  its whole group with it) on request or when tpurun goes away;
* `stream`: with stdin, stdout and stderr connected to us (the job agent, one-shot commands), as a
  `Stream`; the program owns its lifeline (the agent's `stream --attached` stops its job when stdin
  closes);
* `pipe`: as a byte `Pipe` for a helper program (sync's), as fast as the transport allows.

The transports are `ssh.SshRunner` (paramiko, host keys pinned per worker identity) and
`local.LocalRunner` (this machine as a one-host pod); callers never ask which, and `targets` makes them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tpurun.errors import UnreachableError, UsageError
from tpurun.naming import spec_words, worker_name

LineSink = Callable[[int, str, str], None]  # (worker index, "out"|"err", line without newline)

INTERNAL_PORT = 22  # where a worker's sshd listens at its address inside the slice (Worker.internal)
RUN_GRACE = 3.0  # seconds between SIGTERM and SIGKILL for a command a Runner runs (exec); a job's: protocol.JOB_GRACE
# A connection whose worker's bytes wait unread in this machine's socket is not silent: this process is behind
# (starved of CPU), and a reply may wait behind them. It is given this many times its timeout, not one.
BEHIND_TIMEOUTS = 4


@dataclass(frozen=True)
class Worker:
    index: int  # in the whole TPU: slice-major for a multislice TPU
    address: str
    port: int = 22
    user: str = "root"
    slice: int | None = None  # its slice in a multislice TPU
    host: int = 0  # its index in that slice
    internal: str = ""  # its address inside the VPC, where it differs from the one tpurun connects to
    host_key: str = ""  # the name its host key is pinned under: its identity (keys.host_key_alias)

    @property
    def name(self) -> str:
        """How output names it: w3, or s1/w1 in a multislice TPU."""
        return worker_name(self.host if self.slice is not None else self.index, self.slice)

    def label(self) -> str:
        return f"{self.name} ({self.address})"


def worker_names(workers: list[Worker]) -> dict[int, str]:
    """{index: name} of WORKERS, for output that only carries indexes."""
    return {w.index: w.name for w in workers}


def parse_worker_spec(spec: str, count: int, names: list[str] | None = None) -> list[int]:
    """`all`, `0`, `0,2`, `1-3` (and mixes) -> sorted worker indexes, checked against COUNT. With NAMES
    (a multislice TPU's sS/wN), a name selects its worker and `sS` every worker of slice S."""
    text = (spec or "all").strip()
    if text == "all":
        return list(range(count))
    chosen: set[int] = set()
    try:
        parts = spec_words(text, bool(names))  # a folded set as output prints it: w[0-3,5], s1/w[0-7]
    except ValueError:
        parts = [text]  # refused below, in the same words
    for part in parts:
        part = part.strip()
        if names and (part in names or any(n.startswith(part + "/") for n in names)):
            chosen.update(i for i, n in enumerate(names) if n == part or n.startswith(part + "/"))
            continue
        try:
            if not part.isascii():
                raise ValueError  # int() takes '１' (fullwidth) too
            if "-" in part:
                lo_s, hi_s = part.split("-", 1)
                lo, hi = int(lo_s), int(hi_s)
                if lo > hi:
                    raise ValueError
                chosen.update(range(lo, hi + 1))
            else:
                chosen.add(int(part))
        except ValueError:
            also = ", sS/wN or sS (a slice)" if names else ""
            raise UsageError(
                f"bad --worker '{spec}': use all, N, N,M or N-M{also}, or a set as tpurun prints it (w[0-3,5]) "
                f"(workers are 0..{count - 1})"
            ) from None
    bad = sorted(i for i in chosen if i < 0 or i >= count)
    if bad:
        raise UsageError(f"bad --worker '{spec}': this TPU has workers 0..{count - 1}, not {bad[0]}")
    return sorted(chosen)


class LineSplitter:
    """Bytes in, whole lines out (a partial line waits for its end, or for flush at EOF)."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit = emit
        self.buf = b""

    def feed(self, data: bytes) -> None:
        self.buf += data
        if b"\n" not in data:
            return
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            self.emit(line.decode("utf-8", errors="replace").rstrip("\r"))

    def flush(self) -> None:
        if self.buf:
            self.emit(self.buf.decode("utf-8", errors="replace"))
            self.buf = b""


def refuse_nul(args: Sequence[str]) -> None:
    """Refuse ARGS (a program's arguments or its variables' values) when one holds a NUL byte."""
    if any("\0" in arg for arg in args):
        raise UsageError("arguments cannot contain NUL bytes (no program can receive them)")


@dataclass(frozen=True)
class Run:
    """A command `Runner.run` runs to completion: ARGV (never through a shell) with ENV's variables added,
    its lines to SINK; STOP set sends it SIGTERM, and SIGKILL GRACE seconds later."""

    argv: Sequence[str]
    sink: LineSink
    stop: threading.Event
    grace: float = RUN_GRACE
    env: Mapping[str, str] = field(default_factory=dict)


class Runner:
    """One worker, reached over SSH or this machine itself; callers never ask which."""

    worker: Worker
    python = "python3"  # the worker's Python when none is named
    refused_key = False  # the last connect failed because the worker could not prove it is that worker

    def connect(self) -> None:
        """Reach the worker, or raise UnreachableError saying why; nothing to do where it is this machine."""

    def run(
        self,
        argv: Sequence[str],
        sink: LineSink,
        stop: threading.Event,
        grace: float = RUN_GRACE,
        env: Mapping[str, str] | None = None,
    ) -> int:
        """ARGV to completion in its own process group, its lines to SINK; STOP ends it (after GRACE). ENV:
        variables added to its environment."""
        refuse_nul([*argv, *(env or {}).values()])
        return self.run_to_end(Run(argv, sink, stop, grace, env or {}))

    def run_to_end(self, run: Run) -> int:
        """RUN, as this transport does it (`run` checked it)."""
        raise NotImplementedError

    def stream(self, argv: Sequence[str]) -> Stream:
        """ARGV started with stdin, stdout and stderr connected to us."""
        raise NotImplementedError

    def pipe(self, argv: Sequence[str]) -> Pipe:
        """ARGV started as a byte pipe for a helper program (sync's receiving end), as fast as the transport
        allows."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class Stream:
    """One long-running command on a worker whose stdin stays open: closing it is the stop signal. Its methods
    raise UnreachableError when the connection has gone, never the transport's own errors."""

    def write(self, data: bytes) -> None:
        raise NotImplementedError

    def close_stdin(self) -> None:
        raise NotImplementedError

    def read(self, timeout: float = 0.1) -> bytes | None:
        """Some stdout bytes; b"" while nothing arrived yet; None at EOF."""
        raise NotImplementedError

    def stderr_text(self) -> str:
        raise NotImplementedError

    def wait(self) -> int:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def behind(self) -> bool:
        """Whether bytes the worker sent wait unread on this machine (it spoke; this process is behind)."""
        return False


class Pipe(Protocol):
    """A program on a worker as a byte pipe (sync's helper speaks its protocol over one). Its methods raise
    UnreachableError when the program or the connection has gone (`ended` says which); never the transport's
    own errors."""

    def send(self, data: bytes) -> None: ...
    def recv(self, n: int) -> bytes: ...
    def close_write(self) -> None: ...
    def close(self) -> None: ...
    def ended(self) -> tuple[int | None, bytes]:
        """(exit code, stderr) once it ended; exit code None when the connection, not the program, ended."""
        ...


def open_stream(runner: Runner, argv: Sequence[str]) -> Stream:
    """Start ARGV on RUNNER's worker with stdin, stdout and stderr connected to us."""
    refuse_nul(argv)
    return runner.stream(argv)


def run_capture(
    runner: Runner, argv: Sequence[str], stdin: bytes = b"", timeout: float = 120
) -> tuple[int, bytes, str]:
    """Run ARGV to completion with STDIN; (exit code, stdout, stderr)."""
    stream = open_stream(runner, argv)
    if stdin:
        try:
            stream.write(stdin)
        except UnreachableError:
            # the program may have ended before reading (no bundle there: exit MISSING), which its exit code
            # says; a connection that went is what it is
            if stream.read(1) is not None or stream.wait() < 0:
                raise
    stream.close_stdin()
    out = b""
    deadline = time.monotonic() + timeout
    while True:
        data = stream.read(0.2)
        if data is None:
            break
        out += data
        if time.monotonic() > deadline:
            stream.kill()
            raise UnreachableError(f"worker {runner.worker.label()} did not answer within {timeout:.0f} s")
    return stream.wait(), out, stream.stderr_text()
