"""tpurun sync on emulated nodes (v4-32 = 4 workers): full copy, no-op, one changed file, killed sync,
--delete, ignore rules, and a worker whose disk is full. The tests share one v4-32, each finding its workers
without anything synced; the one that mounts a full disk on a worker makes its own."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import assert_clean_error, job_pids, popen
from tests.integration.conftest import one_pod_per_file
from tpurun.worker import bundle_name

pytestmark = pytest.mark.integration

WORKERS = 4
POD = "n1"  # the shared v4-32: each test's default TPU
shared_pod, cli = one_pod_per_file(POD, "v4-32")
HELPER = "exec(zlib.decompress("  # the sync helper's command line on a worker (its source travels inline)


@pytest.fixture
def pod(cli, shared_pod, emulator):
    """The shared pod's description; what the test synced to its workers is removed after it."""
    yield shared_pod.node
    for w in range(WORKERS):
        root = _worker_root(emulator, POD, w)
        for synced in (root / "project", root / "dst", root.parent / "tmp" / "sel"):
            shutil.rmtree(synced, ignore_errors=True)


def _addresses(pod) -> list[str]:
    return [w["internalIp"] for w in pod["workerEndpoints"]]


def _tree(root: Path) -> dict[str, str]:
    """What should arrive: {relative path: '<mode> <sha256>'}."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "src" / "pkg").mkdir(parents=True)
    for i in range(30):
        (root / "src" / "pkg" / f"m{i}.py").write_text(f"x = {i}\n" * (i + 1))
    (root / "train.sh").write_text("#!/bin/sh\necho train\n")
    (root / "train.sh").chmod(0o755)
    (root / "secret.key").write_text("k")
    (root / "secret.key").chmod(0o600)
    (root / "blob.bin").write_bytes(os.urandom(300_000))
    (root / "data").mkdir()
    (root / "data" / "huge.npy").write_bytes(b"0" * 1000)
    (root / "run.log").write_text("log")
    (root / ".gitignore").write_text("data/\n*.log\n")
    # older than tpurun's "racy" window, so the local hash cache may keep them
    old = time.time_ns() - 3600 * 10**9
    for p in root.rglob("*"):
        os.utime(p, ns=(old, old), follow_symlinks=False)
    return _expected(root)


def _expected(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        # (tpurun.toml, which `create` wrote here, is this machine's setting: never sent)
        if p.is_file() and not rel.startswith("data/") and not rel.endswith(".log") and rel != "tpurun.toml":
            out[rel] = f"{p.stat().st_mode & 0o7777:o} {hashlib.sha256(p.read_bytes()).hexdigest()}"
    return out


# every regular file under dest with its mode and sha256, as the worker sees it
_LIST = (
    "cd {dest} && find . -type f ! -name .tpurun-sync-manifest -printf '%P\\n' | sort | "
    'while read -r f; do echo "$f $(stat -c %a "$f") $(sha256sum "$f" | cut -d\' \' -f1)"; done'
)


def _remote_tree(cli, address: str, dest: str = "/root/project") -> dict[str, str]:
    r = subprocess.run(cli.ssh(address, _LIST.format(dest=dest)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in r.stdout.splitlines()}


def _sync(cli, *args: str) -> dict:
    r = cli("sync", "--json", *args)
    assert r.code == 0, (r.out, r.err)
    doc = json.loads(r.out)
    assert len(doc["workers"]) == WORKERS
    return doc


def test_full_then_noop_then_one_file(cli, pod):
    expected = _tree(cli.cwd)
    doc = _sync(cli)
    assert doc["dest"] == "~/project"
    for w in doc["workers"]:
        assert w["files_sent"] == len(expected) and not w["errors"], w
        assert w["bytes_sent"] == sum((cli.cwd / p).stat().st_size for p in expected)
    for address in _addresses(pod):
        assert _remote_tree(cli, address) == expected  # content, modes; data/ and *.log not sent
    # nothing changed: no file content travels, and nothing is hashed locally
    doc = _sync(cli)
    assert doc["hashed"] == 0
    assert [(w["files_sent"], w["bytes_sent"]) for w in doc["workers"]] == [(0, 0)] * WORKERS
    # one changed file: that file only
    (cli.cwd / "src" / "pkg" / "m3.py").write_text("changed = True\n")
    doc = _sync(cli)
    assert [(w["files_sent"], w["bytes_sent"]) for w in doc["workers"]] == [(1, 15)] * WORKERS
    expected = _expected(cli.cwd)
    for address in _addresses(pod):
        assert _remote_tree(cli, address) == expected
    # a mode change alone is applied without sending content
    (cli.cwd / "secret.key").chmod(0o640)
    doc = _sync(cli)
    assert [w["bytes_sent"] for w in doc["workers"]] == [0] * WORKERS
    assert _remote_tree(cli, _addresses(pod)[2])["secret.key"].startswith("640 ")
    # plain output: one summary line per worker
    r = cli("--plain", "sync")
    assert r.code == 0, r.err
    assert sorted(line.split()[0] for line in r.out.splitlines()) == [f"[w{i}]" for i in range(WORKERS)]


def test_the_helper_runs_from_the_bundle_where_it_is_installed(cli, pod, emulator):
    """Where a worker has this version's bundle (a job's workers do), the sync helper is its copy there, compiled
    once; where it has none, the helper's source travels inline, as before: both sync the same."""
    bundle = f".tpurun/bin/{bundle_name()}"
    gone = cli("exec", "--", "sh", "-c", f'rm -rf "$HOME/{bundle}"')
    assert gone.code == 0, gone.err
    expected = _tree(cli.cwd)
    assert all(w["files_sent"] == len(expected) for w in _sync(cli)["workers"])
    roots = [_worker_root(emulator, POD, w) for w in range(WORKERS)]
    assert not any((root / bundle).exists() for root in roots)
    (cli.cwd / "src" / "pkg" / "m3.py").write_text("changed = True\n")
    (cli.cwd / "hi.py").write_text("print('hi')\n")
    r = cli("train", "hi.py", "--runtime", "cpu", "--launch", "host")  # its hold installs the bundle, then it syncs
    assert r.code == 0, r.err
    for root in roots:
        assert list((root / bundle / "__pycache__").glob("sync_helper.*.pyc")), root
    for address in _addresses(pod):
        assert _remote_tree(cli, address) == _expected(cli.cwd)


