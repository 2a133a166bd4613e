"""`tpurun download`: a file or a tree (checkpoints, outputs) from one or every worker to this machine,
moving only what changed.

The other direction of tpurun.sync.sender, over the same helper and framing (the protocol is written in
tpurun.worker.sync_helper): the worker lists PATH with each file's size and mtime, this side asks for the
files it lacks or has with another size or mtime (rsync's quick check), and the worker streams them in one
go. Every file is written to a temp file beside its real name, checked against the sha256 the worker sent,
given the worker's mtime and mode, and only then renamed over the real name: an interrupted download leaves
no half file under a real name, and the next one sees what arrived as unchanged.

The worker refuses a PATH outside its login user's home (after following symlinks) unless asked; this side
refuses any name from the worker that would land outside the local destination, and recreates a symlink
only when it points inside the tree downloaded.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tpurun.sync.sender import Counters, FrameReader, Interrupted, frame, helper_command
from tpurun.transport.fanout import each
from tpurun.transport.runner import Runner
from tpurun.transport.streams import Pipe
from tpurun.worker import sync_helper as proto


@dataclass
class Fetched:
    """What one worker's download did."""

    worker: int
    name: str  # w3, or s1/w1 in a multislice TPU
    address: str
    local: str = ""  # where it went on this machine
    remote: str = ""  # PATH as the worker resolved it
    files_total: int = 0
    files_fetched: int = 0
    bytes_fetched: int = 0
    links: int = 0  # symlinks recreated
    seconds: float = 0.0
    error: str = ""  # the worker could not be downloaded from at all
    outside_home: bool = False  # refused: PATH is outside the worker's home and --outside-home was not given
    unreachable: bool = False
    errors: list[list[str]] = field(default_factory=list)  # [path, message] per file not written
    skipped: list[list[str]] = field(default_factory=list)  # [path, why]: symlinks leading out of the tree

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def local_root(dest: Path, worker_name: str, many: bool) -> Path:
    """Where one worker's download goes: DEST itself, or DEST/<worker> when several workers are asked."""
    return dest / worker_name if many else dest


def _link_stays_inside(rel: str, target: str) -> bool:
    """Whether a symlink at REL (relative to the tree) pointing at TARGET resolves inside the tree."""
    if os.path.isabs(target):
        return False
    resolved = os.path.normpath(os.path.join(os.path.dirname(rel), target))
    return resolved != ".." and not resolved.startswith("../")


class _Writer:
    """Writes one worker's files, each through a temp file beside its real name."""

    def __init__(self, got: Fetched) -> None:
        self.got = got
        self.tmp: str | None = None

    def parent(self, base: Path, rel: str) -> str:
        parent = (base / rel).parent
        parent.mkdir(parents=True, exist_ok=True)
        real = os.path.realpath(parent)
        if real != os.path.realpath(base) and not real.startswith(os.path.realpath(base) + os.sep):
            raise OSError(f"{parent} leads outside {base}")  # through a symlink already there
        return str(parent)

    def receive(self, reader: FrameReader, base: Path, entry: list, progress: Counters) -> None:
        rel, size, mtime_ns, mode = entry[:4]
        h = hashlib.sha256()
        got = 0
        fd = -1
        failed = ""
        try:
            parent = self.parent(base, rel)
            self.tmp = os.path.join(parent, f"{proto.TMP_PREFIX}{os.path.basename(rel)}-{os.urandom(4).hex()}")
            fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            failed = exc.strerror or str(exc)
        while True:
            kind, payload = reader.read_frame()
            if kind == b"D":
                h.update(payload)
                got += len(payload)
                progress.sent(0, len(payload))
                if not failed:
                    try:
                        view = memoryview(payload)
                        while view:
                            view = view[os.write(fd, view) :]
                    except OSError as exc:
                        failed = exc.strerror or str(exc)
            elif kind == b"A":
                failed = failed or "not sent: " + payload.decode("utf-8", "replace")
                break
            elif kind == b"Z":
                if not failed and h.hexdigest() != payload.decode("ascii", "replace"):
                    failed = "sha256 mismatch after transfer"
                elif not failed and got != size:
                    failed = "changed on the worker during the download; download again"
                break
            else:
                raise proto.Eof()
        progress.sent(1, 0)
        if not failed:
            try:
                os.fchmod(fd, mode & 0o777)
                os.utime(fd, ns=(mtime_ns, mtime_ns))  # the next download sees it as unchanged
                os.close(fd)
                fd = -1
                assert self.tmp is not None
                os.replace(self.tmp, base / rel)
                self.tmp = None
                self.got.files_fetched += 1
                self.got.bytes_fetched += got
            except OSError as exc:
                failed = exc.strerror or str(exc)
        if fd >= 0:
            os.close(fd)
        if failed:
            self.drop_tmp()
            self.got.errors.append([rel, failed])

    def drop_tmp(self) -> None:
        if self.tmp:
            try:
                os.unlink(self.tmp)
            except OSError:
                pass
            self.tmp = None


