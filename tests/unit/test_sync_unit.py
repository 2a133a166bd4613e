"""sync without workers: framing, manifest and hash cache, --delete filtering, and the helper driven
directly through a local subprocess (needs, verify, atomic writes, stale temp files, unsafe paths)."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import stat as stat_mod
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tpurun import config, ignore
from tpurun.errors import UsageError
from tpurun.fleet.interface import connect_all
from tpurun.fleet.threads import Threads
from tpurun.sync import report, sender, together
from tpurun.sync.sender import build_manifest
from tpurun.sync.stream import FrameReader, Interrupted, WorkerStats, deletions, frame, helper_command
from tpurun.transport.local import LocalRunner
from tpurun.transport.runner import Pipe, Worker
from tpurun.worker import sync_helper


def _old(path: Path) -> None:
    t = time.time_ns() - 3600 * 10**9
    os.utime(path, ns=(t, t), follow_symlinks=False)


@given(st.lists(st.tuples(st.sampled_from([b"M", b"D", b"Z", b"E"]), st.binary(max_size=3000)), max_size=20),
       st.integers(min_value=1, max_value=7000))  # fmt: skip
def test_frames_round_trip_whatever_the_read_sizes(frames, step):
    data = b"".join(frame(k, p) for k, p in frames)
    pos = 0

    def recv(n: int) -> bytes:
        nonlocal pos
        chunk = data[pos : pos + min(n, step)]
        pos += len(chunk)
        return chunk

    reader = FrameReader(recv)
    assert [reader.read_frame() for _ in frames] == frames
    with pytest.raises(sync_helper.Eof):
        reader.read_frame()


def test_manifest_respects_ignores_and_caches_hashes(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("a")
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o751)
    (src / "x.log").write_text("log")
    (src / "skip.tmp").write_text("t")
    (src / ".gitignore").write_text("*.log\n")
    (src / ".tpurunignore").write_text("skip.*\n")
    (src / "link").symlink_to("run.sh")
    for p in src.rglob("*"):
        _old(p)
    cache = tmp_path / "cache"
    m = build_manifest(src, ["pkg/nothing"], cache_dir=cache)
    assert sorted(f.path for f in m.files) == [".gitignore", ".tpurunignore", "pkg/a.py", "run.sh"]
    assert m.links == [("link", "run.sh")]
    by = {f.path: f for f in m.files}
    assert by["run.sh"].mode == 0o751 and by["pkg/a.py"].sha256 == hashlib.sha256(b"a").hexdigest()
    assert m.hashed == 4
    assert build_manifest(src, cache_dir=cache).hashed == 0  # nothing changed: nothing read
    (src / "pkg" / "a.py").write_text("b")  # same size, new mtime
    m2 = build_manifest(src, cache_dir=cache)
    assert m2.hashed == 1 and {f.path: f for f in m2.files}["pkg/a.py"].sha256 == hashlib.sha256(b"b").hexdigest()
    # a file modified just now is "racy": hashed again next time, never trusted from the cache
    assert build_manifest(src, cache_dir=cache).hashed == 1
    assert [f.path for f in build_manifest(src, ["pkg/"]).files] == [".gitignore", ".tpurunignore", "run.sh"]


def test_delete_keeps_ignored_paths(tmp_path):
    (tmp_path / ".gitignore").write_text("data/\n*.ckpt\n")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / ".gitignore").write_text("*\n")  # a directory `tpurun download` made
    rules = ignore.Rules(tmp_path, ["logs/"])
    extra = ["old.py", "data/x.bin", "a/b/model.ckpt", "logs/run.txt", "src/gone.py", ".git/HEAD", "runs/w0/x.log"]
    assert deletions(extra, rules) == ["old.py", "src/gone.py"]
    assert rules.ignored("data/deep/file") and not rules.ignored("database.py")


def test_nested_ignore_files_decide_as_git_does(tmp_path):
    """Each directory's ignore file rules the paths under it, the deepest matching rule deciding: what tpurun
    walks is what `git ls-files --others --exclude-standard` lists for the same tree."""
    files = ["a.txt", "keep.txt", "sub/a.txt", "sub/keep.txt", "sub/b.log", "sub/deep/c.txt", "sub/deep/d.log",
             "other/b.log", "sub/tpurun.toml", "dl/w0/run/x.bin", "dl/.gitignore", "odd *[x]? "]  # fmt: skip
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x")
    (tmp_path / ".gitignore").write_text("*.txt\n!keep.txt\ntpurun.toml\n")  # (tpurun leaves tpurun.toml out itself)
    (tmp_path / "sub" / ".gitignore").write_text("!a.txt\n*.log\n/deep/c.txt\n")
    (tmp_path / "sub" / "deep" / ".gitignore").write_text("!*.log\n")
    assert ignore.mark_download(tmp_path / "dl") is False  # a .gitignore is there already: left alone
    (tmp_path / "dl" / ".gitignore").unlink()
    assert ignore.mark_download(tmp_path / "dl") is True
    walked = [p for p, _ in ignore.walk_stat(tmp_path)]
    assert sorted(walked) == sorted([".gitignore", "keep.txt", "sub/.gitignore", "sub/a.txt", "sub/keep.txt",
                                     "sub/deep/.gitignore", "sub/deep/d.log", "other/b.log", "odd *[x]? "])  # fmt: skip
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".git" / "info" / "exclude").write_text("")
    git = subprocess.run(["git", "-C", str(tmp_path), "-c", "core.quotePath=false", "ls-files", "--others",
                          "--exclude-standard", "-z"], capture_output=True, text=True, check=True)  # fmt: skip
    assert sorted(git.stdout.split("\0")[:-1]) == sorted(walked)
    rules = ignore.Rules(tmp_path)
    assert [f for f in files if not rules.ignored(f)] == [f for f in files if f in walked]
    assert not rules.ignored("dl", directory=True) and rules.ignored("dl/w0", directory=True)
    assert [p for p, _ in ignore.walk_stat(tmp_path, under="sub/deep/")] == ["sub/deep/.gitignore", "sub/deep/d.log"]
    assert list(ignore.walk_stat(tmp_path, under="dl/")) == []
    # an exact rule for a path: it leaves out that file and nothing else, whatever its characters
    exact = ignore.Rules(tmp_path, [ignore.pattern("odd *[x]? "), ignore.pattern("sub/keep.txt")])
    assert exact.ignored("odd *[x]? ") and exact.ignored("sub/keep.txt") and not exact.ignored("keep.txt")
    assert not exact.ignored("odd x[x]? ") and not exact.ignored("odd *[x]?")


def test_helper_command_is_self_contained():
    argv = helper_command(sys.executable)
    # runs with no tpurun importable (as on a worker): an empty manifest to a temp dir
    r = subprocess.run(argv, input=frame(b"M", sync_helper.pack_json({"v": 99})), capture_output=True,
                       env={"PATH": os.environ["PATH"], "PYTHONPATH": "/nonexistent"}, cwd="/")  # fmt: skip
    assert r.returncode == 2 and r.stdout[:1] == b"Q"


# ------------------------------------------------------------------ the helper through a subprocess


def _entry(path: str, data: bytes, mode: int = 0o644, mtime_ns: int = 1_600_000_000 * 10**9) -> list:
    return [path, len(data), mtime_ns, mode, hashlib.sha256(data).hexdigest()]


class Helper:
    def __init__(self, dest: Path, files: list, links=(), delete: bool = False) -> None:
        self.s = LocalRunner().pipe(helper_command(sys.executable))
        self.r = FrameReader(self.s.recv)
        manifest = {
            "v": sync_helper.PROTOCOL,
            "dest": str(dest),
            "delete": delete,
            "files": files,
            "links": list(links),
        }
        self.s.send(frame(b"M", sync_helper.pack_json(manifest)))
        kind, payload = self.r.read_frame()
        assert kind == b"N", payload
        self.reply = sync_helper.unpack_json(payload)

    def file(self, index: int, data: bytes, sha: str | None = None) -> None:
        self.s.send(frame(b"F", struct.pack(">I", index)) + frame(b"D", data))
        self.s.send(frame(b"Z", (sha or hashlib.sha256(data).hexdigest()).encode()))

    def finish(self, delete: list[str] | None = None) -> dict:
        if delete is not None:
            self.s.send(frame(b"X", sync_helper.pack_json(delete)))
        self.s.send(frame(b"E"))
        kind, payload = self.r.read_frame()
        assert kind == b"R"
        self.s.close()
        return sync_helper.unpack_json(payload)


def test_helper_needs_writes_and_caches(tmp_path):
    dest = tmp_path / "dest"
    files = [_entry("a.txt", b"hello", 0o600), _entry("sub/dir/b.sh", b"#!/bin/sh\n", 0o755)]
    h = Helper(dest, files, links=[["ln", "a.txt"]])
    assert h.reply["need"] == [0, 1] and h.reply["dest"] == str(dest)
    h.file(0, b"hello")
    h.file(1, b"#!/bin/sh\n")
    res = h.finish()
    assert res == {"written": 3, "bytes": 15, "deleted": 0, "errors": []}
    assert (dest / "a.txt").read_bytes() == b"hello" and (dest / "a.txt").stat().st_mode & 0o777 == 0o600
    assert (dest / "sub/dir/b.sh").stat().st_mode & 0o777 == 0o755
    assert (dest / "a.txt").stat().st_mtime_ns == files[0][2]
    assert os.readlink(dest / "ln") == "a.txt"
    cache = json.loads((dest / sync_helper.CACHE_NAME).read_text())["files"]
    assert cache["a.txt"] == [files[0][1], files[0][2], files[0][4]]
    # unchanged: nothing needed; changed content with the same size: needed
    for listed, need in ((files, []), ([_entry("a.txt", b"HELLO", 0o600), files[1]], [0])):
        asked = Helper(dest, listed)
        asked.s.close()  # asked only what it needs: its helper is not left running
        assert asked.reply["need"] == need


def test_helper_rejects_bad_hash_and_leaves_no_temp(tmp_path):
    dest = tmp_path / "dest"
    h = Helper(dest, [_entry("a.txt", b"good")])
    h.file(0, b"evil", sha=hashlib.sha256(b"good").hexdigest())  # what arrived is not what was announced
    res = h.finish()
    assert res["written"] == 0 and res["errors"] == [["a.txt", "verify", "sha256 mismatch after transfer"]]
    assert os.listdir(dest) == []  # no temp file, no busy mark, and no cache (nothing changed)


def test_helper_killed_mid_file_cleans_up_and_next_run_removes_stale_temps(tmp_path):
    dest = tmp_path / "dest"
    dest.mkdir()
    stale = dest / ".tpurun-tmp-a.txt-deadbeef"
    stale.write_text("half")  # a helper killed with SIGKILL left this, and its busy mark
    (dest / sync_helper.BUSY_NAME).touch()
    h = Helper(dest, [_entry("a.txt", b"x" * 100)])
    assert not stale.exists()  # removed at the start
    h.s.send(frame(b"F", struct.pack(">I", 0)) + frame(b"D", b"x" * 50))
    time.sleep(0.2)
    assert any(n.startswith(".tpurun-tmp-") for n in os.listdir(dest))
    h.s.close_write()  # the client vanishes mid-file
    assert h.s.proc.wait(timeout=10) == 3
    assert os.listdir(dest) == [sync_helper.BUSY_NAME]  # its temp file is gone; the mark tells the next run to look
    h = Helper(dest, [_entry("a.txt", b"x" * 100)])
    h.file(0, b"x" * 100)
    assert h.finish()["written"] == 1
    assert sorted(os.listdir(dest)) == [sync_helper.CACHE_NAME, "a.txt"]  # a clean finish drops the mark


def test_helper_refuses_unsafe_paths_and_deletes_only_listed_extras(tmp_path):
    dest = tmp_path / "dest"
    (dest / "old").mkdir(parents=True)
    (dest / "old" / "gone.txt").write_text("x")
    (dest / "keep.txt").write_text("k")
    outside = tmp_path / "outside.txt"
    outside.write_text("o")
    files = [_entry("../outside.txt", b"pwned"), _entry("/etc/x", b"y"), _entry("keep.txt", b"k")]
    h = Helper(dest, files, delete=True)
    assert h.reply["need"] == [] and h.reply["extra"] == ["old/gone.txt"]
    res = h.finish(delete=["old/gone.txt", "../outside.txt", sync_helper.CACHE_NAME])
    assert res["deleted"] == 1 and [e[1] for e in res["errors"]] == ["path", "path"]
    assert outside.read_text() == "o" and not (dest / "old").exists() and (dest / sync_helper.CACHE_NAME).exists()


# ------------------------------------------------------------------ one reader for many workers


def _tree(tmp_path: Path, n: int, size: int) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(n):
        (src / f"f{i}.bin").write_bytes(os.urandom(size))
        _old(src / f"f{i}.bin")
    return src


class _Worker(LocalRunner):
    """This machine as one worker of a pod, with a home of its own (its helper's `~/p` is its own); its helper's
    command runs through WRAP, a shell line ("$@" is the command): how this worker's link behaves."""

    def __init__(self, index: int, home: Path, wrap: str = 'exec "$@"') -> None:
        super().__init__(Worker(index, "127.0.0.1"))
        self.home, self.wrap = home, wrap

    def pipe(self, argv) -> Pipe:
        return super().pipe(["env", f"HOME={self.home}", "sh", "-c", self.wrap, "helper", *argv])


class _Pod:
    """What `Threads` stands on: these workers, connected at the first operation."""

    def __init__(self, runners: list[_Worker]) -> None:
        self.runners, self.connected = runners, False

    def connect(self, then=None, *, only=None) -> dict[int, str]:
        self.connected = True
        return connect_all(self.runners, then)


def _pod(tmp_path: Path, n: int, wraps: dict[int, str] | None = None) -> tuple[Threads, list[Path]]:
    homes = [tmp_path / f"home{i}" for i in range(n)]
    for home in homes:
        home.mkdir()
    wraps = wraps or {}
    return Threads(_Pod([_Worker(i, home, wraps.get(i, 'exec "$@"')) for i, home in enumerate(homes)])), homes


def _has_all(src: Path, home: Path) -> bool:
    dest = home / "p"
    return all((dest / f.name).is_file() and (dest / f.name).read_bytes() == f.read_bytes() for f in src.iterdir())


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["raised"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _link(carries: int = 1 << 62, pause: float = 0.0) -> str:
    """A worker's link, as the shell line its helper runs through: it passes what comes as it comes, PAUSE
    seconds after each read of up to 64 kB, and drops after CARRIES bytes."""
    code = (
        "import sys, time\n"
        f"n = {carries}\n"
        "while n > 0 and (d := sys.stdin.buffer.read1(min(n, 65536))):\n"
        f"    sys.stdout.buffer.write(d); sys.stdout.buffer.flush(); n -= len(d); time.sleep({pause})\n"
    )
    return f'{shlex.quote(sys.executable)} -c {shlex.quote(code)} | "$@"'


def test_workers_that_need_the_same_files_share_one_read(tmp_path, monkeypatch):
    monkeypatch.setattr(together, "GROUP_WAIT", 60.0)  # every worker's needs are heard before data goes
    src = _tree(tmp_path, 40, 100_000)
    fleet, homes = _pod(tmp_path, 4)
    (homes[3] / "p").mkdir()
    for i in range(35):  # a worker that has most files already: a group, and a read, of its own
        shutil.copy2(src / f"f{i}.bin", homes[3] / "p" / f"f{i}.bin")
    manifest = build_manifest(src)
    opened: list[str] = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: (opened.append(str(p)), real_open(p, *a, **k))[1])
    stats = sender.sync(fleet, src, "~/p", manifest=manifest)
    monkeypatch.undo()
    assert [(s.error, s.errors, s.files_sent) for s in stats] == [("", [], 40)] * 3 + [("", [], 5)]
    assert [s.bytes_sent for s in stats] == [40 * 100_000] * 3 + [5 * 100_000]
    reads = [p for p in opened if p.startswith(str(src))]
    assert len(reads) == 40 + 5, "each file read once per group of workers, not once per worker"
    assert all(_has_all(src, home) for home in homes)


def test_a_worker_whose_link_drops_does_not_hold_back_its_group(tmp_path):
    src = _tree(tmp_path, 60, 200_000)  # more than a worker's outbox holds
    # worker 1's link carries 3 MB, then drops: its helper sees the stream end, and what is written to it fails
    fleet, homes = _pod(tmp_path, 3, {1: _link(carries=3_000_000)})
    t, out = _in_thread(lambda: sender.sync(fleet, src, "~/p", manifest=build_manifest(src)))
    t.join(60)
    assert not t.is_alive(), "the others were held back by the worker whose link dropped"
    stats = out["value"]
    assert [bool(s.error) for s in stats] == [False, True, False], stats
    assert stats[1].error == "the sync helper ended unexpectedly (exit 3)", stats[1]
    assert _has_all(src, homes[0]) and _has_all(src, homes[2])
    assert not _half_written(homes[1])


def test_a_straggler_gets_its_own_reader_instead_of_holding_back_the_rest(tmp_path, monkeypatch):
    monkeypatch.setattr(together, "GROUP_WAIT", 0.2)
    src = _tree(tmp_path, 3, 1000)
    go = tmp_path / "go"
    # worker 2's helper starts only once the test says so
    fleet, homes = _pod(tmp_path, 3, {2: f'while [ ! -e {shlex.quote(str(go))} ]; do sleep 0.05; done; exec "$@"'})
    t, out = _in_thread(lambda: sender.sync(fleet, src, "~/p", manifest=build_manifest(src)))
    deadline = time.monotonic() + 30
    while not (_has_all(src, homes[0]) and _has_all(src, homes[1])):
        assert time.monotonic() < deadline, "the others waited for the straggler"
        time.sleep(0.05)
    go.touch()
    t.join(30)
    assert not t.is_alive() and "raised" not in out
    assert [(s.error, s.files_sent) for s in out["value"]] == [("", 3)] * 3
    assert _has_all(src, homes[2])


def test_stop_ends_the_sync_with_interrupted_and_nothing_half_written(tmp_path):
    src = _tree(tmp_path, 30, 2_000_000)
    fleet, homes = _pod(tmp_path, 2, {0: _link(pause=0.01), 1: _link(pause=0.01)})
    stop = threading.Event()
    t, out = _in_thread(lambda: sender.sync(fleet, src, "~/p", manifest=build_manifest(src), stop=stop))
    deadline = time.monotonic() + 30
    while not _half_written(homes[0]):
        assert time.monotonic() < deadline and t.is_alive(), "the sync never started streaming"
        time.sleep(0.02)
    stop.set()
    t.join(30)
    assert not t.is_alive() and isinstance(out.get("raised"), Interrupted), out
    deadline = time.monotonic() + 30
    while any(_half_written(home) for home in homes):
        assert time.monotonic() < deadline, "a half-written file was left"
        time.sleep(0.05)
    for home in homes:
        whole = [n for n in _names(home / "p") if n.endswith(".bin")]  # under its real name: whole or absent
        assert len(whole) < 30, "the sync finished before it was stopped: nothing was tested"
        assert all((home / "p" / name).read_bytes() == (src / name).read_bytes() for name in whole)


def _names(d: Path) -> list[str]:
    return os.listdir(d) if d.is_dir() else []


def _half_written(home: Path) -> list[str]:
    """The temp files of the helper in HOME's `~/p` (not the mark that one may be left, which stays)."""
    return [n for n in _names(home / "p") if n.startswith(sync_helper.TMP_PREFIX) and n != sync_helper.BUSY_NAME]


def test_walk_lists_files_and_symlinks_skips_directory_links_and_specials(tmp_path):
    root = tmp_path / "p"
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "data").mkdir()
    (root / "pkg" / "a.py").write_text("a")
    (root / "pkg" / "sub" / "b.py").write_text("b")
    (root / "data" / "big.bin").write_text("x")
    (root / "top.txt").write_text("t")
    (root / "link-to-file").symlink_to("top.txt")
    (root / "dangling").symlink_to("nowhere")
    (root / "link-to-dir").symlink_to("pkg")
    os.mkfifo(root / "fifo")
    (root / ".tpurunignore").write_text("data/\n")
    got = [(rel, stat_mod.S_ISLNK(st.st_mode)) for rel, st in ignore.walk_stat(root)]
    assert got == [
        (".tpurunignore", False),
        ("dangling", True),
        ("link-to-file", True),
        ("top.txt", False),
        ("pkg/a.py", False),
        ("pkg/sub/b.py", False),
    ]
    assert [p.as_posix() for p in ignore.walk(root)] == [rel for rel, _ in got]


