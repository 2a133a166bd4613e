"""IAP's TCP forwarding: a byte stream to port 22 of a VM that has no external address, through Google's
tunnel service (its "SSH Relay v4" protocol over a WebSocket), opened as gcloud's `start-iap-tunnel` opens
it and handed to paramiko as a socket.

The wire: one binary WebSocket message per frame, numbers big-endian, each frame a 2-byte tag. The server's
first frame is CONNECT_SUCCESS_SID (u32 length, the session id); then DATA (u32 length, at most 16 KiB of the
stream) goes both ways, and ACK (u64: every byte received since the session began) tells the other side
what arrived. Unknown tags are ignored, as the protocol asks of clients. The server refuses by closing the
WebSocket with a code of its own: 4003 it could not reach the VM's port (no firewall rule lets IAP's range
in, or the VM is down), 4033 the account may not tunnel there, 4047 no such instance.

A tunnel is a `socket.socketpair()`: paramiko holds one end, two threads of the tunnel pump the other to and
from the WebSocket (and the WebSocket's own thread reads its socket). Closing either side ends the other:
paramiko's close ends the WebSocket; the server's close, or a WebSocket that breaks, ends paramiko's end of
the pair, which paramiko sees as a lost connection. A dropped tunnel is not resumed (`/v4/reconnect`): the SSH
connection on it is lost, as any connection is, and tpurun's commands handle that as they do today.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from tpurun.errors import UnreachableError

SUBPROTOCOL = "relay.tunnel.cloudproxy.app"
ORIGIN = "bot:iap-tunneler"  # what gcloud sends as the handshake's Origin

# the frames' tags
CONNECT_SUCCESS_SID = 0x0001
RECONNECT_SUCCESS_ACK = 0x0002
DATA = 0x0004
ACK = 0x0007

MAX_DATA = 16384  # the most one DATA frame carries (servers may refuse more)
ACK_AFTER = 2 * MAX_DATA  # bytes received and not yet acknowledged before an ACK goes (gcloud's rule)
IDLE_ACK = 2.0  # seconds: bytes received and not acknowledged are acknowledged after this much quiet (gcloud's)

# the server's close codes tpurun explains
BACKEND_FAILED = 4003  # it could not connect to the VM's port
NOT_AUTHORIZED = 4033
NOT_FOUND = 4047
LOOKUP_FAILED = 4051  # IAP Desktop reads it as "the backend could not be found", like 4047

IAP_RANGE = "35.235.240.0/20"  # where IAP's connections to the VMs come from (IPv4)
ROLE = "IAP-secured Tunnel User (roles/iap.tunnelResourceAccessor)"

_TAG = struct.Struct(">H")
_LEN = struct.Struct(">HI")
_U64 = struct.Struct(">HQ")


# ---------------------------------------------------------------------------- the frames


def data_frame(payload: bytes | memoryview) -> bytes:
    """A DATA frame of PAYLOAD (1 to MAX_DATA bytes)."""
    if not 0 < len(payload) <= MAX_DATA:
        raise ValueError(f"a DATA frame carries 1 to {MAX_DATA} bytes, not {len(payload)}")
    return _LEN.pack(DATA, len(payload)) + bytes(payload)


def ack_frame(received: int) -> bytes:
    """An ACK frame: RECEIVED bytes arrived since the session began."""
    return _U64.pack(ACK, received)


def sid_frame(sid: bytes) -> bytes:
    """A CONNECT_SUCCESS_SID frame (the server's first)."""
    return _LEN.pack(CONNECT_SUCCESS_SID, len(sid)) + sid


def parse(message: bytes) -> tuple[int, Any]:
    """One frame: (tag, value): the session id's bytes, DATA's payload (a memoryview), an ACK's count, None for a
    tag this client does not know. Bytes after the frame are ignored, as gcloud ignores them; a frame cut short is
    a ValueError."""
    if len(message) < _TAG.size:
        raise ValueError("a frame shorter than its tag")
    (tag,) = _TAG.unpack_from(message)
    if tag in (CONNECT_SUCCESS_SID, DATA):
        if len(message) < _LEN.size:
            raise ValueError(f"frame {tag:#06x} cut short")
        _, size = _LEN.unpack_from(message)
        if len(message) < _LEN.size + size:
            raise ValueError(f"frame {tag:#06x} announces {size} bytes, carries {len(message) - _LEN.size}")
        return tag, memoryview(message)[_LEN.size : _LEN.size + size]
    if tag in (ACK, RECONNECT_SUCCESS_ACK):
        if len(message) < _U64.size:
            raise ValueError(f"frame {tag:#06x} cut short")
        return tag, _U64.unpack_from(message)[1]
    return tag, None


# ---------------------------------------------------------------------------- where a tunnel goes


@dataclass(frozen=True)
class Instance:
    """A VM's port as IAP names it: its project, zone and instance name, and its network interface."""

    project: str
    zone: str
    name: str
    port: int = 22
    interface: str = "nic0"


def connect_url(base: str, instance: Instance) -> str:
    """The URL that opens a tunnel to INSTANCE, at BASE (`services.tunnel_url`): the query gcloud sends, in its
    order (`newWebsocket=True` included, as gcloud's current tunnel always sends it)."""
    query = urlencode(
        [
            ("project", instance.project),
            ("port", str(instance.port)),
            ("newWebsocket", "True"),
            ("zone", instance.zone),
            ("instance", instance.name),
            ("interface", instance.interface),
        ]
    )
    return f"{base}?{query}"


def firewall_command(project: str) -> str:
    """The gcloud command that makes the rule IAP needs (Google's own example, for the default network)."""
    return (
        "gcloud compute firewall-rules create allow-ssh-ingress-from-iap --direction=INGRESS --action=allow "
        f"--rules=tcp:22 --source-ranges={IAP_RANGE} --project={project} (and --network=NAME, for another network "
        "than default)"
    )


@dataclass
class Tunnels:
    """Where this process opens IAP tunnels (`services.tunnel_url`) and with which credentials: the ones the
    API is called with, as a bearer token refreshed before it expires. ACCOUNT names, for a refusal's message,
    the account tpurun acts as. One per command, shared by every worker's tunnel."""

    url: str
    credentials: Callable[[], Any]  # made on first use: a command on remembered workers loads google-auth only then
    account: Callable[[Any], str] = lambda credentials: ""  # the account these credentials act as
    _creds: Any = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def token(self) -> str:
        """A bearer token: "anonymous" for the emulator's anonymous credentials."""
        with self._lock:
            if self._creds is None:
                self._creds = self.credentials()
            creds = self._creds
            from google.auth.credentials import AnonymousCredentials

            if isinstance(creds, AnonymousCredentials):
                return "anonymous"
            if not creds.valid:
                import google.auth.transport.requests
                from google.auth.exceptions import GoogleAuthError

                try:
                    creds.refresh(google.auth.transport.requests.Request())
                except GoogleAuthError as exc:
                    raise UnreachableError(
                        f"cannot get a token for IAP's tunnels: {str(exc).splitlines()[0] if str(exc) else exc}",
                        hint="`gcloud auth application-default login`, or GOOGLE_APPLICATION_CREDENTIALS",
                    ) from None
            return str(creds.token)

    def who(self) -> str:
        try:
            return self.account(self._creds) or "the account tpurun acts as"
        except Exception:  # noqa: BLE001 - only a message's words: never a second error
            return "the account tpurun acts as"

    def open(self, instance: Instance, worker: str, timeout: float) -> socket.socket:
        """A tunnel to INSTANCE, for WORKER (how messages name it; "": the instance alone): the end of it paramiko
        reads and writes.
        UnreachableError within TIMEOUT seconds, in one line, where IAP refuses or cannot be reached."""
        return _open(self, instance, worker, timeout)


def _open(tunnels: Tunnels, instance: Instance, worker: str, timeout: float) -> socket.socket:
    from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, WebSocketException
    from websockets.sync.client import connect
    from websockets.typing import Origin, Subprotocol

    from tpurun import __version__

    url = connect_url(tunnels.url, instance)
    to = f"worker {worker} (instance {instance.name})" if worker else f"instance {instance.name}"
    try:
        ws = connect(
            url,
            origin=Origin(ORIGIN),
            subprotocols=[Subprotocol(SUBPROTOCOL)],
            additional_headers={"Authorization": f"Bearer {tunnels.token()}"},
            user_agent_header=f"tpurun/{__version__}",
            compression=None,
            open_timeout=timeout,
            ping_interval=None,  # gcloud sends none; SSH's keepalive notices a silent worker
            close_timeout=2,
            max_size=1 << 20,
        )
    except InvalidStatus as exc:
        status = exc.response.status_code
        if status in (401, 403):
            raise UnreachableError(
                f"IAP refused tpurun's credentials (HTTP {status}) for a tunnel to {to}",
                hint="`gcloud auth application-default login` (or GOOGLE_APPLICATION_CREDENTIALS); behind a proxy, "
                "it must let WebSockets through to tunnel.cloudproxy.app",
            ) from None
        raise UnreachableError(f"IAP answered HTTP {status} for a tunnel to {to}") from None
    except (InvalidHandshake, WebSocketException) as exc:  # (a proxy refused, a URL websockets cannot take)
        raise UnreachableError(f"IAP's handshake for a tunnel to {to} failed: {exc}") from None
    except (OSError, TimeoutError) as exc:
        why = "no answer in time" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc)).lower()
        raise UnreachableError(f"cannot reach IAP at {tunnels.url} for a tunnel to {to}: {why}") from None
    try:
        first = ws.recv(timeout=timeout)
        tag, _ = parse(first) if isinstance(first, bytes) else (None, None)
    except ConnectionClosed as exc:
        ws.close()
        code, reason = (exc.rcvd.code, exc.rcvd.reason) if exc.rcvd else (None, "")
        raise _refused(tunnels, instance, to, code, reason) from None
    except TimeoutError:
        ws.close()
        raise UnreachableError(f"IAP did not open a tunnel to {to} within {timeout:.0f} s") from None
    except ValueError as exc:
        ws.close()
        raise UnreachableError(f"IAP's first frame for a tunnel to {to} was not a session: {exc}") from None
    if tag != CONNECT_SUCCESS_SID:
        ws.close()
        raise UnreachableError(f"IAP's first frame for a tunnel to {to} was not a session (tag {tag})")
    mine, theirs = socket.socketpair()
    _Pump(ws, mine, worker).start()
    return theirs


