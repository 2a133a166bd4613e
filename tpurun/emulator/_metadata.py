"""The emulated GCE metadata server of the workers (``metadata.google.internal``).

One HTTP listener per worker address (loopback only, port 80 by default), all driven by
a single selector thread; each request is then handled on its own short-lived thread.
Each worker's ``/etc/hosts`` maps ``metadata.google.internal`` to the worker's own
address, so a worker reaches *its* metadata (worker number, guest attributes, ...).

Served below ``/computeMetadata/v1/`` (header ``Metadata-Flavor: Google`` required,
403 otherwise): the tree a `MetadataSource` returns (directory listings, leaves as text,
``?recursive=true`` / ``?alt=json`` as JSON), ``instance/guest-attributes/NS/KEY``
(PUT stores, GET reads) and ``oslogin/...`` (the source's answers, JSON; POST for 2FA's sessions).

Every answer of the tree carries an ``ETag`` (a hash of its body). ``?wait_for_change=true`` holds a GET
until its answer differs from ``last_etag`` (from the answer at the time of asking, without one), or for
``timeout_sec`` seconds, then answers as a plain GET would. A change of a host's events or of the metadata a
node, a VM or a project is given wakes the GETs waiting at once (`MetadataService.touch`); any other change of
the tree is seen within `RECHECK` seconds.
"""

from __future__ import annotations

import hashlib
import json
import re
import selectors
import socket
import sys
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import TCPServer, ThreadingMixIn
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

PREFIX = "/computeMetadata/v1"
_MAX_GUEST_VALUE = 256 * 1024
RECHECK = 5.0  # seconds between two looks of a waiting GET at a tree no one told it had changed


class JsonText(str):
    """A leaf served as `application/json` (a service account's token, as the real server sends it)."""


class MetadataSource(Protocol):
    def tree(self) -> dict[str, Any]:
        """The whole metadata tree of one worker: nested dicts, leaves are strings."""
        ...

    def oslogin(self, path: list[str], query: dict[str, str], body: Any = None) -> tuple[int, Any]:
        """The status and answer (JSON-ready, or text) of `oslogin/PATH?QUERY` (a POST's JSON BODY)."""
        ...

    def guest_get(self, namespace: str, key: str) -> str | None: ...

    def guest_put(self, namespace: str, key: str, value: str) -> None: ...

    def guest_items(self) -> dict[tuple[str, str], str]: ...


TEXT = "application/text"
_Answer = tuple[int, str, str]  # (status, body, content type)


def _flag(query: dict[str, list[str]], name: str) -> bool:
    return query.get(name, ["false"])[0].lower() == "true"