@given(st.lists(st.sampled_from(["a", "b.c", ".", "..", "", "...", ".x", "\0", " "]), min_size=1, max_size=6))
def test_safe_relpath_is_exactly_no_empty_dot_or_dotdot_part(parts):
    path = "/".join(parts)
    expected = bool(path) and "\0" not in path and all(p not in ("", ".", "..") for p in path.split("/"))
    assert sync_helper.safe_relpath(path) == expected


class _Chan:
    """A paramiko Channel's send(): takes at most `window` bytes per call, like a packet at a time."""

    def __init__(self, window: int, closed_after: int | None = None) -> None:
        self.window, self.closed_after, self.got = window, closed_after, bytearray()

    def send(self, data) -> int:
        if self.closed_after is not None and len(self.got) >= self.closed_after:
            return 0  # paramiko: the channel was shut down for writing
        n = min(self.window, len(data))
        self.got += bytes(data[:n])
        return n


@given(st.binary(max_size=5000), st.integers(min_value=1, max_value=700))
def test_send_all_delivers_every_byte_in_order(data, window):
    from tpurun.transport.ssh import send_all

    chan = _Chan(window)
    send_all(chan, data)  # type: ignore[arg-type]
    assert bytes(chan.got) == data


def test_send_all_refuses_to_spin_on_a_closed_channel():
    from tpurun.transport.ssh import send_all

    with pytest.raises(OSError):
        send_all(_Chan(100, closed_after=300), b"x" * 1000)  # type: ignore[arg-type]


