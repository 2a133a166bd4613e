"""A user's ProxyCommand (`--via COMMAND`), run as OpenSSH runs one: `%h`, `%p`, `%r`, `%n` and `%%` expanded, the
line run by the shell (`sh -c 'exec COMMAND'`), its stdin and stdout the connection to the worker's sshd.

Here they are one end of a socket pair, whose other end paramiko reads and writes as its socket: the command's
exit is an end of file paramiko sees at once (paramiko's own ProxyCommand reads a pipe that never says so),
and nothing runs between the two (no thread per worker). Its stderr is kept, for the message when it fails."""

from __future__ import annotations

import re
import socket
import subprocess
import tempfile

from tpurun.errors import UsageError

TOKENS = "%h %p %r %n %%"  # what a ProxyCommand may name, as OpenSSH expands them


def expand(template: str, host: str, port: int, user: str) -> str:
    """TEMPLATE with the worker's HOST (%h, and %n: the name as given), PORT (%p), USER (%r) and %% (a %)."""
    values = {"h": host, "n": host, "p": str(port), "r": user, "%": "%"}

    def one(m: re.Match[str]) -> str:
        if m.group(1) not in values:
            raise UsageError(f"--via {template!r}: %{m.group(1)} is not a ProxyCommand token here (use {TOKENS})")
        return values[m.group(1)]

    return re.sub(r"%(.?)", one, template)


class ProxySocket:
    """A socket to a worker's sshd through COMMAND (expanded already): its end of a socket pair, the command
    holding the other as its stdin and stdout. Closing it closes that end and ends the command (TERM, then
    KILL), which is reaped: nothing of it stays."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.said: str | None = None  # why() as it was when closed
        self.sock, theirs = socket.socketpair()
        self.err = tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen(
                ["sh", "-c", f"exec {command}"],
                stdin=theirs.fileno(),
                stdout=theirs.fileno(),
                stderr=self.err,
                start_new_session=True,
            )
        finally:
            theirs.close()

    # what paramiko's Transport asks of a socket
    def send(self, data: bytes) -> int:
        return self.sock.send(data)

    def recv(self, size: int) -> bytes:
        return self.sock.recv(size)

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    @property
    def _closed(self) -> bool:
        return self.sock._closed  # type: ignore[attr-defined]

    def why(self) -> str:
        """The command's last line on stderr (why it ended, where it said), or how it ended."""
        if self.said is None:
            self.err.seek(0)
            lines = self.err.read()[-4096:].decode("utf-8", "replace").strip().splitlines()
            rc = self.proc.poll()
            if lines:
                return lines[-1].strip()
            return f"it exited with {rc}" if rc is not None else "it closed the connection"
        return self.said

    def close(self) -> None:
        if self.said is not None:
            return
        self.said = self.why()
        self.sock.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.err.close()
