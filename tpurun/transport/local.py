"""This machine as worker 0 of a one-host pod: a `Runner` whose programs are local subprocesses, each in its
own session (process group), in all three modes."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from tpurun.errors import UnreachableError
from tpurun.transport.runner import LineSplitter, Pipe, Run, Runner, Stream, Worker


class LocalRunner(Runner):
    """This machine as worker 0 of a one-host pod."""

    python = sys.executable  # this machine: the interpreter tpurun runs in

    def __init__(self, worker: Worker | None = None) -> None:
        self.worker = worker or Worker(0, "127.0.0.1")

    def stream(self, argv: Sequence[str]) -> Stream:
        try:
            proc = subprocess.Popen(
                list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
            )
        except OSError as exc:
            raise UnreachableError(f"cannot start {argv[0]} on this machine: {_why(exc)}") from None
        return LocalStream(proc)

    def pipe(self, argv: Sequence[str]) -> Pipe:
        try:
            return LocalPipe(argv)
        except OSError as exc:
            raise UnreachableError(f"cannot start {argv[0]} on this machine: {_why(exc)}") from None

    def run_to_end(self, run: Run) -> int:
        argv, sink, stop, grace, env = run.argv, run.sink, run.stop, run.grace, run.env
        try:
            proc = subprocess.Popen(
                list(argv),
                env={**os.environ, **env} if env else None,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            sink(self.worker.index, "err", f"cannot start {argv[0]}: {exc.strerror}")
            return 127
        assert proc.stdout and proc.stderr
        splitters = {
            proc.stdout.fileno(): LineSplitter(lambda line: sink(self.worker.index, "out", line)),
            proc.stderr.fileno(): LineSplitter(lambda line: sink(self.worker.index, "err", line)),
        }
        open_fds = set(splitters)
        stopping_since: float | None = None
        while open_fds:
            ready, _, _ = select.select(list(open_fds), [], [], 0.1)
            for fd in ready:
                data = os.read(fd, 65536)
                if data:
                    splitters[fd].feed(data)
                else:
                    splitters[fd].flush()
                    open_fds.discard(fd)
            if stop.is_set():
                stopping_since = _stop_group(proc.pid, stopping_since, grace)
        rc = proc.wait()
        _kill_group(proc.pid)
        return rc if rc >= 0 else 128 - rc

    def __repr__(self) -> str:
        return "LocalRunner()"


def _stop_group(pgid: int, since: float | None, grace: float) -> float:
    now = time.monotonic()
    if since is None:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        return now
    if now - since > grace:
        _kill_group(pgid)
    return since


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class LocalStream(Stream):
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.err = b""

    def write(self, data: bytes) -> None:
        assert self.proc.stdin
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except OSError as exc:
            raise UnreachableError(f"the program on this machine ended: {_why(exc)}") from None

    def close_stdin(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass

    def read(self, timeout: float = 0.1) -> bytes | None:
        assert self.proc.stdout
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            return b""
        data = os.read(fd, 1 << 20)
        return data or None

    def stderr_text(self) -> str:
        return self.err.decode("utf-8", errors="replace")

    def wait(self) -> int:
        if self.proc.stderr:
            self.err += self.proc.stderr.read()
        return self.proc.wait()

    def kill(self) -> None:
        self.proc.kill()


class LocalPipe:
    """ARGV as a subprocess of this machine (the one-host pod)."""

    def __init__(self, argv: Sequence[str]) -> None:
        # unbuffered: a buffered stdin's lock, held by a write blocked on a program that reads nothing, would hold
        # up `close` from another thread too
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0
        )
        assert self.proc.stdin and self.proc.stdout

    def send(self, data: bytes) -> None:
        assert self.proc.stdin
        view = memoryview(data)
        try:
            while view:
                view = view[self.proc.stdin.write(view) or 0 :]
        except (OSError, ValueError) as exc:  # ValueError: written after close
            raise UnreachableError(f"the helper on this machine ended: {_why(exc)}") from None

    def recv(self, n: int) -> bytes:
        assert self.proc.stdout
        try:
            return self.proc.stdout.read(n) or b""  # (unbuffered: what one read gives, b"" at its end)
        except (OSError, ValueError) as exc:
            raise UnreachableError(f"the helper on this machine ended: {_why(exc)}") from None

    def close_write(self) -> None:
        assert self.proc.stdin
        try:
            self.proc.stdin.close()
        except OSError as exc:  # what was still buffered could not go
            raise UnreachableError(f"the helper on this machine ended: {_why(exc)}") from None

    def close(self) -> None:
        # end its input first: the program may clean up itself; kill only if it hangs
        try:
            if self.proc.stdin and not self.proc.stdin.closed:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def ended(self) -> tuple[int | None, bytes]:
        try:
            rc = self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return None, b""
        return rc, self.proc.stderr.read() if self.proc.stderr else b""


def _why(exc: Exception) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc) or type(exc).__name__
