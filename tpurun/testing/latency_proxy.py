"""A latency-injecting TCP proxy: put it in front of a worker's sshd to make it look far away.

Every chunk read on one side is written to the other side RTT/2 later, in each direction, so a
request/response exchange costs one RTT on top of the real one; order is preserved and throughput
is not limited (chunks in flight are pipelined, as on a long fat link). The RTT can be changed at
runtime; `set_drop(True)` turns the proxy into "a worker that stops answering": bytes in either
direction are swallowed and new connections are accepted and left silent, but no socket is closed.

All proxies of one `ProxyGroup` share one asyncio loop on a daemon thread::

    group = ProxyGroup(rtt=0.05)
    proxy = group.add(listen=("127.78.3.1", 22), target=("127.77.3.1", 22))
    group.start()
    proxy.set_rtt(0.1); proxy.set_drop(True)
    group.close()

A single `LatencyProxy(...).start()` gets a private loop. `proxy_workers` puts a proxy in front of
every worker of an emulated node and returns the address map to give tpurun through the
`TPURUN_ADDRESS_MAP` environment variable (tpurun checks each worker's key under its identity, wherever it
connects). `pin_proxies` copies host keys pinned under the workers' addresses (by peers that look keys up
by address: OpenSSH, paramiko, rsync) to the proxy addresses, so that they check them strictly there too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

Address = tuple[str, int]

_CHUNK = 65536


class _LoopThread:
    """An asyncio event loop running on a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="latency-proxy", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Any, timeout: float = 10.0) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class LatencyProxy:
    """Forwards LISTEN to TARGET, delaying each chunk by RTT/2 in each direction."""

    def __init__(self, listen: Address, target: Address, rtt: float = 0.0, *, _loop: _LoopThread | None = None) -> None:
        self.listen = (listen[0], int(listen[1]))
        self.target = (target[0], int(target[1]))
        self.rtt = float(rtt)
        self.drop = False
        self.connections = 0  # accepted so far
        self.accepted: list[float] = []  # when each was accepted (time.monotonic())
        self._own_loop = _loop is None
        self._lt = _loop
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    # --- control (any thread) ---

    def start(self) -> LatencyProxy:
        if self._lt is None:
            self._lt = _LoopThread()
        self._lt.call(self._start())
        return self

    @property
    def address(self) -> Address:
        """Where it listens (the real port when it was asked to listen on port 0)."""
        return self.listen

    def set_rtt(self, rtt: float) -> None:
        """New round-trip time in seconds; applies to chunks read from now on."""
        self.rtt = max(0.0, float(rtt))

    def set_drop(self, drop: bool) -> None:
        """True: stop forwarding anything (sockets stay open). False: forward again."""
        self.drop = bool(drop)

    def close(self) -> None:
        if self._lt is None:
            return
        with contextlib.suppress(Exception):
            self._lt.call(self._close())
        if self._own_loop:
            self._lt.stop()
        self._lt = None

    def __enter__(self) -> LatencyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LatencyProxy({self.listen[0]}:{self.listen[1]} -> {self.target[0]}:{self.target[1]}, rtt={self.rtt})"

    # --- on the loop ---

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.listen[0], self.listen[1], reuse_address=True)
        self.listen = self._server.sockets[0].getsockname()[:2]

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        for t in list(self._tasks):
            t.cancel()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.accepted.append(time.monotonic())
        self._writers.add(cwriter)
        _nodelay(cwriter)
        try:
            if self.drop:  # a host that stopped answering: accept, say nothing, keep it open
                while await creader.read(_CHUNK):
                    pass
                return
            try:
                treader, twriter = await asyncio.open_connection(*self.target)
            except OSError:
                return
            self._writers.add(twriter)
            _nodelay(twriter)
            up = self._spawn(self._pipe(creader, twriter))
            down = self._spawn(self._pipe(treader, cwriter))
            await asyncio.gather(up, down, return_exceptions=True)
            self._writers.discard(twriter)
            twriter.close()
        finally:
            self._writers.discard(cwriter)
            cwriter.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Reader -> writer, each chunk delivered RTT/2 after it was read, in order."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def deliver() -> None:
            with contextlib.suppress(OSError):
                await _deliver()

        async def _deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if self.drop:
                    continue
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                with contextlib.suppress(OSError):
                    writer.write_eof()

        sender = self._spawn(deliver())
        try:
            while True:
                data = await reader.read(_CHUNK)
                if data and self.drop:
                    continue
                queue.put_nowait((loop.time() + self.rtt / 2, data))
                if not data:
                    break
            await sender
        except (OSError, asyncio.IncompleteReadError):
            sender.cancel()
        finally:
            if not sender.done():
                sender.cancel()


