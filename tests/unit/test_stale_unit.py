"""Unit tests for kill-stale's scanner helpers (tpurun.worker.probe) and doctor's judgement (tpurun.health)."""

from __future__ import annotations

import os
import subprocess
import time

from tests.helpers import python_up
from tpurun import health
from tpurun.cloud.startup import StartupReport, StartupStatus
from tpurun.worker import probe


def test_device_and_libtpu_matching():
    globs = probe.DEFAULT_DEVICE_GLOBS
    assert probe.matches_device("/dev/accel0", globs)
    assert probe.matches_device("/dev/vfio/3", globs) and probe.matches_device("/dev/vfio/vfio", globs)
    assert probe.matches_device("/dev/accel1 (deleted)", globs)
    assert not probe.matches_device("/dev/null", globs) and not probe.matches_device("socket:[123]", globs)
    assert not probe.matches_device("/dev/accelerometer/x", ["/dev/accel[0-9]*"])
    pat = probe.DEFAULT_LIBTPU_GLOB
    assert probe.matches_libtpu("/usr/local/lib/python3.10/dist-packages/libtpu/libtpu.so", pat)
    assert probe.matches_libtpu("/lib/libtpu.so (deleted)", pat)
    assert probe.matches_libtpu("/opt/libtpu_nightly.so", pat)
    assert not probe.matches_libtpu("/usr/lib/libtpu.so.backup", pat)
    assert not probe.matches_libtpu("/usr/lib/libc.so.6", pat)
    # a pattern with a '/' matches the whole path (the testing hook TPURUN_LIBTPU_GLOB)
    assert probe.matches_libtpu("/tmp/t1/libtpu.so", "/tmp/t1/libtpu*.so")
    assert not probe.matches_libtpu("/lib/libtpu.so", "/tmp/t1/libtpu*.so")


def test_maps_stat_status_cmdline_parsing():
    maps = (
        "7f00-7f01 r-xp 00000000 08:01 1234   /usr/lib/libtpu/libtpu.so\n"
        "7f01-7f02 rw-p 00000000 00:00 0 \n"
        "7f02-7f03 r--p 00000000 08:01 99     /tmp/dir with space/libtpu.so (deleted)\n"
        "7ffd-7ffe rw-p 00000000 00:00 0      [stack]\n"
    )
    assert probe.maps_paths(maps) == {"/usr/lib/libtpu/libtpu.so", "/tmp/dir with space/libtpu.so"}
    stat = "42 (python3 (x) y) S 7 42 42 0 -1 4194560 " + " ".join(["0"] * 12) + " 123456 0 0"  # starttime is field 22
    assert probe.parse_stat(stat) == (7, "S", 123456)
    assert probe.parse_status_uid("Name:\tx\nUid:\t1000\t1000\t1000\t1000\n") == 1000
    assert probe.parse_status_uid("Name:\tx\n") is None
    assert probe.format_cmdline(b"python3\0-c\0print('a b')\0\0") == "python3 -c 'print('\"'\"'a b'\"'\"')' ''"
    assert probe.format_cmdline(b"") == ""


def test_parse_env_exports():
    text = (
        "# export XRT_TPU_CONFIG=commented\n"
        'export XRT_TPU_CONFIG="localservice;0;localhost:51011"\n'
        "  PJRT_DEVICE=TPU # a comment\n"
        "export OTHER=1\n"
        "export TPU_NUM_DEVICES='4';\n"
        "echo PJRT_DEVICE=CPU\n"
    )
    assert probe.parse_env_exports(text) == [
        (2, "XRT_TPU_CONFIG", "localservice;0;localhost:51011"),
        (3, "PJRT_DEVICE", "TPU"),
        (5, "TPU_NUM_DEVICES", "4"),
    ]


def test_plan_signals():
    assert probe.plan_signals(0.0, 10, [1, 2], set()) == ([1, 2], [])
    assert probe.plan_signals(5.0, 10, [2], {1, 2}) == ([], [])
    assert probe.plan_signals(10.0, 10, [2], {1, 2}) == ([], [2])
    assert probe.plan_signals(0.0, 0, [3], set()) == ([3], [])  # TERM first even with no grace


def test_ancestors_protect_the_caller():
    chain = probe.ancestors(os.getpid())
    assert {os.getpid(), os.getppid()} <= chain


