"""`tpurun sync`: an incremental, content-checked copy of a directory to every selected worker at once.

The sending side: the manifest (every file to send, its sha256 from a cache where its size and mtime are
known), then the conversation with every worker's helper, `tpurun.worker.sync_helper` (shipped inline on
the command line, nothing installed on workers), held with all of them at once by `together` through the
fleet's chorus, in the framed protocol documented there:

    manifest (one frame)  ->  paths the worker needs (+ extra paths for --delete)  ->
    every needed file in one stream, then deletions, then end  ->  result

so the round trips do not grow with the number of files. The helpers start while the manifest is built
(`push`), their exec requests pipelined (no wait for the server's reply), so a sync costs: channel open,
manifest -> needs, data -> result.

Local hashes are cached under $TPURUN_HOME/sync-cache keyed by (path, size, mtime_ns), so a no-op
sync of a big tree stats files and hashes nothing; the helper keeps the same kind of cache in dest.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpurun import ignore
from tpurun.errors import ExitCode, UsageError
from tpurun.fleet import targets
from tpurun.fleet.interface import Fleet
from tpurun.fleet.targets import Target
from tpurun.settings import Settings
from tpurun.sync import report, together
from tpurun.sync.stream import (
    CHUNK,
    Counters,
    FileEntry,
    Manifest,
    Needs,
    WorkerStats,
    helper_command,
)

RACY_SECONDS = 2.0  # a file modified this recently may change again within the same mtime tick


def sha256_file(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


class HashCache:
    """sha256 of local files keyed by (path, size, mtime_ns), one JSON file per source directory."""

    def __init__(self, cache_dir: Path | None, src: Path) -> None:
        self.path = None
        if cache_dir is not None:
            key = hashlib.sha256(str(src).encode("utf-8", "surrogateescape")).hexdigest()[:20]
            self.path = cache_dir / f"{key}.json"
        self.entries: dict[str, list[Any]] = {}
        self.dirty = False
        if self.path and self.path.is_file():
            try:
                data = json.loads(self.path.read_text())
                if data.get("src") == str(src):
                    self.entries = data.get("files", {})
            except (OSError, ValueError, AttributeError):
                self.entries = {}

    def get(self, path: str, size: int, mtime_ns: int) -> str | None:
        e = self.entries.get(path)
        return e[2] if e and e[0] == size and e[1] == mtime_ns else None

    def put(self, path: str, size: int, mtime_ns: int, sha: str) -> None:
        # a file changed within the filesystem's timestamp granularity of our read could change again
        # without its mtime moving: such "racy" entries are hashed again next time
        if time.time_ns() - mtime_ns < RACY_SECONDS * 1e9:
            self.entries.pop(path, None)
        else:
            self.entries[path] = [size, mtime_ns, sha]
        self.dirty = True

    def save(self, keep: Iterable[str], src: Path) -> None:
        if not self.path or not self.dirty:
            return
        keep_set = set(keep)
        files = {k: v for k, v in self.entries.items() if k in keep_set}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"src": str(src), "files": files}, separators=(",", ":")))
            os.replace(tmp, self.path)
        except OSError:
            pass  # only a cache


def build_manifest(src: Path, excludes: Sequence[str] = (), cache_dir: Path | None = None) -> Manifest:
    """Every file of SRC that is not ignored, with its sha256 (from the cache when size and mtime match)."""
    src = src.resolve()
    cache = HashCache(cache_dir, src)
    m = Manifest()
    root = str(src)
    for rel_s, st in ignore.walk_stat(src, excludes):
        if stat.S_ISLNK(st.st_mode):
            try:
                m.links.append((rel_s, os.readlink(os.path.join(root, rel_s))))
            except OSError:
                pass  # vanished while walking
            continue
        sha = cache.get(rel_s, st.st_size, st.st_mtime_ns)
        if sha is None:
            try:
                sha = sha256_file(os.path.join(root, rel_s))
            except OSError:
                continue  # unreadable: it cannot be sent either
            cache.put(rel_s, st.st_size, st.st_mtime_ns, sha)
            m.hashed += 1
        m.files.append(FileEntry(rel_s, st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode), sha))
    cache.save((f.path for f in m.files), src)
    return m


def sync(
    fleet: Fleet,
    src: Path,
    dest: str,
    *,
    manifest: Manifest,
    excludes: Sequence[str] = (),
    delete: bool = False,
    progress: Counters | None = None,
    stop: threading.Event | None = None,
    on_needs: Needs | None = None,
) -> list[WorkerStats]:
    """Sync MANIFEST of SRC to DEST on every worker of FLEET at once (connected: the unreached ones are reported
    as such), over each worker's helper (started at connect, else here), through the fleet's chorus
    (`together`). ON_NEEDS hears what the workers need before any data goes."""
    progress = progress or Counters()
    stop = stop or threading.Event()
    rules = ignore.Rules(src, excludes)
    stats = {w.index: WorkerStats(w.index, w.address, w.name) for w in fleet.workers}
    for index, error in fleet.unreached.items():
        stats[index].error = error
        stats[index].unreachable = True
    todo = [w for w, st in stats.items() if not st.error]
    chorus = fleet.chorus(helper_command, only=todo, stop=stop)
    together.sync_together(
        chorus, stats, manifest, src, dest, delete=delete, rules=rules, progress=progress, stop=stop,
        on_needs=on_needs,
    )  # fmt: skip
    return [stats[w.index] for w in fleet.workers]


@dataclass
class Pushed:
    manifest: Manifest
    stats: list[WorkerStats]  # one per selected worker, in worker order
    dest: str = ""  # where it went on every worker (`sync_dir`: on this machine, for --local, as a path)

    @property
    def exit_code(self) -> ExitCode:
        """`sync`'s exit code: 4 where a worker could not be reached, else 1 where a worker or a file could not be
        synced, else 0."""
        if any(s.error and s.unreachable for s in self.stats):
            return ExitCode.UNREACHABLE
        return ExitCode.PROGRAM_FAILED if any(s.error or s.errors for s in self.stats) else ExitCode.OK


def push(
    target: Target,
    src: Path,
    dest: str,
    *,
    cache_dir: Path,
    excludes: Sequence[str] = (),
    delete: bool = False,
    progress: Counters | None = None,
    stop: threading.Event | None = None,
    on_needs: Needs | None = None,
) -> Pushed:
    """SRC to DEST on every selected worker of TARGET: `tpurun sync`'s and `train`'s one way in. The workers
    connect (unless TARGET is connected already) and their helpers start while this thread builds the
    manifest (walking, statting, hashing what CACHE_DIR does not know): a no-op sync of 5,000 files saves
    the overlap. ON_NEEDS hears what the workers need before any data goes (tpurun.sync.report words it)."""
    fleet = target.fleet
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="connect") as pool:

        def connect() -> None:
            if target.connected:
                fleet.start_helpers(helper_command)
            else:
                fleet.connect(helper=helper_command)

        connecting = pool.submit(connect)
        try:
            manifest = build_manifest(src, excludes, cache_dir=cache_dir)
        finally:
            connecting.result()  # raises what connect raised
    stats = sync(
        fleet, src, dest, manifest=manifest, excludes=excludes, delete=delete, progress=progress, stop=stop,
        on_needs=on_needs,
    )  # fmt: skip
    return Pushed(manifest, stats)


def sync_dir(
    s: Settings,
    src: Path,
    dest: str,
    *,
    local: bool,
    worker_spec: str,
    announce: Callable[[str], None] | None = None,
    excludes: Sequence[str] = (),
    delete: bool = False,
    progress: Counters | None = None,
    stop: threading.Event | None = None,
    warn: Callable[[str], None] | None = None,
) -> Pushed:
    """`tpurun sync`: SRC to DEST on every worker of the TPU S names (or this machine, LOCAL: DEST checked not
    to be SRC or in it) that WORKER_SPEC selects, as `push`; ANNOUNCE hears that it is this machine, WARN that a
    worker is sent more than TPURUN_SYNC_WARN_MB (a bad limit refused before anything is asked)."""
    on_needs = report.size_check(src, warn) if warn is not None else None
    target = targets.resolve(s, local=local, worker_spec=worker_spec, announce=announce)
    if target.local:
        dest = str(check_local_dest(src, dest))
    with target:
        pushed = push(
            target, src, dest, cache_dir=s.home_path / "sync-cache", excludes=excludes, delete=delete,
            progress=progress, stop=stop, on_needs=on_needs,
        )  # fmt: skip
    pushed.dest = dest
    return pushed


def default_dest(src: Path) -> str:
    """`~/<basename of SRC>`: in the login user's home on every worker."""
    name = src.resolve().name
    if not name:
        raise UsageError("cannot sync the root directory without --dest")
    return f"~/{name}"


def check_local_dest(src: Path, dest: str) -> Path:
    """For --local: the destination on this machine, refused if it is SRC itself or inside it."""
    d = Path(os.path.expanduser(dest))
    if not d.is_absolute():
        d = Path.home() / d
    real_src, real_dest = src.resolve(), d.resolve()
    if real_dest == real_src or real_src in real_dest.parents:
        raise UsageError(
            f"the destination {d} is the source directory or inside it: pass --dest elsewhere "
            "(with no TPU, sync copies to a directory of this machine)"
        )
    return d
