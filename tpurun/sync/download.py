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

The topmost directory a download makes gets a .gitignore that ignores everything (ignore.mark_download):
what it brings into a project is neither sent back to the workers by the next sync or train nor shown by
git; `sent_from` names what a sync from here would still send (a download into a directory of the user's).
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tpurun import ignore
from tpurun.errors import ExitCode, UnreachableError
from tpurun.fleet import targets
from tpurun.fleet.interface import Fleet
from tpurun.settings import Settings
from tpurun.sync.stream import Counters, FrameReader, Interrupted, describe_failure, frame, helper_command
from tpurun.transport.runner import Pipe, Worker
from tpurun.worker import sync_helper


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
    marked: str = ""  # the directory this download made and left out of git and sync (its .gitignore)
    tree: bool = False  # LOCAL is a directory (else a file)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Downloaded:
    """What `tpurun download` did on every selected worker, and what of it a sync from here would send."""

    workers: list[Fetched]  # one per selected worker, in worker order
    sent: list[str] = field(default_factory=list)  # landed here, and sent by the next sync from here (`sent_from`)

    @property
    def exit_code(self) -> ExitCode:
        """`download`'s exit code: 4 where a worker could not be reached; else 2 where a PATH outside a worker's
        home was refused; else 1 where a worker or a file could not be downloaded; else 0."""
        code = ExitCode.OK
        for g in self.workers:
            if g.error:
                code = max(code, ExitCode.UNREACHABLE if g.unreachable else ExitCode.PROGRAM_FAILED)
            if g.errors:
                code = max(code, ExitCode.PROGRAM_FAILED)
        if any(g.outside_home for g in self.workers):
            code = max(code, ExitCode.USAGE)  # an unreachable worker's 4 stays
        return code


def local_root(dest: Path, worker_name: str, many: bool) -> Path:
    """Where one worker's download goes: DEST itself, or DEST/<worker> when several workers are asked."""
    return dest / worker_name if many else dest


class Protocol(Exception):
    """The worker sent something this side refuses (a name outside the tree, an unexpected frame)."""


def _link_stays_inside(rel: str, target: str, links: set[str]) -> bool:
    """Whether a symlink at REL pointing at TARGET resolves inside the tree downloaded. Every directory on
    the way is a real one this side made (_Tree.directory), so the target is followed component by
    component as the system would; one that goes through another link of the tree is refused."""
    if not target or os.path.isabs(target) or "\0" in target:
        return False
    parts = rel.split("/")[:-1]
    for comp in target.split("/"):
        if comp in ("", "."):
            continue
        if comp == "..":
            if not parts:
                return False
            parts.pop()
        else:
            parts.append(comp)
            if "/".join(parts) in links:
                return False
    return True


class _Tree:
    """The tree of one worker's download under BASE, made without ever following a symlink: every
    directory on the way is checked with lstat and made a real one, so nothing a worker names and
    nothing already in DEST can lead a write outside BASE."""

    def __init__(self, base: Path, got: Fetched, *, made: bool = False) -> None:
        """MADE: BASE is already a real directory (a tree's own, made by the caller's _Tree)."""
        self.base = base
        self.got = got
        self.ok: set[str] = {""} if made else set()  # real directories, relative to base ("" is base)
        self.swept: set[str] = set()  # directories cleared of a killed download's temp files
        self.tmp: str | None = None  # the file being received, removed on any failure

    def directory(self, rel: str) -> Path:
        """BASE/REL as a real directory (made, or a file or symlink in its way replaced, as rsync does)."""
        if rel in self.ok:
            return self.base / rel if rel else self.base
        if not rel:  # BASE itself: the user's choice (DEST, or DEST/<worker>), a link to elsewhere included
            self.base.mkdir(parents=True, exist_ok=True)
            if not self.base.is_dir():
                raise OSError(f"{self.base} is not a directory")
            self.ok.add(rel)
            return self.base
        self.directory(rel.rpartition("/")[0])
        path = self.base / rel
        try:
            st = path.lstat()
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            path.unlink()  # a file or a link where the worker has a directory
            st = None
        if st is None:
            path.mkdir()
            self.swept.add(rel)  # new: nothing to sweep
        self.ok.add(rel)
        return path

    def _sweep(self, rel: str, path: Path) -> None:
        """Temp files a killed download left in PATH (BASE/REL), once, before the first file written there:
        a download that writes nothing reads no directory."""
        if rel in self.swept:
            return
        self.swept.add(rel)
        with os.scandir(path) as entries:
            for e in entries:
                if e.name.startswith(sync_helper.TMP_PREFIX) and e.is_file(follow_symlinks=False):
                    os.unlink(e.path)

    def receive(self, reader: FrameReader, entry: list, progress: Counters) -> None:
        rel, size, mtime_ns, mode = entry[:4]
        h = hashlib.sha256()
        got = 0
        fd = -1
        failed = ""
        try:
            parent, name = rel.rpartition("/")[::2]
            where = self.directory(parent)
            self._sweep(parent, where)
            if (where / name).is_dir() and not (where / name).is_symlink():
                raise OSError(f"a directory is in the way of the file {rel}")
            self.tmp = str(where / f"{sync_helper.TMP_PREFIX}{name[:100]}-{os.urandom(4).hex()}")
            fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError as exc:
            failed = exc.strerror or str(exc)
        try:
            while True:
                kind, payload = reader.read_frame()
                if kind == sync_helper.Frame.DATA:
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
                elif kind == sync_helper.Frame.ABORTED:
                    failed = failed or "not sent: " + payload.decode("utf-8", "replace")
                    break
                elif kind == sync_helper.Frame.SUM:
                    if not failed and h.hexdigest() != payload.decode("ascii", "replace"):
                        failed = "sha256 mismatch after transfer"
                    elif not failed and got != size:
                        failed = "changed on the worker during the download; download again"
                    break
                else:
                    raise Protocol(f"unexpected frame {kind!r} inside a file")
            progress.sent(1, 0)
            if not failed:
                os.fchmod(fd, mode & 0o777)
                os.utime(fd, ns=(mtime_ns, mtime_ns))  # the next download sees it as unchanged
                os.close(fd)
                fd = -1
                assert self.tmp is not None
                os.replace(self.tmp, where / name)  # a symlink at the name is replaced, never followed
                self.tmp = None
                self.got.files_fetched += 1
                self.got.bytes_fetched += got
        except OSError as exc:
            failed = exc.strerror or str(exc)
        finally:
            if fd >= 0:
                os.close(fd)
            if self.tmp:
                self.drop_tmp()
        if failed:
            self.got.errors.append([rel, failed])

    def link(self, rel: str, target: str, links: set[str]) -> None:
        if not _link_stays_inside(rel, target, links):
            self.got.skipped.append([rel, f"a symlink to {target}, outside the tree: not recreated"])
            return
        try:
            parent, name = rel.rpartition("/")[::2]
            path = self.directory(parent) / name
            try:
                st = path.lstat()
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode) and os.readlink(path) == target:
                return
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise OSError(f"a directory is in the way of the symlink {rel}")
            if st is not None:
                path.unlink()
            os.symlink(target, path)
            self.got.links += 1
        except OSError as exc:
            self.got.errors.append([rel, exc.strerror or str(exc)])

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
    return stat.S_ISREG(st.st_mode) and st.st_size == size and st.st_mtime_ns == mtime_ns


