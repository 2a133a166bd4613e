"""IAP's TCP forwarding as the emulator serves it: the relay v4 WebSocket endpoint that gcloud's `start-iap-tunnel`
speaks to at wss://tunnel.cloudproxy.app/v4/connect, served on the emulator's one HTTP endpoint (ws://, the API's
host and port), each tunnel one TCP connection from IAP's stand-in source address (model.IAP_SOURCE) to a VM's
internal address and port.

The handshake is taken over from http.server's handler: the request line and headers it has read are fed again to
websockets' sans-I/O ServerProtocol, which answers 101 with the subprotocol `relay.tunnel.cloudproxy.app` echoed;
websockets' threading Connection then carries the messages. Refused at the handshake: no bearer token (401: any
non-empty token is taken, since the emulator's clients hold no real credentials), a missing tunnel argument (400),
no subprotocol or no upgrade (websockets' 400 or 426). Then, as close codes after the 101: 4033 'not authorized'
where an administrator denied tunnels to the project (org.TunnelAccess), 4047 'Failed to lookup instance' for no
such VM in the project and zone (a Cloud TPU worker by its hostname, a Compute Engine VM by its name; interface
nic0), 4003 'failed to connect to backend' where no enabled ingress rule lets IAP's range reach tcp:PORT, the VM is
down or nothing listens there.

The messages, each one binary WebSocket message, never fragmented, numbers big-endian: CONNECT_SUCCESS_SID first,
then DATA (a payload of 1 to 16384 bytes) both ways and ACK (the bytes received so far). The emulator acks the
client's bytes as gcloud does (once more than two messages' worth is unacknowledged, and after 2 s without a
message), checks the client's acks (never lower than the last, never beyond what it was sent), and never pings
(gcloud's own client takes a ping for an error). Its closes always carry a code. There is no reconnect: a
/v4/reconnect is answered 4001. Sources: docs/emulator.md (IAP).
"""

from __future__ import annotations

import socket
import struct
import threading
import uuid
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.server import ServerProtocol
from websockets.sync.connection import Connection
from websockets.typing import Subprotocol

from tpurun.emulator.model import IAP_RANGE, IAP_SOURCE

if TYPE_CHECKING:
    from tpurun.emulator.state import Emulator

TUNNEL_PREFIX = "/v4/"  # the path under which every relay v4 endpoint lies
CONNECT, RECONNECT = "/v4/connect", "/v4/reconnect"
SUBPROTOCOL = "relay.tunnel.cloudproxy.app"
REQUIRED = ("project", "zone", "instance", "interface", "port")  # an instance target's tunnel arguments
CONNECT_SUCCESS_SID, DATA, ACK = 0x0001, 0x0004, 0x0007  # the relay's tags (RECONNECT_SUCCESS_ACK, 2: never sent)
MAX_DATA = 16384  # a DATA message's most bytes
ACK_AFTER = 2 * MAX_DATA  # unacknowledged bytes past which an ACK goes at once
IDLE = 2.0  # seconds without a message after which what came is acked
CONNECT_TIMEOUT = 5.0
CLOSE_TIMEOUT = 5.0

Close = tuple[int, str]  # a close frame's code and reason
NORMAL: Close = (1000, "")
STOPPING: Close = (1001, "the emulator stops")
SID_UNKNOWN: Close = (4001, "unknown session")
BACKEND: Close = (4003, "failed to connect to backend")
BAD_ACK: Close = (4005, "bad ack")  # lower than the last
INVALID_ACK: Close = (4006, "invalid ack")  # beyond what was sent
INVALID_OPCODE: Close = (4007, "invalid websocket opcode")
INVALID_TAG: Close = (4008, "invalid tag")
WRITE_FAILED: Close = (4009, "destination write failed")
READ_FAILED: Close = (4010, "destination read failed")
INVALID_DATA: Close = (4013, "invalid data")
NOT_AUTHORIZED: Close = (4033, "not authorized")
LOOKUP_FAILED: Close = (4047, "Failed to lookup instance")


def frame(tag: int, payload: bytes) -> bytes:
    """A relay message whose PAYLOAD is an array (CONNECT_SUCCESS_SID, DATA): tag, length, bytes."""
    return struct.pack(">HI", tag, len(payload)) + payload


def ack(count: int) -> bytes:
    return struct.pack(">HQ", ACK, count)


