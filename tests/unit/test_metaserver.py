"""The watchdog's plain-HTTP exchange with a metadata server, against Python's own HTTP server."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from tpurun.worker import metaserver


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # as a real server may answer; the exchange still ends with the answer
    store: dict[str, bytes] = {}

    def _answer(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        if self.headers.get("Metadata-Flavor") != "Google":
            return self._answer(403, b"missing header")
        found = self.store.get(self.path)
        self._answer(200, found) if found is not None else self._answer(404, b"not found")

    def do_PUT(self) -> None:  # noqa: N802
        self.store[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self._answer(200, b"")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    host = f"127.0.0.1:{httpd.server_address[1]}"
    monkeypatch.setenv("GCE_METADATA_HOST", host)
    yield host
    httpd.shutdown()


def test_put_then_get_and_statuses(server: str) -> None:
    value = "é" * 50_000  # more than one read's worth
    assert (
        metaserver.request("PUT", metaserver.url("instance/guest-attributes/t/k"), value.encode(), metaserver.ASK)[0]
        == 200
    )
    assert metaserver.text("instance/guest-attributes/t/k") == value
    assert metaserver.text("instance/attributes/none") is None
    assert metaserver.request("GET", metaserver.url("instance/attributes/none"), headers=metaserver.ASK)[0] == 404
    assert metaserver.request("GET", metaserver.url("instance/name"))[0] == 403  # no Metadata-Flavor: refused


def test_nothing_listening_is_no_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")
    assert metaserver.text("instance/name") is None


def _raw_server(answer: bytes) -> tuple[str, threading.Event]:
    """A server that sends ANSWER to one request and keeps the connection open until told."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(answer)
        done.wait(30)
        conn.close()
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{listener.getsockname()[1]}", done


def test_an_answer_ends_at_its_length_even_on_a_connection_kept_open(monkeypatch: pytest.MonkeyPatch) -> None:
    host, done = _raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: keep-alive\r\n\r\nhello")
    monkeypatch.setenv("GCE_METADATA_HOST", host)
    monkeypatch.setattr(metaserver.socket, "create_connection", _short(metaserver.socket.create_connection))
    try:
        assert metaserver.text("instance/name") == "hello"  # not a 2 s wait for a close that never comes
    finally:
        done.set()


def test_a_chunked_answer_is_refused_not_misread(monkeypatch: pytest.MonkeyPatch) -> None:
    host, done = _raw_server(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    monkeypatch.setenv("GCE_METADATA_HOST", host)
    try:
        with pytest.raises(ValueError, match="chunked"):
            metaserver.request("GET", metaserver.url("instance/name"), headers=metaserver.ASK)
    finally:
        done.set()


def test_a_line_break_in_a_header_is_refused() -> None:
    with pytest.raises(ValueError, match="line break"):
        metaserver.request("GET", "http://127.0.0.1:9/x", headers={"Authorization": "Bearer a\r\nX-Evil: 1"})


def _short(connect):  # type: ignore[no-untyped-def]
    """create_connection with a 2 s timeout: a read that waits for the close fails instead of passing."""
    return lambda address, timeout=None: connect(address, timeout=2)
