"""tpurun kill-stale on emulated workers with real processes: holders of a device file, of a mapped
libtpu.so and one that ignores SIGTERM are stopped; an unrelated process and other paths are not; stale
lock files go; --dry-run changes nothing. Plus the same scanner on this machine, pointed at test paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers import python_up

pytestmark = pytest.mark.integration

# Each holder carries a tag in its argv so the test can tell them apart in any process table.
_PLANT = r"""
set -e
DEV_A=$1; DEV_B=$2
mkdir -p /root/lib
printf 'int tpurun_test_symbol = 1;\n' > /root/lib/x.c
gcc -shared -fPIC -o /root/lib/libtpu.so /root/lib/x.c
rm -f /tmp/ready-*
touch /tmp/libtpu_lockfile
setsid nohup python3 -c "import sys, time; f = open(sys.argv[1], 'rb'); open('/tmp/ready-dev', 'w').close(); time.sleep(999)" "$DEV_A" tag-holder-dev >/dev/null 2>&1 </dev/null &
setsid nohup python3 -c "import ctypes, time; ctypes.CDLL('/root/lib/libtpu.so'); open('/tmp/ready-lib', 'w').close(); time.sleep(999)" tag-holder-lib >/dev/null 2>&1 </dev/null &
setsid nohup python3 -c "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); f = open(sys.argv[1], 'rb'); open('/tmp/ready-stubborn', 'w').close(); time.sleep(999)" "$DEV_B" tag-holder-stubborn >/dev/null 2>&1 </dev/null &
setsid nohup sleep 998 >/dev/null 2>&1 </dev/null &
for i in $(seq 100); do
  [ -e /tmp/ready-dev ] && [ -e /tmp/ready-lib ] && [ -e /tmp/ready-stubborn ] && exit 0
  sleep 0.05