def test_size_warning_names_the_largest_files_and_its_command_leaves_them_out(tmp_path, monkeypatch):
    src = tmp_path / "p r'oj"
    (src / "data dir").mkdir(parents=True)
    (src / "data dir" / "big [1].bin").write_bytes(b"\0" * 3_000_000)
    (src / "mid*.bin").write_bytes(b"\0" * 1_200_000)
    (src / "code.py").write_text("print(1)\n")
    m = build_manifest(src)
    everything = [tuple(range(len(m.files)))]
    monkeypatch.setenv(config.SYNC_WARN_MB.name, "4.5")
    assert report.size_warning(m, everything, src, report.warn_limit()) is None  # 4.2 MB: below
    monkeypatch.setenv(config.SYNC_WARN_MB.name, "0")
    assert report.warn_limit() == 0 and report.size_warning(m, everything, src, 0) is None  # 0: never
    monkeypatch.setenv(config.SYNC_WARN_MB.name, "2")
    monkeypatch.chdir(src)
    text = report.size_warning(m, everything, src, report.warn_limit())
    assert text is not None and text.startswith(
        "this sync sends 4.2 MB in 3 files to each worker, more than TPURUN_SYNC_WARN_MB=2 MB; "
        "the largest: data dir/big [1].bin (3.0 MB), mid*.bin (1.2 MB). To leave them out of the next syncs"
    ), text
    command = text.split(": ")[-1]
    subprocess.run(["sh", "-c", command], check=True)  # the command as printed, run from the project
    assert [f.path for f in build_manifest(src).files] == [".tpurunignore", "code.py"]
    (src / "mid-x.bin").write_text("a file the rules must not take with them")
    assert "mid-x.bin" in [f.path for f in build_manifest(src).files]
    # workers that need different files: what the worker sent the most gets; no file stands out: the largest
    monkeypatch.chdir(tmp_path)
    for i in range(25):
        (src / f"shard{i:02}.npy").write_bytes(b"\0" * (100_000 + i))
    m = build_manifest(src)
    text = report.size_warning(m, [(0,), tuple(range(len(m.files)))], src, 2e6)
    assert text is not None and text.startswith("this sync sends 2.5 MB in 28 files to a worker, "), text
    assert "the largest: shard24.npy (100.0 kB). To leave it out" in text, text
    assert text.endswith(" >> " + shlex.quote("p r'oj/.tpurunignore")), text
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv(config.SYNC_WARN_MB.name, bad)
        with pytest.raises(UsageError, match=f"TPURUN_SYNC_WARN_MB='{bad}' is not a size"):
            report.warn_limit()


