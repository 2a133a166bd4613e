"""The pieces a sync's sending side and a download are made of: the frames, the manifest, the needed files'
data cut into segments, the helper's command line, a worker's stats, the progress counters, and why a helper
ended early. `together` holds every worker's conversation of a sync at once (`Fleet.chorus`), `download` each
worker's on its own (`Fleet.converse`)."""

from __future__ import annotations

import base64
import functools
import hashlib
import struct
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tpurun import ignore
from tpurun.fleet import bundle
from tpurun.fleet.interface import lost_connection
from tpurun.transport.runner import Pipe
from tpurun.worker import BUNDLES, bundle_name, sync_helper
from tpurun.worker.zygote import SYNC_HELPER

CHUNK = 1 << 20  # bytes per data frame
GROUP_WAIT = 2.0  # seconds the first worker's needs wait for the others' before its group's data starts
SEND_BUFFER = 1 << 20  # small files are batched until this much is queued


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return sync_helper.HEADER.pack(kind, len(payload)) + payload


class FrameReader:
    """Frames from a byte source that returns b'' at EOF (a paramiko channel's recv, os.read, ...)."""

    def __init__(self, recv: Callable[[int], bytes]) -> None:
        self.recv = recv
        self.buf = bytearray()

    def _fill(self, n: int) -> None:
        while len(self.buf) < n:
            data = self.recv(max(65536, n - len(self.buf)))
            if not data:
                raise sync_helper.Eof()
            self.buf += data

    def read_frame(self) -> tuple[bytes, bytes]:
        self._fill(sync_helper.HEADER.size)
        kind, length = sync_helper.HEADER.unpack_from(self.buf)
        self._fill(sync_helper.HEADER.size + length)
        payload = bytes(self.buf[sync_helper.HEADER.size : sync_helper.HEADER.size + length])
        del self.buf[: sync_helper.HEADER.size + length]
        return kind, payload


# ------------------------------------------------------------------ manifest


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, POSIX separators
    size: int
    mtime_ns: int
    mode: int  # permission bits (st_mode & 0o7777)
    sha256: str


@dataclass
class Manifest:
    files: list[FileEntry] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (path, symlink target)
    hashed: int = 0  # files whose content had to be read (not in the local cache)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_wire(self, dest: str, delete: bool) -> dict[str, Any]:
        return {
            "v": sync_helper.PROTOCOL,
            "dest": dest,
            "delete": delete,
            "files": [[f.path, f.size, f.mtime_ns, f.mode, f.sha256] for f in self.files],
            "links": [list(x) for x in self.links],
        }


def deletions(extra: Sequence[str], rules: ignore.Rules) -> list[str]:
    """The worker's extra paths that --delete removes: those the source's RULES ignore are kept (like rsync
    without --delete-excluded), so data/ or checkpoints/ on the worker survive a sync of the code."""
    return [p for p in extra if not rules.ignored(p)]


# ------------------------------------------------------------------ one worker


@functools.lru_cache(maxsize=4)
def helper_command(python: str = "python3", bundled: bool = False) -> tuple[str, ...]:
    """argv that runs the helper (a fleet's `Helper`): this version's bundle's copy where the worker has it (a
    job's workers do: their hold ran the agent), compiled once there, else its source, compressed inline (nothing
    to install first). Compiling the source costs each worker 24 ms of CPU at every start, three times the
    interpreter's own. BUNDLED (a relayed worker: its relay runs from the bundle): the bundle's program, which
    the relay's zygote forks, no interpreter started."""
    if bundled:
        return tuple(bundle.program_argv(python, SYNC_HELPER))
    source = Path(sync_helper.__file__).read_bytes()
    blob = base64.b64encode(zlib.compress(source, 9)).decode("ascii")
    boot = (
        f"import os,sys\nd=os.path.expanduser('~/{BUNDLES}/{bundle_name()}')\n"
        "if os.path.isfile(d+'/sync_helper.py'):\n sys.path.insert(0,d);import sync_helper;sys.exit(sync_helper.main())\n"
        f"import base64,zlib;exec(zlib.decompress(base64.b64decode('{blob}')))"
    )
    # -I -S: no site-packages, no PYTHON* variables, no user site: stdlib only, and ~5 ms less per start
    return (python, "-I", "-S", "-c", boot)