def _etag(body: str) -> str:
    """The ETag of an answer whose body is BODY: the same body, the same tag (16 hex digits, as Google's)."""
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def _camel(name: str) -> str:
    head, *rest = name.split("-")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def _recursive_json(node: Any, *, raw_keys: bool = False) -> Any:
    # Like GCE: recursive listings use camelCase keys, but user-chosen keys (attributes) stay as given.
    if not isinstance(node, dict):
        return node
    return {(k if raw_keys else _camel(k)): _recursive_json(v, raw_keys=(k == "attributes")) for k, v in node.items()}


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "Metadata Server for VM"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def _reply(self, code: int, body: str, ctype: str = TEXT, etag: str | None = None) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Metadata-Flavor", "Google")
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        if etag is not None:
            self.send_header("ETag", etag)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _route(self) -> tuple[list[str], dict[str, list[str]]] | None:
        if self.headers.get("Metadata-Flavor") != "Google":
            self._reply(403, "Missing required header: Metadata-Flavor: Google\n", "text/plain")
            return None
        url = urlsplit(self.path)
        if url.path.rstrip("/") in ("", "/computeMetadata"):
            self._reply(200, "computeMetadata/\n" if url.path in ("", "/") else "v1/\n")
            return None
        if not (url.path == PREFIX or url.path.startswith(PREFIX + "/")):
            self._reply(404, "Not Found\n", "text/plain")
            return None
        parts = [p for p in url.path[len(PREFIX) :].split("/") if p]
        return parts, parse_qs(url.query)

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        routed = self._route()
        if routed is None:
            return
        parts, query = routed
        if parts[:1] == ["oslogin"]:
            self._oslogin(parts, query)
            return
        answer = self._answer(parts, query)
        if answer[0] == 200 and _flag(query, "wait_for_change"):
            try:
                timeout = float(query["timeout_sec"][0]) if "timeout_sec" in query else None
            except ValueError:
                self._reply(400, "Bad Request\n", "text/plain")
                return
            answer = self._changed(parts, query, answer, query.get("last_etag", [""])[0], timeout)
        code, body, ctype = answer
        self._reply(code, body, ctype, _etag(body) if code == 200 else None)

    def _changed(
        self, parts: list[str], query: dict[str, list[str]], answer: _Answer, last: str, timeout: float | None
    ) -> _Answer:
        """ANSWER once it differs from the one whose ETag is LAST (from ANSWER itself, when LAST is empty), or
        after TIMEOUT seconds (None: none) as it is then."""
        want = last or _etag(answer[1])
        deadline = None if timeout is None else time.monotonic() + timeout
        changed = self.server.changed
        while answer[0] == 200 and _etag(answer[1]) == want:
            left = RECHECK if deadline is None else min(RECHECK, deadline - time.monotonic())
            if left <= 0:
                break
            with changed:
                changed.wait(left)
            if self._hung_up():
                break
            answer = self._answer(parts, query)
        return answer

    def _hung_up(self) -> bool:
        """The client closed its end while its GET waited (nothing else may come on a GET's connection here)."""
        try:  # (not select(): this process holds more than its 1,024 descriptors at 256 workers)
            return not self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False  # nothing to read: the client still waits
        except OSError:
            return True

    def _answer(self, parts: list[str], query: dict[str, list[str]]) -> _Answer:
        """(status, body, content type) of a GET of PARTS below the prefix, as things are now."""
        src = self.server.source
        if parts[:2] == ["instance", "guest-attributes"]:
            items = src.guest_items()
            node: Any = {}
            for (ns, key), value in items.items():
                node.setdefault(ns, {})[key] = value
            tree: Any = node
            parts = parts[2:]
        else:
            tree = src.tree()
        for p in parts:
            if not isinstance(tree, dict) or p not in tree:
                return 404, "Not Found\n", "text/plain"
            tree = tree[p]
        as_json = query.get("alt", [""])[0] == "json"
        if isinstance(tree, dict):
            if _flag(query, "recursive") or as_json:
                raw = bool(parts) and parts[-1] == "attributes"
                return 200, json.dumps(_recursive_json(tree, raw_keys=raw)), "application/json"
            return 200, "".join(k + ("/" if isinstance(v, dict) else "") + "\n" for k, v in tree.items()), TEXT
        if isinstance(tree, JsonText):
            return 200, str(tree), "application/json"
        if as_json:
            return 200, json.dumps(tree), "application/json"
        return 200, str(tree), TEXT

    do_HEAD = do_GET

    def _oslogin(self, parts: list[str], query: dict[str, list[str]], body: Any = None) -> None:
        code, answer = self.server.source.oslogin(parts[1:], {k: v[-1] for k, v in query.items()}, body)
        if isinstance(answer, str):
            self._reply(code, answer, "text/plain")
        else:
            self._reply(code, json.dumps(answer), "application/json")

    def do_POST(self) -> None:  # noqa: N802
        routed = self._route()
        if routed is None:
            return
        parts, query = routed
        length = int(self.headers.get("Content-Length") or 0)
        if parts[:1] != ["oslogin"] or length > _MAX_GUEST_VALUE:
            self._reply(405 if parts[:1] != ["oslogin"] else 400, "Bad Request\n", "text/plain")
            return
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            self._reply(400, "Bad Request\n", "text/plain")
            return
        self._oslogin(parts, query, body if isinstance(body, dict) else {})

    def do_PUT(self) -> None:  # noqa: N802
        routed = self._route()
        if routed is None:
            return
        parts, _ = routed
        if len(parts) != 4 or parts[:2] != ["instance", "guest-attributes"]:
            self._reply(405, "Method Not Allowed\n", "text/plain")
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > _MAX_GUEST_VALUE:
            self._reply(400, "value too large\n", "text/plain")
            return
        value = self.rfile.read(length).decode("utf-8", "replace")
        self.server.source.guest_put(parts[2], parts[3], value)
        self._reply(200, "")