def test_scan_and_kill_on_test_paths(tmp_path):
    """The real scanner and kill loop against this test's own fake device: a TERM-ignoring holder is
    KILLed after the grace; an unrelated process survives; the lock is removed only once free."""
    dev = tmp_path / "accel0"
    dev.write_bytes(b"")
    lock = tmp_path / "lockfile"
    lock.write_text("")
    code = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "f = open(sys.argv[1]); print('up', flush=True); time.sleep(60)"
    )
    holder = python_up(code, str(dev))
    other = subprocess.Popen(["sleep", "60"])
    try:
        cfg = {"device_globs": [str(dev)], "libtpu_glob": str(tmp_path / "libtpu*.so"), "lock_globs": [str(lock)]}
        dry = probe.free_tpu(dict(cfg, dry_run=True)).to_dict()
        assert [h["pid"] for h in dry["holders"]] == [holder.pid] and not dry["free"]
        assert dry["holders"][0]["holds"] == [str(dev)] and dry["locks"][0]["result"] == "would remove"
        t0 = time.monotonic()
        out = probe.free_tpu(dict(cfg, grace=0.5)).to_dict()
        assert time.monotonic() - t0 >= 0.5
        assert out["free"] and out["holders"][0]["result"] == "killed (SIGKILL)"
        assert out["locks"] == [{"path": str(lock), "result": "removed"}] and not lock.exists()
        assert holder.wait(5) == -9 and other.poll() is None
    finally:
        for p in (holder, other):
            p.kill()
            p.wait()


def test_lock_kept_while_open(tmp_path):
    lock = tmp_path / "libtpu_lockfile"
    lock.write_text("")
    with open(lock):
        found = probe.find_holders([str(tmp_path / "nodev")], str(tmp_path / "x.so"), [str(lock)]).to_dict()
        # this process is an ancestor of nothing here, but it is the scanner itself: protected
        assert found["lock_users"] == {}
    kept = [lk.to_dict() for lk in probe.unlock([str(lock)], {str(lock): [123]}, dry_run=False)]
    assert kept == [{"path": str(lock), "result": "kept: open in pid 123"}] and lock.exists()


# ------------------------------------------------------------------ doctor


def _probe(**kw):
    """A doctor probe's answer as the worker sends it, with KW changed, read as tpurun reads it."""
    base = {
        "python_probe": {
            "python": "/usr/bin/python3",
            "python_version": "3.10.12",
            "torch_version": "2.9.0+cpu",
            "torch_xla_version": "2.9.0",
            "libtpu_installed": True,
            "libtpu_path": "/x/libtpu",
        },
        "devices_present": ["/dev/accel0"],
        "devices_missing": [],
        "holders": [],
        "locks": [],
        "env": {},
        "env_files": [],
        "disk": {"home": ["/root", 50 << 30], "tmp": ["/tmp", 50 << 30]},
    }
    for k, v in kw.items():
        if k in base["python_probe"]:
            base["python_probe"][k] = v
        else:
            base[k] = v
    return probe.DoctorAnswer.from_dict(base)


def _python_failed(error):
    """A doctor probe's answer where the user's Python could not run."""
    return probe.DoctorAnswer.from_dict({"python_probe": {"error": error}})


def _status(checks, name):
    return [c.status for c in checks if c.name == name]


def test_versions():
    assert health.version_tuple("2.9.0+cpu") == (2, 9, 0) and health.version_tuple("2.1.0rc1") == (2, 1, 0)
    assert health.version_tuple(None) == () and health.major_minor("2.10.1") == "2.10"
    assert health.check_versions(0, _probe(), "python3").status == "pass"
    bad = health.check_versions(0, _probe(torch_xla_version="2.8.0"), "python3")
    assert bad.status == "fail" and "do not match" in bad.detail and "torch_xla[tpu]==2.9.*" in bad.fix
    missing = health.check_versions(0, _probe(torch_xla_version=None), "python3")
    assert missing.status == "fail" and "torch_xla is not installed" in missing.detail
    none = health.check_versions(0, _probe(torch_xla_version=None, torch_version=None), "python3")
    assert "neither" in none.detail
    err = health.check_versions(0, _python_failed("py: not found"), "py")
    assert err.status == "fail" and err.name == "python"


def test_same_versions_across_workers():
    """doctor's rows come from the same comparison as train's refusal (preflight.compare)."""
    from types import SimpleNamespace

    from tpurun.job import preflight

    def probe(**packages):
        p = _probe()
        p.python_probe.packages = {"torch": "2.9.0+cpu", "torch_xla": "2.9.0", "jax": None, **packages}
        return p

    probes = {0: probe(), 1: probe(), 2: probe(torch_xla="2.8.0"), 3: _python_failed("x")}
    answers = {w: a for w, a in ((w, preflight.from_probe(p)) for w, p in probes.items()) if a is not None}
    assert sorted(answers) == [0, 1, 2]
    target = SimpleNamespace(name="t", all_workers=[SimpleNamespace(name=f"w{i}") for i in range(4)])
    skew = preflight.compare(target, answers)
    checks = health.check_same_versions(skew, {w: f"w{w}" for w in answers})
    assert [(c.worker, c.status) for c in checks] == [(0, "pass"), (1, "pass"), (2, "fail")]
    assert "torch_xla 2.8.0 (others: 2.9.0)" in checks[2].detail
    same = preflight.compare(target, {0: answers[0], 1: answers[1]})
    assert [c.status for c in health.check_same_versions(same, {0: "w0", 1: "w1"})] == ["pass", "pass"]