def describe_failure(stream: Pipe, cause: Exception | None = None) -> str:
    """Why a helper's stream ended early, in one line (its exit code and last stderr line; where the connection,
    not the helper, ended, what the transport said of it: CAUSE, an UnreachableError)."""
    rc, err = stream.ended()
    return why_ended(rc, err) if rc is not None or err.strip() else lost_connection(cause)


def why_ended(rc: int | None, err: bytes) -> str:
    """Why a helper that ended with RC (None: the connection, not the program, ended) and ERR ended early."""
    text = err.decode("utf-8", "replace").strip().splitlines()
    last = text[-1] if text else ""
    if rc == 127:
        return "python3 not found on the worker (sync needs Python >= 3.8 there)"
    if last:
        return last
    return f"the sync helper ended unexpectedly (exit {rc})" if rc is not None else "the connection was lost"


class Interrupted(Exception):
    """The user stopped the sync (Ctrl-C / SIGTERM)."""


@dataclass
class WorkerStats:
    worker: int
    address: str
    name: str = ""  # how output names the worker: w3, or s1/w1 in a multislice TPU
    files_total: int = 0
    files_sent: int = 0
    bytes_sent: int = 0
    deleted: int = 0
    seconds: float = 0.0
    error: str = ""  # the worker could not be synced at all
    unreachable: bool = False
    errors: list[list[str]] = field(default_factory=list)  # [path, kind, message] per failed file
    files_needed: int = 0
    bytes_needed: int = 0
    dest: str = ""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["worker"] = self.worker
        return d


@dataclass
class Counters:
    """Counters the sending threads bump and the progress bar reads."""

    bytes_total: int = 0
    bytes_done: int = 0
    files_total: int = 0
    files_done: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def plan(self, files: int, nbytes: int) -> None:
        with self.lock:
            self.files_total += files
            self.bytes_total += nbytes

    def sent(self, files: int, nbytes: int) -> None:
        with self.lock:
            self.files_done += files
            self.bytes_done += nbytes


Needs = Callable[[Manifest, list[tuple[int, ...]]], None]  # the manifest, what each worker that answered needs


@dataclass(frozen=True)
class Segment:
    """A piece of the data stream: framed bytes, and how many files and content bytes it completes."""

    data: bytes
    files: int = 0
    nbytes: int = 0


def data_segments(manifest: Manifest, src: Path, need: Sequence[int], stop: threading.Event) -> Iterator[Segment]:
    """The framed data of every needed file (F, D..., then Z with the sha256 of what was read, or A when
    the file could not be read), cut into segments of about SEND_BUFFER bytes so that small files share
    one write. Big chunks are their own segment (no copy into the buffer)."""
    buf = bytearray()
    files = nbytes = 0
    for i in need:
        if stop.is_set():
            raise Interrupted()
        entry = manifest.files[i]
        buf += frame(sync_helper.Frame.FILE, struct.pack(">I", i))
        h = hashlib.sha256()
        try:
            with open(src / entry.path, "rb") as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
                    buf += sync_helper.HEADER.pack(sync_helper.Frame.DATA, len(chunk))
                    if len(chunk) >= SEND_BUFFER // 4:
                        yield Segment(bytes(buf), files, nbytes)
                        yield Segment(chunk, 0, len(chunk))
                        buf.clear()
                        files = nbytes = 0
                    else:
                        buf += chunk
                        nbytes += len(chunk)
                        if len(buf) >= SEND_BUFFER:
                            yield Segment(bytes(buf), files, nbytes)
                            buf.clear()
                            files = nbytes = 0
                    if stop.is_set():
                        raise Interrupted()
            buf += frame(sync_helper.Frame.SUM, h.hexdigest().encode("ascii"))
        except OSError as exc:
            buf += frame(sync_helper.Frame.ABORTED, (exc.strerror or str(exc)).encode("utf-8", "replace"))
        files += 1
    if buf:
        yield Segment(bytes(buf), files, nbytes)
