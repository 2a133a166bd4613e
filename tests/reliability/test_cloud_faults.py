"""Faults around provisioning and sync: API 429/503 bursts, a startup script that hangs, preemption during
sync, and a full disk on one worker during sync."""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers import assert_clean_error
from tests.reliability.conftest import create, finish, popen, timing, worker_home

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("code", [429, 503])
@pytest.mark.parametrize("phase,match", [("create", "POST"), ("wait", "GET")])
def test_api_burst_is_retried(cli, emulator, code, phase, match):
    emulator.fail_api(3, code, match=match + " /v2/")
    t0 = time.monotonic()
    r = cli("create", f"burst-{phase}-{code}", "-t", "v4-8")
    timing(f"API {code} x3 during {phase}: create succeeded", time.monotonic() - t0)
    assert r.code == 0, r.err
    assert "Traceback" not in r.err
    # tpurun's retries are shown, those of the operation's polls (phase wait) as well as the create call's
    assert f"{code}" in r.err and "retrying" in r.err


def test_api_burst_beyond_the_retry_budget_is_api_error(cli, emulator):
    emulator.fail_api(100, 503, match="GET /v2/")
    cli.env["TPURUN_RETRY_ATTEMPTS"] = "2"
    r = cli("create", "burst-long", "-t", "v4-8")
    assert_clean_error(r, 3)
    assert "kept answering 503" in r.err and "after 2 attempts" in r.err
    assert r.err.count("retrying (1/1)") == 1


def test_startup_script_hangs_create_times_out(cli, emulator):
    (cli.cwd / "hang.sh").write_text("#!/bin/sh\necho starting\nsleep 100000\n")
    t0 = time.monotonic()
    r = cli("create", "hang", "-t", "v4-8", "--startup-script", "hang.sh", "--timeout", "5")
    timing("startup script hangs: create gives up (--timeout 5)", time.monotonic() - t0)
    assert_clean_error(r, 3)
    assert "startup script has not finished" in r.err and "after 5 s" in r.err, r.err
    assert time.monotonic() - t0 < 60


def test_preempted_during_sync(cli, emulator):
    create(cli, "psync", "v4-16", "--spot")
    big = cli.cwd / "big"
    big.mkdir()
    for i in range(3):
        (big / f"f{i}.bin").write_bytes(os.urandom(40 * 1024 * 1024))
    proc = popen(cli, "sync")
    deadline = time.monotonic() + 60
    homes = [worker_home(emulator, "psync", w) for w in range(2)]
    while not any((h / "project" / "big").is_dir() and os.listdir(h / "project" / "big") for h in homes):
        assert time.monotonic() < deadline and proc.poll() is None, "the sync never started streaming"
        time.sleep(0.02)
    t0 = time.monotonic()
    emulator.preempt(emulator.node_name("psync"))
    out, err = finish(proc, 120)
    timing("preempted during sync: tpurun exits", time.monotonic() - t0)
    assert proc.returncode == 4, (out, err)
    assert "Traceback" not in err and ("w0" in err or "w1" in err), err
    # under its real name a file is complete or absent, never half (temporary names may stay on a dead VM)
    for h in homes:
        d = h / "project" / "big"
        for name in os.listdir(d) if d.is_dir() else []:
            if not name.startswith(".tpurun-tmp-"):
                assert (d / name).stat().st_size == 40 * 1024 * 1024, name


def test_disk_full_during_sync(cli, emulator):
    create(cli, "full", "v4-16")
    (cli.cwd / "a.txt").write_text("a\n")
    (cli.cwd / "big.bin").write_bytes(os.urandom(2 * 1024 * 1024))
    r = cli(
        "exec", "--worker", "1", "--", "sh", "-c", "mkdir -p /root/dst && mount -t tmpfs -o size=1m tmpfs /root/dst"
    )
    assert r.code == 0, r.err
    r = cli("sync", "--dest", "/root/dst")
    assert_clean_error(r, 1)
    errors = [line for line in r.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "w1" in errors[0] and "big.bin" in errors[0] and "No space left" in errors[0]
    r = cli("exec", "--worker", "1", "--", "ls", "-a", "/root/dst")
    names = [line.split("] ", 1)[1] for line in r.out.splitlines()]
    assert "a.txt" in names and "big.bin" not in names
    assert not [n for n in names if n.startswith(".tpurun-tmp-")], names  # no partial file left
    cli("exec", "--worker", "1", "--", "umount", "/root/dst")