def test_libtpu_and_devices():
    assert health.check_libtpu(0, _probe(), "python3").status == "pass"
    no = health.check_libtpu(0, _probe(libtpu_installed=False), "python3")
    assert no.status == "fail" and "torch_xla[tpu]" in no.fix
    assert health.check_libtpu(0, _probe(libtpu_installed=False, devices_present=[]), "python3").status == "pass"
    # plain files where a TPU has character devices: an emulated worker, a warning that says both sides
    emu = health.check_libtpu(0, _probe(libtpu_installed=False, devices_plain=["/dev/accel0"]), "python3")
    assert emu.status == "warn" and "an emulated worker" in emu.detail and "on a real TPU VM" in emu.fix
    kw = {"named_tpu": True, "kill_stale_cmd": "tpurun kill-stale --tpu t"}
    assert _status(health.check_devices(0, _probe(), **kw), "devices") == ["pass"]
    busy = health.check_devices(
        0, _probe(holders=[{"pid": 7, "user": "u", "command": "python3 t.py", "holds": ["/dev/accel0"]}]), **kw
    )
    assert busy[0].status == "fail" and "pid 7 holds /dev/accel0" in busy[0].detail
    assert "tpurun kill-stale --tpu t" in busy[0].fix
    missing = health.check_devices(0, _probe(devices_missing=["/dev/accel3"]), **kw)
    assert missing[0].status == "fail" and "/dev/accel3" in missing[0].detail
    assert health.check_devices(0, _probe(devices_present=[]), **kw)[0].status == "fail"
    assert health.check_devices(0, _probe(devices_present=[]), named_tpu=False, kill_stale_cmd="k")[0].status == "warn"
    stale_lock = health.check_devices(0, _probe(locks=[{"path": "/tmp/libtpu_lockfile", "open_in": []}]), **kw)
    assert _status(stale_lock, "lock files") == ["warn"]


def test_xla_config_rules():
    def xla(**kw):
        return health.check_xla_config(0, _probe(**kw))

    assert [c.status for c in xla()] == ["pass"]
    bashrc = [{"file": "~/.bashrc", "line": 12, "name": "XRT_TPU_CONFIG", "value": "localservice;0;localhost:51011"}]
    (c,) = xla(env_files=bashrc)
    assert (
        c.status == "fail" and "~/.bashrc:12" in c.detail and "delete the XRT_TPU_CONFIG line at ~/.bashrc:12" in c.fix
    )
    # XRT era: XRT_TPU_CONFIG is right, but not together with PJRT_DEVICE
    assert [c.status for c in xla(torch_xla_version="1.13", torch_version="1.13", env_files=bashrc)] == ["pass"]
    both = xla(torch_xla_version="2.0", torch_version="2.0", env_files=bashrc, env={"PJRT_DEVICE": "TPU"})
    assert [c.status for c in both] == ["fail"] and "both" in both[0].detail
    # PJRT_DEVICE=TPU without libtpu / devices; an unknown device
    assert "libtpu is not installed" in xla(env={"PJRT_DEVICE": "TPU"}, libtpu_installed=False)[0].detail
    assert "no TPU device files" in xla(env={"PJRT_DEVICE": "TPU"}, devices_present=[])[0].detail
    assert xla(env={"PJRT_DEVICE": "TPU"})[0].status == "pass"
    assert xla(env={"PJRT_DEVICE": "TPUU"})[0].status == "fail"
    # the seeds' "Missing XLA configuration": torch_xla 1.x on a TPU with nothing set
    warn = xla(torch_xla_version="1.13", torch_version="1.13")
    assert warn[0].status == "warn" and "Missing XLA configuration" in warn[0].detail


def test_disk_clock_startup_ssh():
    low = health.check_disk(0, _probe(disk={"home": ["/root", 5 << 30], "tmp": ["/tmp", 1 << 20]}))
    assert [(c.name, c.status) for c in low] == [("disk home", "warn"), ("disk tmp", "fail")]
    # client sent at 100.0, got the answer at 100.4; the worker answered 0.2 s after reading 105.1
    offset, unc = health.clock_offset(100.0, 100.4, 105.1, 0.2)
    assert abs(offset - 5.0) < 1e-9 and abs(unc - 0.1) < 1e-9
    assert health.check_clock(0, offset, unc).status == "warn"
    assert health.check_clock(0, 0.3, 0.1).status == "pass"
    assert health.check_clock(0, 1.05, 0.1).status == "pass"  # within the measurement's error
    assert health.check_clock(0, -400.0, 0.1).status == "fail"
    assert health.check_clock(0, None).status == "pass"
    assert health.check_startup(0, StartupReport(StartupStatus.DONE, duration=3), "log").status == "pass"
    failed = health.check_startup(0, StartupReport(StartupStatus.FAILED, exit_code=2, step="setup", tail="a\nboom"), "cat log")
    assert failed.status == "fail" and "boom" in failed.detail and "cat log" in failed.fix
    assert health.check_startup(0, StartupReport(StartupStatus.RUNNING), "x").status == "warn"
    assert health.check_ssh(1, "cannot reach worker w1").status == "fail"
    assert health.summary([health.Check(0, "a", "pass", ""), health.Check(0, "b", "fail", "")]) == {
        "pass": 1,
        "warn": 0,
        "fail": 1,
    }