def _refused(tunnels: Tunnels, instance: Instance, to: str, code: int | None, reason: str) -> UnreachableError:
    """IAP's refusal of TO, closed with CODE and REASON, said in one line with what to do."""
    said = f"IAP said {code}: {reason}" if reason else f"IAP said {code}"
    if code == BACKEND_FAILED:
        return UnreachableError(
            f"IAP cannot reach port {instance.port} of {to}: no firewall rule lets IAP's range {IAP_RANGE} in to "
            f"tcp:{instance.port}, or the VM is down ({said})",
            hint=f"add the rule once for the TPU's network: {firewall_command(instance.project)}",
        )
    if code == NOT_AUTHORIZED:
        return UnreachableError(
            f"IAP refused {tunnels.who()} a tunnel to {to} ({said})",
            hint=f"it takes the {ROLE} role in project {instance.project}; IAM changes take a few minutes",
        )
    if code in (NOT_FOUND, LOOKUP_FAILED):
        return UnreachableError(
            f"IAP knows no instance {instance.name} in zone {instance.zone} of project {instance.project}, for a tunnel to {to} "
            f"({said})",
            hint="the TPU was deleted or made anew: `tpurun describe NAME` shows it",
        )
    return UnreachableError(f"IAP closed the tunnel to {to} ({said if code else 'without a close code'})")