def test_delete_removes_only_what_the_source_lost(cli, pod):
    _tree(cli.cwd)
    _sync(cli)
    (cli.cwd / "src" / "pkg" / "m7.py").unlink()
    (cli.cwd / "blob.bin").unlink()
    address = _addresses(pod)[1]
    # a file the worker made under an ignored path (data/) must survive --delete
    subprocess.run(cli.ssh(address, "mkdir -p /root/project/data && echo x > /root/project/data/ckpt"), check=True)
    doc = _sync(cli)  # without --delete nothing vanishes
    assert "blob.bin" in _remote_tree(cli, address)
    doc = _sync(cli, "--delete")
    assert [w["deleted"] for w in doc["workers"]] == [2] * WORKERS
    remote = _remote_tree(cli, address)
    assert "blob.bin" not in remote and "src/pkg/m7.py" not in remote
    assert "data/ckpt" in remote
    r = subprocess.run(cli.ssh(address, "test -f /root/project/.tpurun-sync-manifest"), timeout=30)
    assert r.returncode == 0  # the cache file is never deleted


def _worker_root(emulator, node: str, worker: int) -> Path:
    """The worker's own /root, seen from the host through one of its processes."""
    pids = emulator.emu.hosts.worker_root_pids(emulator.node_name(node), worker)
    return Path(f"/proc/{pids[0]}/root/root")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["killed", "ctrl-c"])
