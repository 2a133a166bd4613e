"""The metadata server (and the API), as tpurun's programs on a worker reach them (stdlib only, Python >= 3.8; part
of the bundle). Plain http -- the metadata server, which every worker's watchdog asks every tick -- is one HTTP/1.0
exchange on a socket: http.client brings the email package and ssl with it, 4.7 of the 12 MiB a watchdog took on
each worker, and only the worker that decides for the TPU needs https (the API)."""

from __future__ import annotations

import os
import socket

ROOT = "/computeMetadata/v1/"
ASK = {"Metadata-Flavor": "Google"}  # the header without which the metadata server answers nothing
NET_ERRORS = (OSError, ValueError)  # what `request` raises when it gets no answer


def request(method: str, url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    """(status, body) of one HTTP request."""
    from urllib.parse import urlsplit  # loaded by the few that ask

    u = urlsplit(url)
    target = u.path + ("?" + u.query if u.query else "")
    if u.scheme != "http":
        import http.client  # the API, from the deciding worker only

        conn = http.client.HTTPSConnection(u.hostname or "", u.port, timeout=15)
        try:
            conn.request(method, target, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        except http.client.HTTPException as exc:
            raise ValueError(f"{method} {url}: {exc!r}") from None
        finally:
            conn.close()
    status, _, data = _exchange(method, url, body, headers, 15.0)
    return status, data


def _exchange(method: str, url: str, body: bytes | None, headers: dict | None, timeout: float) -> tuple[int, dict, bytes]:
    """(status, header fields (names and values lowercased), body) of one plain HTTP request, TIMEOUT seconds per
    read."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    target = u.path + ("?" + u.query if u.query else "")
    lines = [f"{method} {target} HTTP/1.0", f"Host: {u.netloc}", "Connection: close"]
    lines += [f"Content-Length: {len(body or b'')}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    if any(c in line for line in lines for c in "\r\n\0"):
        raise ValueError(f"{method} {url}: a line break in the request")
    # The host as bytes: a str one is encoded to IDNA first, which loads 1.7 MiB of unicode tables into every
    # supervisor that looks for a notice.
    with socket.create_connection(((u.hostname or "").encode(), u.port or 80), timeout=timeout) as sock:  # type: ignore[arg-type]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))
        return _answer(sock, f"{method} {url}")


def _answer(sock: socket.socket, what: str) -> tuple[int, dict, bytes]:
    """(status, header fields, body) read from SOCK: its Content-Length's worth, else up to the server's close."""
    data, size, fields = b"", None, {}
    while size is None or len(data) < size:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        data += chunk
        if size is None and b"\r\n\r\n" in data:
            header = data.split(b"\r\n\r\n", 1)[0].lower().split(b"\r\n")
            fields = dict(line.split(b":", 1) for line in header[1:] if b":" in line)
            if fields.get(b"transfer-encoding", b"").strip() not in (b"", b"identity"):
                raise ValueError(f"{what}: a chunked answer to an HTTP/1.0 request")
            length = fields.get(b"content-length", b"").strip()
            size = len(data.split(b"\r\n\r\n", 1)[0]) + 4 + int(length) if length.isdigit() else None
    head, sep, rest = data.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if not sep or len(status) < 2 or not status[0].startswith(b"HTTP/") or not status[1].isdigit():
        raise ValueError(f"{what}: not an HTTP answer")
    if size is not None and len(data) < size:
        raise ValueError(f"{what}: the answer ended early")
    return int(status[1]), {k.strip(): v.strip() for k, v in fields.items()}, rest


def url(path: str) -> str:
    """PATH (`instance/...`) on this VM's metadata server: the host in GCE_METADATA_HOST (as Google's libraries
    read it), else metadata.google.internal."""
    return f"http://{os.environ.get('GCE_METADATA_HOST') or 'metadata.google.internal'}{ROOT}{path}"


def text(path: str) -> str | None:
    """The value at PATH, or None (no answer, or not 200)."""
    return tagged(path)[0]


def tagged(path: str, last: str = "", wait: int = 0) -> tuple[str | None, str]:
    """The value at PATH and its ETag; (None, "") without an answer or a 200. With WAIT seconds, the metadata
    server holds the GET until the value is no longer the one tagged LAST, or WAIT seconds have gone, as Google's
    does (`wait_for_change`; with LAST, a change made between two such GETs is not missed)."""
    query = f"?wait_for_change=true&last_etag={last}&timeout_sec={wait}" if wait else ""
    try:
        code, fields, data = _exchange("GET", url(path) + query, None, ASK, 15.0 + wait)
    except NET_ERRORS:
        return None, ""
    if code != 200:
        return None, ""
    return data.decode("utf-8", "replace"), fields.get(b"etag", b"").decode("ascii", "replace")
