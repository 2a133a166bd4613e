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
    assert metaserver.status("instance/attributes/none") == 404
    assert metaserver.request("GET", metaserver.url("instance/name"))[0] == 403  # no Metadata-Flavor: refused


def test_nothing_listening_is_no_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")
    assert metaserver.text("instance/name") is None and metaserver.status("instance/name") is None