class _Pump:
    """The two threads between a tunnel's WebSocket and this process's end of its socket pair."""

    def __init__(self, ws: Any, sock: socket.socket, worker: str) -> None:
        self.ws, self.sock = ws, sock
        self.received = self.acked = 0
        self.down = threading.Thread(target=self._down, daemon=True, name=f"iap-down-{worker}")
        self.up = threading.Thread(target=self._up, daemon=True, name=f"iap-up-{worker}")

    def start(self) -> None:
        self.down.start()
        self.up.start()

    def _ack(self) -> None:
        if self.received > self.acked:
            self.acked = self.received
            self.ws.send(ack_frame(self.received))

    def _down(self) -> None:
        """What IAP sends, into the pair; ACKs as gcloud sends them. Ends paramiko's side when the tunnel ends."""
        try:
            while True:
                try:
                    message = self.ws.recv(timeout=IDLE_ACK)
                except TimeoutError:
                    self._ack()
                    continue
                if not isinstance(message, bytes):
                    continue
                tag, value = parse(message)
                if tag == DATA and len(value):
                    self.sock.sendall(value)
                    self.received += len(value)
                    if self.received - self.acked > ACK_AFTER:
                        self._ack()
                elif tag in (CONNECT_SUCCESS_SID, RECONNECT_SUCCESS_ACK):
                    break  # a second session on a session: the protocol broken, the tunnel ended
        except Exception:  # noqa: BLE001 - closed, broken or cut: the tunnel ends, paramiko says so
            pass
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # paramiko reads the end; _up's read ends too
        except OSError:
            pass
        self.ws.close()

    def _up(self) -> None:
        """What paramiko writes, to IAP in DATA frames; at its end (paramiko closed), the WebSocket closed. Each
        frame is read into one buffer behind its header, which websockets copies as it masks it: no other copy."""
        frame = bytearray(_LEN.size + MAX_DATA)
        view = memoryview(frame)
        try:
            while True:
                size = self.sock.recv_into(view[_LEN.size :])
                if not size:
                    break
                _LEN.pack_into(frame, 0, DATA, size)
                self.ws.send(view[: _LEN.size + size])
        except Exception:  # noqa: BLE001 - closed, broken or cut: the tunnel ends
            pass
        self.ws.close()  # a normal close (1000); _down's recv ends with it
        self.down.join()
        self.sock.close()