def _unchanged(path: Path, size: int, mtime_ns: int) -> bool:
    try:
        st = path.lstat()
    except OSError:
        return False
    return st.st_size == size and st.st_mtime_ns == mtime_ns and not path.is_symlink()


def download_stream(
    stream: Pipe, got: Fetched, path: str, root: Path, *, outside_home: bool, progress: Counters
) -> None:
    """The whole protocol with one worker's helper; fills GOT (errors included)."""
    reader = FrameReader(stream.recv)
    stream.send(frame(b"L", proto.pack_json({"v": proto.PROTOCOL, "path": path, "outside_home": outside_home})))
    kind, payload = reader.read_frame()
    reply = proto.unpack_json(payload)
    if kind == b"Q":
        got.error, got.outside_home = str(reply.get("error")), bool(reply.get("outside_home"))
        return
    if kind != b"I":
        raise proto.Eof()
    got.remote = reply["root"]
    name = os.path.basename(got.remote.rstrip("/")) or "root"
    files, links = reply["files"], reply.get("links", [])
    base = root if reply.get("file") else root / name  # a file lands in ROOT, a tree as ROOT/<its name>
    got.local = str(root / name)
    got.files_total = len(files)
    for rel, _ in links:
        if not proto.safe_relpath(rel):
            raise proto.Eof()  # a worker naming paths outside the tree: talk to it no more
    wanted = []
    for i, entry in enumerate(files):
        rel = entry[0]
        if not proto.safe_relpath(rel):
            raise proto.Eof()
        if not _unchanged(base / rel, entry[1], entry[2]):
            wanted.append(i)
    progress.plan(len(wanted), sum(files[i][1] for i in wanted))
    stream.send(frame(b"W", proto.pack_json(wanted)))
    asked = set(wanted)
    writer = _Writer(got)
    try:
        for _ in wanted:
            kind, payload = reader.read_frame()
            if kind != b"F":
                raise proto.Eof()
            (index,) = struct.unpack(">I", payload)
            if index not in asked:
                raise proto.Eof()
            writer.receive(reader, base, files[index], progress)
        if reader.read_frame()[0] != b"E":
            raise proto.Eof()
    finally:
        writer.drop_tmp()
    for rel, target in links:
        _relink(base, rel, target, got)


def _relink(base: Path, rel: str, target: str, got: Fetched) -> None:
    link = base / rel
    if not _link_stays_inside(rel, target):
        got.skipped.append([rel, f"a symlink to {target}, outside the tree: not recreated"])
        return
    try:
        if link.is_symlink() and os.readlink(link) == target:
            return
        if link.is_symlink() or link.is_file():
            link.unlink()
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, link)
        got.links += 1
    except OSError as exc:
        got.errors.append([rel, exc.strerror or str(exc)])


def download(
    runners: Sequence[Runner],
    path: str,
    dest: Path,
    *,
    outside_home: bool = False,
    progress: Counters | None = None,
    stop: threading.Event | None = None,
    connect_errors: dict[int, str] | None = None,
) -> list[Fetched]:
    """PATH from every runner (connected) to DEST at once: into DEST itself from one worker, into
    DEST/<worker name> from several."""
    progress = progress or Counters()
    stop = stop or threading.Event()
    many = len(runners) > 1
    got = {r.worker.index: Fetched(r.worker.index, r.worker.name, r.worker.address) for r in runners}
    for index, error in (connect_errors or {}).items():
        got[index].error, got[index].unreachable = error, True
    streams: dict[int, Pipe] = {}

    def one(r: Runner) -> None:
        g = got[r.worker.index]
        started = time.monotonic()
        try:
            stream = streams[r.worker.index] = r.pipe(helper_command(r.python))
            root = local_root(dest, r.worker.name, many)
            download_stream(stream, g, path, root, outside_home=outside_home, progress=progress)
        except (proto.Eof, OSError, EOFError) as exc:
            if not stop.is_set():
                g.error = f"{g.name} ({g.address}): the connection was lost ({type(exc).__name__}: {exc})"
                g.unreachable = True
        except Exception as exc:  # paramiko errors: this worker fails, not the others
            g.error, g.unreachable = f"{type(exc).__name__}: {exc}", True
        finally:
            if r.worker.index in streams:
                streams[r.worker.index].close()
            g.seconds = round(time.monotonic() - started, 3)

    def close_on_stop() -> None:
        if stop.is_set():
            for s in list(streams.values()):
                s.close()  # wakes a thread waiting for data; its temp file is removed

    each([r for r in runners if not got[r.worker.index].error], one, name="download", tick=close_on_stop)
    if stop.is_set():
        raise Interrupted()
    return [got[r.worker.index] for r in runners]
