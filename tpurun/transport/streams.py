"""Programs on a worker with their pipes connected to us: a Stream (stdin, stdout and stderr, for the
job agent and one-shot commands) and a Pipe (a byte pipe for a helper program, as fast as the transport
allows, for sync)."""

from __future__ import annotations

import os
import select
import shlex
import subprocess
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from tpurun.errors import UnreachableError, UsageError
from tpurun.transport._paramiko import paramiko

if TYPE_CHECKING:
    from tpurun.transport.runner import Runner, SshRunner, _Liveness


def send_all(chan: paramiko.Channel, data: bytes | bytearray | memoryview) -> None:
    """Send every byte of DATA on CHAN. paramiko's own Channel.sendall re-slices the rest of its input
    after each 32 KiB packet, copying O(n^2) bytes (half the client's CPU in a bulk sync with 1 MiB
    writes); sending successive views of one memoryview copies nothing."""
    view = memoryview(data)
    while view:
        sent = chan.send(view)
        if sent <= 0:
            raise OSError("the SSH channel no longer accepts data")
        view = view[sent:]


class Stream:
    """One long-running command on a worker whose stdin stays open: closing it is the stop signal."""

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


class SshStream(Stream):
    def __init__(self, chan: paramiko.Channel, liveness: _Liveness | None = None) -> None:
        self.chan = chan
        self.err = b""
        self.liveness = liveness

    def write(self, data: bytes) -> None:
        send_all(self.chan, data)

    def close_stdin(self) -> None:
        try:
            self.chan.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass

    def read(self, timeout: float = 0.1) -> bytes | None:
        while self.chan.recv_stderr_ready():
            self.err += self.chan.recv_stderr(65536)
        if self.chan.recv_ready():
            return self.chan.recv(1 << 20)
        if self.chan.eof_received or self.chan.closed:
            data = self.chan.recv(1 << 20) if self.chan.recv_ready() else b""
            return data or None
        transport = self.chan.get_transport()
        if transport is None or not transport.is_active():
            return None
        select.select([self.chan], [], [], timeout)
        if self.chan.recv_ready():
            return self.chan.recv(1 << 20)
        return b""

    def stderr_text(self) -> str:
        while self.chan.recv_stderr_ready():
            self.err += self.chan.recv_stderr(65536)
        text = self.err.decode("utf-8", errors="replace")
        if self.liveness is not None and self.liveness.dead:
            text += ("\n" if text and not text.endswith("\n") else "") + self.liveness.dead
        return text

    def wait(self) -> int:
        transport = self.chan.get_transport()
        if transport is None or not transport.is_active():
            return -1 if not self.chan.exit_status_ready() else self.chan.recv_exit_status()
        return self.chan.recv_exit_status()

    def kill(self) -> None:
        self.chan.close()


class LocalStream(Stream):
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.err = b""

    def write(self, data: bytes) -> None:
        assert self.proc.stdin
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

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


def open_stream(runner: Runner, argv: Sequence[str]) -> Stream:
    """Start ARGV on RUNNER's worker with stdin, stdout and stderr connected to us."""
    for arg in argv:
        if "\0" in arg:
            raise UsageError("arguments cannot contain NUL bytes")
    return runner.stream(argv)


def run_capture(
    runner: Runner, argv: Sequence[str], stdin: bytes = b"", timeout: float = 120
) -> tuple[int, bytes, str]:
    """Run ARGV to completion with STDIN; (exit code, stdout, stderr)."""
    stream = open_stream(runner, argv)
    if stdin:
        stream.write(stdin)
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


# ------------------------------------------------------------------ pipes (helper programs)


class Pipe(Protocol):
    """A program on a worker as a byte pipe (sync's helper speaks its protocol over one)."""

    def send(self, data: bytes) -> None: ...
    def recv(self, n: int) -> bytes: ...
    def close_write(self) -> None: ...
    def close(self) -> None: ...
    def ended(self) -> tuple[int | None, bytes]:
        """(exit code, stderr) once it ended; exit code None when the connection, not the program, ended."""
        ...


class SshPipe:
    """ARGV on one new channel of a connected SshRunner, its exec request pipelined: the caller goes on
    sending without waiting for the server's reply (a refused request closes the channel, which the
    reader then sees)."""

    def __init__(self, runner: SshRunner, argv: Sequence[str]) -> None:
        assert runner.client is not None, "connect() first"
        transport = runner.client.get_transport()
        assert transport is not None
        self.chan = transport.open_session()
        command = shlex.join(argv)
        try:
            from paramiko.common import cMSG_CHANNEL_REQUEST
            from paramiko.message import Message

            msg = Message()
            msg.add_byte(cMSG_CHANNEL_REQUEST)
            msg.add_int(self.chan.remote_chanid)
            msg.add_string("exec")
            msg.add_boolean(True)
            msg.add_string(command)
            self.chan._event_pending()
            self.chan.transport._send_user_message(msg)  # type: ignore[union-attr]
        except (ImportError, AttributeError):  # another paramiko: the plain, waiting request
            self.chan.exec_command(command)

    def send(self, data: bytes) -> None:
        send_all(self.chan, data)

    def recv(self, n: int) -> bytes:
        return self.chan.recv(n)

    def close_write(self) -> None:
        self.chan.shutdown_write()

    def close(self) -> None:
        self.chan.close()

    def ended(self) -> tuple[int | None, bytes]:
        err = b""
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and not self.chan.exit_status_ready():
            time.sleep(0.05)
        while self.chan.recv_stderr_ready():
            err += self.chan.recv_stderr(65536)
        rc = self.chan.exit_status if self.chan.exit_status_ready() else None
        transport = self.chan.get_transport()
        if rc in (None, -1) and not err.strip() and (transport is None or not transport.is_active()):
            return None, b""  # paramiko reports -1 when the connection, not the program, ended
        return rc, err


class LocalPipe:
    """ARGV as a subprocess of this machine (the one-host pod)."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self.proc.stdin and self.proc.stdout

    def send(self, data: bytes) -> None:
        assert self.proc.stdin
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def recv(self, n: int) -> bytes:
        assert self.proc.stdout
        return self.proc.stdout.read1(n)  # type: ignore[attr-defined]

    def close_write(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()

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