def _listing(reply: dict) -> tuple[str, list, list, list]:
    """The tree's name and its files, links and directories, every name checked to stay inside it."""
    name = os.path.basename(str(reply["root"]).rstrip("/"))
    if not sync_helper.safe_relpath(name) or "/" in name:
        raise Protocol(f"a tree named {name!r}")
    files, links, dirs = reply["files"], reply.get("links", []), reply.get("dirs", [])
    if reply.get("file") and (links or dirs or len(files) != 1 or files[0][0] != name):
        raise Protocol("a file download that lists more than the file")
    for rel in [f[0] for f in files] + [x[0] for x in links] + dirs:
        if not isinstance(rel, str) or not sync_helper.safe_relpath(rel):
            raise Protocol(f"a name outside the tree: {rel!r}")
    return name, files, links, dirs


def download_stream(
    stream: Pipe,
    got: Fetched,
    path: str,
    root: Path,
    *,
    outside_home: bool,
    progress: Counters,
    fresh: Path | None = None,
) -> None:
    """The whole protocol with one worker's helper; fills GOT (errors included). FRESH: the destination,
    when it did not exist before this download (ROOT is it or under it)."""
    reader = FrameReader(stream.recv)
    stream.send(
        frame(
            sync_helper.Frame.LIST,
            sync_helper.pack_json({"v": sync_helper.PROTOCOL, "path": path, "outside_home": outside_home}),
        )
    )
    kind, payload = reader.read_frame()
    reply = sync_helper.unpack_json(payload)
    if kind == sync_helper.Frame.REFUSED:
        got.error, got.outside_home = str(reply.get("error")), bool(reply.get("outside_home"))
        return
    if kind != sync_helper.Frame.INDEX:
        raise Protocol(f"unexpected frame {kind!r}")
    got.remote = str(reply["root"])
    name, files, links, dirs = _listing(reply)
    got.errors += [[rel, f"not readable on the worker: {why}"] for rel, why in reply.get("unreadable", [])]
    base = root if reply.get("file") else root / name  # a file lands in ROOT, a tree as ROOT/<its name>
    got.local, got.tree = str(root / name), not reply.get("file")
    got.files_total = len(files)
    new = next((p for p in (root, base) if not os.path.lexists(p)), None)  # the topmost one this makes
    _Tree(root, got).directory("" if reply.get("file") else name)
    top = fresh or new
    if top == base and any(f[0] == ".gitignore" for f in files):
        top = None  # the tree brings its own .gitignore, which would replace the mark (sent_from tells)
    if top is not None and ignore.mark_download(top):
        got.marked = str(top)
    tree = _Tree(base, got, made=True)  # every name from here on is relative to the tree
    wanted = [i for i, (rel, size, mtime_ns, *_) in enumerate(files) if not _unchanged(base / rel, size, mtime_ns)]
    progress.plan(len(wanted), sum(files[i][1] for i in wanted))
    stream.send(frame(sync_helper.Frame.WANT, sync_helper.pack_json(wanted)))
    asked = set(wanted)
    try:
        for _ in wanted:
            kind, payload = reader.read_frame()
            if kind != sync_helper.Frame.FILE:
                raise Protocol(f"unexpected frame {kind!r}")
            (index,) = struct.unpack(">I", payload)
            if index not in asked:
                raise Protocol(f"a file it was not asked for ({index})")
            tree.receive(reader, files[index], progress)
        if reader.read_frame()[0] != sync_helper.Frame.END:
            raise Protocol("no end after the files")
    finally:
        tree.drop_tmp()
    for rel in dirs:
        try:
            tree.directory(rel)
        except OSError as exc:
            got.errors.append([rel, exc.strerror or str(exc)])
    names = {x[0] for x in links}
    for rel, target in links:
        tree.link(rel, target, names)