done
echo "holders did not start" >&2; exit 1
"""

TAGS = {"tag-holder-dev", "tag-holder-lib", "tag-holder-stubborn"}


def _cmdlines(emulator, node: str, worker: int) -> list[str]:
    out = []
    for pid in emulator.emu.hosts.worker_root_pids(emulator.node_name(node), worker):
        try:
            out.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return out


def _tags_alive(emulator, node: str, worker: int) -> set[str]:
    return {t for cmd in _cmdlines(emulator, node, worker) for t in TAGS | {"sleep 998"} if t in cmd}


def _plant(cli, dev_a: str, dev_b: str) -> None:
    r = cli("exec", "--", "sh", "-c", _PLANT, "plant", dev_a, dev_b)
    assert r.code == 0, r.err


def _tag(command: str) -> str:
    return next(t for t in TAGS if t in command)


def _lock_exists(emulator, node: str, worker: int) -> bool:
    """The worker's own /tmp, seen from the host through its init's root (a worker is a mount namespace)."""
    init = emulator.emu.hosts.worker_root_pids(emulator.node_name(node), worker)[0]
    return os.path.exists(f"/proc/{init}/root/tmp/libtpu_lockfile")


def _check_kill_stale(cli, emulator, node: str, dev_a: str, dev_b: str, workers: int) -> None:
    # --dry-run: exactly the three holders per worker, nothing changes; exit 1 = the TPU is held
    r = cli("kill-stale", "--dry-run", "--json")
    assert r.code == 1, r.err
    doc = json.loads(r.out)
    assert doc["dry_run"] and not doc["free"] and len(doc["workers"]) == workers
    for w in doc["workers"]:
        holds = {_tag(h["command"]): h["holds"] for h in w["holders"]}
        assert holds == {
            "tag-holder-dev": [dev_a],
            "tag-holder-lib": ["/root/lib/libtpu.so"],
            "tag-holder-stubborn": [dev_b],
        }, w["holders"]
        assert {h["result"] for h in w["holders"]} == {"would kill"}
        assert all(h["user"] == "root" and h["age"] >= 0 for h in w["holders"])
        assert w["locks"] == [{"path": "/tmp/libtpu_lockfile", "result": "would remove"}]
    for w in range(workers):
        assert _tags_alive(emulator, node, w) == TAGS | {"sleep 998"}
        assert _lock_exists(emulator, node, w), "dry run removed a lock file"

    # the real thing: TERM, the stubborn one KILLed after the grace, locks removed, sleep untouched
    t0 = time.monotonic()
    r = cli("kill-stale", "--grace", "2", "--json")
    took = time.monotonic() - t0
    assert r.code == 0, (r.out, r.err)
    doc = json.loads(r.out)
    assert doc["free"] and 2 <= took < 60
    for w in doc["workers"]:
        results = {_tag(h["command"]): h["result"] for h in w["holders"]}
        assert results == {
            "tag-holder-dev": "terminated (SIGTERM)",
            "tag-holder-lib": "terminated (SIGTERM)",
            "tag-holder-stubborn": "killed (SIGKILL)",
        }
        assert w["locks"] == [{"path": "/tmp/libtpu_lockfile", "result": "removed"}]
    deadline = time.monotonic() + 5
    while any(_tags_alive(emulator, node, w) != {"sleep 998"} for w in range(workers)):
        assert time.monotonic() < deadline, [_tags_alive(emulator, node, w) for w in range(workers)]
        time.sleep(0.1)
    for w in range(workers):
        assert not _lock_exists(emulator, node, w), "a lock file was left"


def test_kill_stale_v4_accel(cli, emulator):
    assert cli("create", "ks4", "-t", "v4-32").code == 0
    _plant(cli, "/dev/accel0", "/dev/accel1")
    for w in range(4):
        assert _tags_alive(emulator, "ks4", w) == TAGS | {"sleep 998"}
    # the table form, one worker selected
    r = cli("kill-stale", "--worker", "1", "--dry-run")
    assert r.code == 1
    rows = [line for line in r.out.splitlines() if line.startswith("w")]
    assert len(rows) == 4 and all(line.startswith("w1 ") for line in rows)  # 3 holders + 1 lock file row
    assert "would kill" in r.out and "tpurun kill-stale --tpu ks4" in r.err
    _check_kill_stale(cli, emulator, "ks4", "/dev/accel0", "/dev/accel1", 4)
    r = cli("kill-stale", "--worker", "2")
    assert r.code == 0 and "w2: nothing holds the TPU" in r.err, r.err


def test_kill_stale_vfio_generation(cli, emulator):
    assert cli("create", "ks5", "-t", "v5litepod-16").code == 0
    _plant(cli, "/dev/vfio/0", "/dev/vfio/vfio")
    _check_kill_stale(cli, emulator, "ks5", "/dev/vfio/0", "/dev/vfio/vfio", 4)


def test_kill_stale_local_only_touches_planted_paths(tmp_path):
    """--local runs the same scanner here; the testing hooks point it at this test's own files."""
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "accel0").write_bytes(b"")
    lock = tmp_path / "libtpu_lockfile"
    lock.write_text("")
    holder = python_up(
        "import sys, time; f = open(sys.argv[1], 'rb'); print('up', flush=True); time.sleep(60)", str(dev / "accel0")
    )
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        env = dict(os.environ)
        env.update(
            TPURUN_DEVICE_GLOBS=str(dev / "accel*"),
            TPURUN_LIBTPU_GLOB=str(tmp_path / "libtpu*.so"),
            TPURUN_LOCK_FILES=str(lock),
        )
        env.pop("TPURUN_TPU", None)
        run = [sys.executable, "-m", "tpurun", "kill-stale", "--local", "--grace", "1", "--json"]
        r = subprocess.run(run, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        (w,) = doc["workers"]
        assert [h["pid"] for h in w["holders"]] == [holder.pid]
        assert w["holders"][0]["result"] == "terminated (SIGTERM)"
        assert w["locks"] == [{"path": str(lock), "result": "removed"}]
        assert holder.wait(5) == -15 and bystander.poll() is None and not lock.exists()
        assert "running on this machine as a one-host pod (--local)" in r.stderr
    finally:
        for p in (holder, bystander):
            p.kill()
            p.wait()