class _Server(ThreadingMixIn, HTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], source: MetadataSource, changed: threading.Condition) -> None:
        self.source = source
        self.changed = changed  # notified when a tree changed (`MetadataService.touch`)
        super().__init__(address, _Handler)

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that hung up before its answer (one that gave up waiting on a loaded machine) is the client's
        business, as on the real metadata server; anything else is the emulator's bug and printed."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]

    def server_bind(self) -> None:
        # HTTPServer.server_bind does a reverse DNS lookup (getfqdn); skip it.
        TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])


class MetadataService:
    """All workers' metadata listeners, served by one selector thread."""

    def __init__(self, port: int = 80) -> None:
        self.port = port
        self._sel = selectors.DefaultSelector()
        self._servers: dict[str, _Server] = {}
        self._ops: list[tuple[str, _Server, threading.Event]] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, name="tpurun-metadata", daemon=True)
        self._thread.start()

    def _submit(self, op: str, server: _Server) -> None:
        done = threading.Event()
        with self._lock:
            if self._closed:
                server.server_close()
                return
            self._ops.append((op, server, done))
        self._wake_w.send(b"x")
        done.wait()

    def touch(self) -> None:
        """Something a worker's tree shows changed: the GETs waiting for a change look again now."""
        with self._changed:
            self._changed.notify_all()

    def add(self, address: str, source: MetadataSource) -> None:
        """Start serving `source` on address:port (replacing what served there before)."""
        self.remove(address)
        server = _Server((address, self.port), source, self._changed)  # binds now: errors surface here
        with self._lock:
            self._servers[address] = server
        self._submit("add", server)

    def remove(self, address: str) -> None:
        """Stop serving on `address`; the port is free when this returns."""
        with self._lock:
            server = self._servers.pop(address, None)
        if server is not None:
            self._submit("remove", server)

    def addresses(self) -> list[str]:
        with self._lock:
            return list(self._servers)

    def close(self) -> None:
        for address in self.addresses():
            self.remove(address)
        with self._lock:
            self._closed = True
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        self._wake_r.close()
        self._wake_w.close()
        self._sel.close()

    def _loop(self) -> None:
        while True:
            for key, _ in self._sel.select(timeout=1.0):
                if key.data is None:
                    try:
                        self._wake_r.recv(4096)
                    except BlockingIOError:
                        pass
                    with self._lock:
                        ops, self._ops = self._ops, []
                        closed = self._closed
                    for op, server, done in ops:
                        if op == "add":
                            self._sel.register(server.socket, selectors.EVENT_READ, server)
                        else:
                            self._sel.unregister(server.socket)
                            server.server_close()
                        done.set()
                    if closed:
                        return
                else:
                    server = key.data
                    server._handle_request_noblock()  # accept + hand off to a thread


_USER_RE = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")


def parse_ssh_keys(value: str, *, now: datetime | None = None) -> dict[str, list[str]]:
    """``ssh-keys`` metadata -> {user: [authorized_keys lines]}; skips bad lines and expired keys."""
    now = now or datetime.now(timezone.utc)
    users: dict[str, list[str]] = {}
    for raw in value.splitlines():
        line = raw.strip()
        user, sep, key = line.partition(":")
        if not sep or not _USER_RE.match(user):
            continue
        parts = key.split(None, 2)
        if len(parts) < 2:
            continue
        ktype, kdata = parts[0], parts[1]
        comment = parts[2] if len(parts) > 2 else ""
        if comment.startswith("google-ssh "):
            try:
                expire = json.loads(comment[len("google-ssh ") :]).get("expireOn")
                if expire and datetime.fromisoformat(expire.replace("Z", "+00:00")) <= now:
                    continue
            except (ValueError, AttributeError, TypeError):
                pass
        users.setdefault(user, []).append(f"{ktype} {kdata} {user}")
    return users