def _nodelay(writer: asyncio.StreamWriter) -> None:
    import socket

    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class ProxyGroup:
    """Many proxies on one shared loop thread; change RTT or drop for all of them at once."""

    def __init__(self, rtt: float = 0.0) -> None:
        self.rtt = rtt
        self.proxies: list[LatencyProxy] = []
        self._lt: _LoopThread | None = None

    def add(self, listen: Address, target: Address, rtt: float | None = None) -> LatencyProxy:
        if self._lt is None:
            self._lt = _LoopThread()
        p = LatencyProxy(listen, target, self.rtt if rtt is None else rtt, _loop=self._lt)
        self.proxies.append(p)
        return p

    def start(self) -> ProxyGroup:
        for p in self.proxies:
            if p._server is None:
                p.start()
        return self

    def set_rtt(self, rtt: float) -> None:
        self.rtt = rtt
        for p in self.proxies:
            p.set_rtt(rtt)

    def set_drop(self, drop: bool) -> None:
        for p in self.proxies:
            p.set_drop(drop)

    def close(self) -> None:
        for p in self.proxies:
            p.close()
        if self._lt is not None:
            self._lt.stop()
            self._lt = None

    def __enter__(self) -> ProxyGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def proxy_address(address: str, second_octet: int = 78) -> str:
    """127.77.S.I -> 127.78.S.I: the proxy's address for an emulated worker's address."""
    parts = address.split(".")
    if len(parts) != 4 or parts[0] != "127":
        raise ValueError(f"not a loopback IPv4 address: {address}")
    return ".".join([parts[0], str(second_octet), parts[2], parts[3]])


def proxy_workers(
    group: ProxyGroup, workers: Iterable[Address], *, second_octet: int = 78, port: int = 22
) -> dict[str, str]:
    """A proxy in GROUP in front of every (address, port) of WORKERS, listening on 127.<second_octet>.S.I:PORT.

    Returns the address map {"127.77.S.I": "127.78.S.I[:PORT]"} for `TPURUN_ADDRESS_MAP` (JSON).
    The proxies are started.
    """
    mapping: dict[str, str] = {}
    for address, target_port in workers:
        listen = proxy_address(address, second_octet)
        p = group.add((listen, port), (address, target_port))
        p.start()
        mapping[address] = listen if p.listen[1] == 22 else f"{listen}:{p.listen[1]}"
    return mapping


def address_map_env(mapping: dict[str, str]) -> str:
    """The value of TPURUN_ADDRESS_MAP for MAPPING."""
    return json.dumps(mapping, sort_keys=True)


def _host_field(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


def pin_proxies(known_hosts: Path, mapping: dict[str, str]) -> None:
    """Append to KNOWN_HOSTS, for every proxy address of MAPPING, the host keys pinned for its real address."""
    lines = known_hosts.read_text().splitlines() if known_hosts.exists() else []
    keys: dict[str, list[str]] = {}
    for line in lines:
        fields = line.split()
        if len(fields) >= 3 and not line.startswith("#"):
            for host in fields[0].split(","):
                keys.setdefault(host, []).append(" ".join(fields[1:]))
    have = set(lines)
    extra: list[str] = []
    for real, proxied in mapping.items():
        addr, _, port_s = proxied.partition(":")
        host = _host_field(addr, int(port_s or 22))
        for key in keys.get(real, []):
            line = f"{host} {key}"
            if line not in have:
                extra.append(line)
                have.add(line)
    if extra:
        known_hosts.parent.mkdir(parents=True, exist_ok=True)
        with known_hosts.open("a") as f:
            f.write("".join(x + "\n" for x in extra))


__all__: Sequence[str] = [
    "LatencyProxy",
    "ProxyGroup",
    "address_map_env",
    "pin_proxies",
    "proxy_address",
    "proxy_workers",
]