def test_totals_speak_of_the_worker_sent_the_most():
    def st(worker: int, sent: int, nbytes: int, total: int = 10, error: str = "") -> WorkerStats:
        return WorkerStats(worker, "10.0.0.1", f"w{worker}", files_total=total, files_sent=sent,
                                  bytes_sent=nbytes, error=error)  # fmt: skip

    assert report.totals([st(0, 3, 4_200_000), st(1, 3, 4_200_000)]).line() == (
        "3 files (4.2 MB) sent to each of 2 workers, 7 unchanged"
    )
    assert report.totals([st(0, 1, 10), st(1, 0, 0), st(2, 9, 9, error="lost")]).line() == (
        "up to 1 file (10 B) sent to each of 2 workers, at least 9 unchanged"
    )


def test_a_new_tpurun_toml_is_kept_out_of_git_wherever_the_repository_keeps_its_files(tmp_path):
    """A repository whose .git is a file (`git init --separate-git-dir`, as submodules have): the rule goes to
    the git directory it names; outside a repository, and for a tpurun.toml already there, nothing changes."""
    from tpurun import settings

    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", "--separate-git-dir", str(tmp_path / "gitdir"), str(repo)], check=True)
    (repo / "deep" / "er").mkdir(parents=True)
    path = settings.write_project_setting("tpu", "t1", repo / "deep" / "er")
    assert path == repo / "deep" / "er" / "tpurun.toml"
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True)
    assert status.returncode == 0 and status.stdout == "", status
    assert (tmp_path / "gitdir" / "info" / "exclude").read_text().splitlines()[-1] == "/deep/er/tpurun.toml"
    settings.write_project_setting("zone", "z", repo / "deep" / "er")  # edited, not made: no second rule
    assert (tmp_path / "gitdir" / "info" / "exclude").read_text().count("tpurun.toml") == 1
    alone = tmp_path / "alone"
    alone.mkdir()
    assert ignore.keep_out_of_git(settings.write_project_setting("tpu", "t2", alone)) is None
    assert sorted(p.name for p in alone.iterdir()) == ["tpurun.toml"]