def download(
    fleet: Fleet,
    path: str,
    dest: Path,
    *,
    outside_home: bool = False,
    progress: Counters | None = None,
    stop: threading.Event | None = None,
) -> list[Fetched]:
    """PATH from every worker of FLEET (connected here where it is not yet; the unreached ones are reported as
    such) to DEST at once: into DEST itself from one worker, into DEST/<worker name> from several."""
    progress = progress or Counters()
    stop = stop or threading.Event()
    fresh = None if os.path.lexists(dest) else dest  # made by this download: left out of git and sync
    got: dict[int, Fetched] = {}  # made as each worker is reached (connecting may find a TPU made anew)

    def one(worker: Worker, opened: Callable[[], Pipe]) -> None:
        g = got[worker.index] = Fetched(worker.index, worker.name, worker.address)
        started = time.monotonic()
        stream: Pipe | None = None
        try:
            stream = opened()
            root = local_root(dest, worker.name, len(fleet.workers) > 1)
            download_stream(stream, g, path, root, outside_home=outside_home, progress=progress, fresh=fresh)
        except (Protocol, KeyError, TypeError, ValueError, struct.error) as exc:
            g.error = f"the worker's download helper answered what this side refuses: {exc}"
        except (sync_helper.Eof, UnreachableError) as exc:
            if stream is None:  # not reached, or its helper could not start
                g.error, g.unreachable = str(exc), True
            elif not stop.is_set():
                why = describe_failure(stream, exc)
                g.unreachable = why.startswith("the connection was lost")  # exit 4, else the helper's own failure
                g.error = f"{g.name} ({g.address}): {why}" if g.unreachable else why
        except Exception as exc:  # what this side could not take or keep: this worker fails, not the others
            g.error = f"{g.name} ({g.address}): {type(exc).__name__}: {exc}"
        finally:
            g.seconds = round(time.monotonic() - started, 3)

    fleet.converse(helper_command, one, stop=stop)
    if stop.is_set():
        raise Interrupted()
    return [got[w.index] for w in fleet.workers]


def download_from(
    s: Settings,
    path: str,
    dest: Path,
    *,
    local: bool,
    worker_spec: str,
    announce: Callable[[str], None] | None = None,
    outside_home: bool,
    progress: Counters,
    stop: threading.Event,
    here: Path | None = None,
) -> Downloaded:
    """PATH to DEST from every worker of the TPU S names (or this machine, LOCAL) that WORKER_SPEC selects, as
    download(); ANNOUNCE hears that it is this machine. With HERE (the directory the next sync or train is run
    from), what landed there that it would send."""
    target = targets.resolve(s, local=local, worker_spec=worker_spec, announce=announce)
    with target:
        got = download(target.fleet, path, dest, outside_home=outside_home, progress=progress, stop=stop)
    return Downloaded(got, sent_from(got, here) if here is not None else [])


def sent_from(got: Sequence[Fetched], here: Path) -> list[str]:
    """What GOT put under HERE that a sync of HERE (the next `train` from here) would send, relative to it:
    the landings no ignore rule (a download's own .gitignore included) leaves out."""
    rules = ignore.Rules(here)
    found = []
    for g in got:
        if g.error or not g.local:
            continue
        try:
            rel = Path(g.local).resolve().relative_to(here.resolve()).as_posix()
        except (OSError, ValueError):
            continue  # not under HERE
        if rel == ".":
            continue
        if g.tree and next(ignore.walk_stat(here, under=rel + "/"), None) is not None:
            found.append(rel)  # a file in it would travel (the walk stops at the first)
        elif not g.tree and not rules.ignored(rel):
            found.append(rel)
    return found