def test_killed_sync_leaves_no_partial_file(cli, pod, emulator, sig):
    """Killed (SIGKILL) or stopped with Ctrl-C (SIGINT: exit 130, one line saying so) mid-stream, a sync leaves
    every file on the workers whole or absent."""
    big = cli.cwd / "big"
    big.mkdir()
    for i in range(3):
        (big / f"f{i}.bin").write_bytes(os.urandom(50 * 1024 * 1024))
    (cli.cwd / "small.txt").write_text("small\n")
    proc = popen(cli, "sync", "--json", stdout=subprocess.DEVNULL)
    roots = [_worker_root(emulator, POD, i) for i in range(WORKERS)]
    deadline = time.monotonic() + 60
    streaming = False
    while time.monotonic() < deadline and not streaming:
        for root in roots:
            d = root / "project" / "big"
            if d.is_dir() and any(n.startswith(".tpurun-tmp-") for n in os.listdir(d)):
                streaming = True
        time.sleep(0.02)
    assert streaming, "the sync never started streaming"
    assert job_pids(emulator, POD, HELPER), "no sync helper seen on the workers while it streams"
    time.sleep(0.3)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    if sig == signal.SIGINT:
        assert proc.returncode == 130, err
        assert err.strip().splitlines()[-1] == "interrupted: nothing half-written is left on the workers", err
    wait_gone = time.monotonic() + 30  # the helpers see EOF, clean up and exit
    while job_pids(emulator, POD, HELPER):
        assert time.monotonic() < wait_gone, "the sync helpers are still running"
        time.sleep(0.05)
    want = {f"f{i}.bin": hashlib.sha256((big / f"f{i}.bin").read_bytes()).hexdigest() for i in range(3)}
    partial_seen = False
    for root in roots:
        d = root / "project" / "big"
        names = os.listdir(d) if d.is_dir() else []
        assert not [n for n in names if n.startswith(".tpurun-tmp-")], names
        for name in names:
            # under its real name a file is complete or absent, never half
            assert hashlib.sha256((d / name).read_bytes()).hexdigest() == want[name]
        partial_seen = partial_seen or len(names) < 3
    assert partial_seen, "the sync finished before it was killed: nothing was tested"
    doc = _sync(cli)
    assert all(not w["errors"] for w in doc["workers"])
    for root in roots:
        for name, sha in want.items():
            assert hashlib.sha256((root / "project" / "big" / name).read_bytes()).hexdigest() == sha


def test_disk_full_on_one_worker(own_cli, emulator):
    cli = own_cli  # a TPU of its own: a worker's disk is made full
    assert cli("create", "full", "-t", "v4-32").code == 0
    (cli.cwd / "a.txt").write_text("a\n")
    (cli.cwd / "big.bin").write_bytes(os.urandom(2 * 1024 * 1024))
    r = cli(
        "exec", "--worker", "1", "--", "sh", "-c", "mkdir -p /root/dst && mount -t tmpfs -o size=1m tmpfs /root/dst"
    )
    assert r.code == 0, r.err
    r = cli("sync", "--dest", "/root/dst", "--json")
    assert_clean_error(r, 1)
    doc = json.loads(r.out)
    lines = [line for line in r.err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "w1" in lines[0] and "big.bin" in lines[0] and "No space left" in lines[0], r.err
    by = {w["worker"]: w for w in doc["workers"]}
    assert by[1]["errors"] and all(
        not by[i]["errors"] and by[i]["files_sent"] == by[i]["files_total"] for i in (0, 2, 3)
    )
    names = os.listdir(_worker_root(emulator, "full", 1) / "dst")
    assert "big.bin" not in names and not [n for n in names if n.startswith(".tpurun-tmp-")], names
    assert "a.txt" in names


def test_worker_selection_and_errors(cli, pod):
    (cli.cwd / "a.txt").write_text("a\n")
    doc = json.loads(cli("sync", "--json", "--worker", "2", "--dest", "/tmp/sel").out)
    w = doc["workers"][0]
    assert w["worker"] == 2 and w["files_sent"] == w["files_total"] == 1  # a.txt (tpurun.toml stays here)
    assert_clean_error(cli("sync", "nope"), 2)
    assert_clean_error(cli("sync", "--worker", "9"), 2)
