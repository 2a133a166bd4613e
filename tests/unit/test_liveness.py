"""A connection is silent only where nothing it sent waits unread here: `ssh.unread`, which the keepalive and a
relay link's silence consult before giving a worker up (this process starved of CPU is behind, not the worker)."""

from __future__ import annotations

import socket
from types import SimpleNamespace

from tpurun.transport.ssh import unread


def test_unread_counts_what_waits_in_the_socket_and_nothing_where_there_is_none():
    here, there = socket.socketpair()
    with here, there:
        transport = SimpleNamespace(sock=here)
        assert unread(transport) == 0  # type: ignore[arg-type]
        there.sendall(b"x" * 10)
        there.sendall(b"y" * 5)
        assert unread(transport) == 15  # type: ignore[arg-type]
        assert here.recv(100) == b"x" * 10 + b"y" * 5
        assert unread(transport) == 0  # type: ignore[arg-type]
    assert unread(SimpleNamespace(sock=object())) == 0  # type: ignore[arg-type]  # a ProxyCommand: no socket
    assert unread(SimpleNamespace(sock=here)) == 0  # type: ignore[arg-type]  # closed