class Tunnels:
    """The endpoint and the tunnels open through it, which the server's stop ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[_Tunnel] = set()

    def serve(self, handler: BaseHTTPRequestHandler, emu: Emulator) -> None:
        """Serve HANDLER's request (GET /v4/...) on its connection until the tunnel ends."""
        handler.close_connection = True
        parts = urlsplit(handler.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        proto = ServerProtocol(subprotocols=[Subprotocol(SUBPROTOCOL)])
        response = _handshake(handler, proto, parts.path, query)
        proto.send_response(response)
        sock = handler.connection
        sock.sendall(b"".join(proto.data_to_send()))
        if response.status_code != 101:
            emu.log_request("GET", parts.path, response.status_code, f"{parts.query} {response.reason_phrase}")
            return
        conn = Connection(sock, proto, ping_interval=None, close_timeout=CLOSE_TIMEOUT)
        try:
            backend = _backend(emu, query) if parts.path == CONNECT else SID_UNKNOWN
        except Exception as e:  # a bug here must still close the tunnel as a server would, with a code
            emu.log_event("internal-error", f"IAP tunnel {parts.query}: {type(e).__name__}: {e}")
            backend = (1011, "internal error")
        if not isinstance(backend, socket.socket):
            emu.log_request("GET", parts.path, 101, f"{parts.query} closed {backend[0]} {backend[1]!r}")
            conn.close(*backend)
            return
        emu.log_request("GET", parts.path, 101, f"{parts.query} connected")
        tunnel = _Tunnel(conn, backend)
        with self._lock:
            self._open.add(tunnel)
        try:
            tunnel.run()
        finally:
            with self._lock:
                self._open.discard(tunnel)

    def close_all(self) -> None:
        """End every open tunnel (the server stops), each on a thread of its own: a client that reads nothing more
        would hold its close."""
        with self._lock:
            tunnels = list(self._open)
        for t in tunnels:
            threading.Thread(target=t.end, args=(STOPPING,), name="iap-tunnel-stop", daemon=True).start()


def _handshake(handler: BaseHTTPRequestHandler, proto: ServerProtocol, path: str, query: dict[str, str]) -> Response:
    """The answer to HANDLER's upgrade request: 101, or why not (no bearer token, a tunnel argument missing, no
    subprotocol or no upgrade)."""
    head = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in handler.headers.items())
    line: bytes = getattr(handler, "raw_requestline")  # noqa: B009 - set by handle_one_request, not declared
    proto.receive_data(line + head + b"\r\n")  # http.server read them; the protocol's parser needs them
    request = next((e for e in proto.events_received() if isinstance(e, Request)), None)
    scheme, _, token = (handler.headers.get("Authorization") or "").partition(" ")
    missing = [k for k in REQUIRED if not query.get(k)] if path == CONNECT else []
    port = query.get("port", "")
    if path == CONNECT and not missing and not (port.isdigit() and 0 < int(port) < 65536):
        missing = ["port"]
    if request is None or path not in (CONNECT, RECONNECT):
        return proto.reject(404, "Not Found\n")
    if scheme.lower() != "bearer" or not token.strip():
        return proto.reject(401, "Request is missing required authentication credential.\n")
    if missing:
        return proto.reject(400, f"Missing required tunnel argument: {missing[0]}\n")
    return proto.accept(request)


def _backend(emu: Emulator, query: dict[str, str]) -> socket.socket | Close:
    """The connection a tunnel asked for by QUERY, from IAP's stand-in address, or why there is none."""
    project, zone, instance = query["project"], query["zone"], query["instance"]
    if not emu.org.iap.allows(project):
        return NOT_AUTHORIZED
    vm = emu.network_vm(project, zone, instance) if query["interface"] == "nic0" else None
    if vm is None:
        return LOOKUP_FAILED
    port = int(query["port"])
    if not vm.running or not emu.ingress_allowed(vm, "tcp", port, IAP_RANGE):
        return BACKEND
    try:
        return socket.create_connection((vm.address, port), CONNECT_TIMEOUT, (IAP_SOURCE, 0))
    except OSError:
        return BACKEND


class _Tunnel:
    """One tunnel: this thread carries the client's messages to the backend, a thread of its own the backend's bytes
    to the client; both end with it."""

    def __init__(self, conn: Connection, backend: socket.socket) -> None:
        self.conn, self.backend = conn, backend
        backend.settimeout(None)
        backend.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sent = 0  # bytes sent to the client, counted before they leave (its ack may come back at once)
        self.lock = threading.Lock()
        self.ending = threading.Event()

    def run(self) -> None:
        out = threading.Thread(target=self._from_backend, name="iap-tunnel", daemon=True)
        try:
            self.conn.send(frame(CONNECT_SUCCESS_SID, str(uuid.uuid4()).encode()))
            out.start()
            self._to_backend()
        except ConnectionClosed:
            pass  # the client left
        finally:
            self.end(NORMAL)
            if out.is_alive():
                out.join()

    def end(self, close: Close) -> None:
        """Close the client's side with CLOSE and the backend's; the first call decides the code (the other thread
        then finds its side ended and says nothing of it)."""
        with self.lock:
            if self.ending.is_set():
                return
            self.ending.set()
        try:
            self.backend.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected any more
        self.backend.close()
        self.conn.close(*close)

    def _to_backend(self) -> None:
        received = acked = client_ack = 0
        while True:
            try:
                msg = self.conn.recv(timeout=IDLE)
            except TimeoutError:
                if received > acked:
                    self.conn.send(ack(received))
                    acked = received
                continue
            if isinstance(msg, str):
                self.end(INVALID_OPCODE)
                return
            tag = int.from_bytes(msg[:2], "big") if len(msg) >= 2 else 0
            if tag == DATA:
                n = int.from_bytes(msg[2:6], "big") if len(msg) >= 6 else 0
                if not 0 < n <= MAX_DATA or len(msg) != 6 + n:
                    self.end(INVALID_DATA)
                    return
                try:
                    self.backend.sendall(msg[6:])
                except OSError:
                    if not self.ending.is_set():
                        self.end(WRITE_FAILED)
                    return
                received += n
                if received - acked > ACK_AFTER:
                    self.conn.send(ack(received))
                    acked = received
            elif tag == ACK and len(msg) == 10:
                value = int.from_bytes(msg[2:], "big")
                with self.lock:
                    sent = self.sent
                if value < client_ack:
                    self.end(BAD_ACK)
                    return
                if value > sent:
                    self.end(INVALID_ACK)
                    return
                client_ack = value
            else:
                self.end(INVALID_TAG)
                return

    def _from_backend(self) -> None:
        try:
            while True:
                data = self.backend.recv(MAX_DATA)
                if not data:  # the backend ended its side (or `end` did)
                    self.end(NORMAL)
                    return
                with self.lock:
                    self.sent += len(data)
                self.conn.send(frame(DATA, data))
        except ConnectionClosed:
            pass  # the client left: the other thread ends the tunnel
        except OSError:
            if not self.ending.is_set():
                self.end(READ_FAILED)
