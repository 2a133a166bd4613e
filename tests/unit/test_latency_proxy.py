"""The latency proxy used by benchmarks and WAN tests: it adds one RTT per round trip, keeps order, and drops."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tpurun.testing.latency_proxy import LatencyProxy, ProxyGroup, pin_proxies, proxy_address


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[0], server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _connect(proxy: LatencyProxy) -> socket.socket:
    s = socket.create_connection(proxy.address, timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def _ping(s: socket.socket) -> float:
    t0 = time.perf_counter()
    s.sendall(b"ping")
    assert _recv_exactly(s, 4) == b"ping"
    return time.perf_counter() - t0


def test_round_trip_costs_one_rtt(echo):
    with LatencyProxy(("127.0.0.1", 0), echo, rtt=0.05) as proxy, _connect(proxy) as s:
        _ping(s)  # warm up: the proxy's connection to the target
        times = sorted(_ping(s) for _ in range(5))
        assert 0.050 <= times[0] and times[len(times) // 2] < 0.080, times
        proxy.set_rtt(0.0)  # changeable at runtime
        _ping(s)  # a chunk already in flight may still carry the old delay
        assert min(_ping(s) for _ in range(3)) < 0.02


def test_order_preserved_and_pipelined(echo):
    with LatencyProxy(("127.0.0.1", 0), echo, rtt=0.05) as proxy, _connect(proxy) as s:
        payload = b"".join(b"%06d\n" % i for i in range(20000))  # 140 kB in many small writes
        t0 = time.perf_counter()
        for i in range(0, len(payload), 700):
            s.sendall(payload[i : i + 700])
        got = _recv_exactly(s, len(payload))
        elapsed = time.perf_counter() - t0
        assert got == payload
        assert elapsed < 1.0  # in-flight chunks overlap: not one RTT per chunk


def test_drop_stops_traffic_but_keeps_sockets(echo):
    with LatencyProxy(("127.0.0.1", 0), echo, rtt=0.0) as proxy, _connect(proxy) as s:
        _ping(s)
        proxy.set_drop(True)
        s.sendall(b"lost")
        s.settimeout(0.3)
        with pytest.raises(TimeoutError):
            s.recv(16)  # nothing comes back, and the socket is not closed (that would be b"")
        # a new connection is accepted but answers nothing
        with _connect(proxy) as s2:
            s2.settimeout(0.3)
            s2.sendall(b"hello")
            with pytest.raises(TimeoutError):
                s2.recv(16)
        proxy.set_drop(False)
        s.settimeout(5)
        assert _ping(s) < 0.5


def test_group_and_known_hosts(echo, tmp_path: Path):
    assert proxy_address("127.77.3.2") == "127.78.3.2"
    group = ProxyGroup(rtt=0.02)
    try:
        a = group.add(("127.0.0.1", 0), echo)
        b = group.add(("127.0.0.1", 0), echo)
        group.start()
        with _connect(a) as s1, _connect(b) as s2:
            assert _ping(s1) >= 0.02 and _ping(s2) >= 0.02
    finally:
        group.close()
    kh = tmp_path / "known_hosts"
    kh.write_text("127.77.3.1 ssh-ed25519 AAAAkey1\n127.77.3.2 ssh-ed25519 AAAAkey2\n")
    pin_proxies(kh, {"127.77.3.1": "127.78.3.1", "127.77.3.2": "127.78.3.2:2222"})
    pin_proxies(kh, {"127.77.3.1": "127.78.3.1"})  # idempotent
    assert kh.read_text().splitlines()[2:] == [
        "127.78.3.1 ssh-ed25519 AAAAkey1",
        "[127.78.3.2]:2222 ssh-ed25519 AAAAkey2",
    ]
