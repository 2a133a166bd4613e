"""A job's one end, told the same by `train`, `jobs`, `logs` and their `--json`, with one exit code per end, on an
emulated v4-16 through the real CLI: a job a maintenance notice cut short is never a program failure, whatever
`--on-notice` said and however its script exited (exit 75); `logs --follow` ends with a detached job whose host
went (never waits forever); `cancel` of an ended job changes nothing; a record, once it has its end, is never
rewritten by what happens to the TPU later; `logs` shows every reachable worker's lines and names the others."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time

import pytest

from tests.helpers import create_node, finish, job_pids, popen, read_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# Saves and exits 3 when told of a host event, by SIGUSR1 or the notice file; runs on otherwise.
NOTICED = """\
import os, signal, sys, time

w = os.environ["TPURUN_WORKER_ID"]
def saved(*_):
    print(f"saved w{w}", flush=True)
    sys.exit(3)
signal.signal(signal.SIGUSR1, saved)
for i in range(100000):
    if os.path.exists(os.environ["TPURUN_NOTICE_FILE"]):
        saved()
    print(f"tick {i} w{w}", flush=True)
    time.sleep(0.1)
"""

# Ignores every notice: it runs until it is stopped or its host goes.
IGNORES = """\
import os, time

w = os.environ["TPURUN_WORKER_ID"]
for i in range(100000):
    print(f"tick {i} w{w}", flush=True)
    time.sleep(0.2)
"""


def _ticking(lines: list[str]) -> bool:
    return all(any(f"tick 3 w{w}" in x for x in lines) for w in (0, 1))


def _running(cli) -> str:
    """The job that runs, once its processes on both workers have printed (read through `logs`)."""
    deadline = time.time() + 180
    while time.time() < deadline:
        running = [j["job_id"] for j in json.loads(cli("jobs", "--json").out) if j["status"] == "running"]
        if running and _ticking(cli("--plain", "logs", running[0]).out.splitlines()):
            return running[0]
        time.sleep(0.2)
    raise AssertionError("no job started")


def _row(cli, job: str) -> dict:
    return next(j for j in json.loads(cli("jobs", "--json").out) if j["job_id"] == job)


def _back(cli, name: str) -> None:
    """Until NAME's maintenance is over and its hosts are up again."""
    deadline = time.time() + 120
    while time.time() < deadline:
        d = json.loads(cli("describe", name, "--json").out)
        if not d["maintenance"] and d["state"] == "READY":
            return
        time.sleep(0.5)
    raise AssertionError(f"{name} not back from maintenance: {d}")


def test_a_job_a_notice_cut_short_ends_as_maintenance_everywhere_whatever_on_notice_said(cli, emulator):
    create_node(cli, "told", "v4-16")
    node = emulator.node_name("told")
    (cli.cwd / "noticed.py").write_text(NOTICED)
    for action in ("signal:SIGUSR1", "file", "stop"):
        json_out = action == "stop"  # this once `train --json`, which prints no line of the program's
        proc = popen(
            cli, "--plain", "train", "noticed.py", "--runtime", "cpu", "--launch", "host", "--on-notice", action,
            *(["--json"] if json_out else []),
        )  # fmt: skip
        lines = [] if json_out else read_until(proc, _ticking, timeout=180)
        if json_out:
            _running(cli)
        # w1's notice, seen there within a second, reaches w0 through w1's supervisor before the host goes
        emulator.admin.maintenance(node, 1, notice=6, duration=1)
        out, err = finish(proc, timeout=240)
        lines += out.splitlines()
        assert proc.returncode == 75, (action, err[-3000:])
        if json_out:
            said = json.loads(out)
            assert (said["end"], said["exit_code"], said["notice"]["kind"]) == ("maintenance", 75, "maintenance"), said
        assert "ended (maintenance): maintenance of a host of its TPU cut it short" in err, (action, err[-3000:])
        assert "failed first" not in err and "failed (exit code" not in err, (action, err[-3000:])
        if action != "stop":  # the script itself saved and exited 3, told as the notice's doing
            assert {"saved w0", "saved w1"} <= {x.split("] ", 1)[-1] for x in lines}, (action, lines[-20:], err[-2000:])
        job = re.search(r"job (\d{8}-\d{6}-[0-9a-f]{4})", err).group(1)
        row = _row(cli, job)
        assert (row["status"], row["end"], row["exit_code"]) == ("maintenance", "maintenance", 75), (action, row)
        assert row["notice"]["kind"] == "maintenance" and row["notice"]["action"] == action, row
        _back(cli, "told")
        followed = cli("logs", job, "--follow")
        assert followed.code == 75 and f"job {job} ended (maintenance)" in followed.err, (action, followed.err)
        assert "failed" not in followed.err, followed.err

    # a restart waits for the window to begin and the host to be back: Ctrl-C there says what it stopped, exits 130
    proc = popen(
        cli, "--plain", "train", "noticed.py", "--runtime", "cpu", "--launch", "host",
        "--on-notice", "signal:SIGUSR1", "--restarts", "maintenance=1", stderr=subprocess.STDOUT,
    )  # fmt: skip
    read_until(proc, _ticking, timeout=180)
    emulator.admin.maintenance(node, 1, notice=30, duration=1)
    read_until(proc, lambda ls: any("restart 1/1: waiting for told to be usable again" in x for x in ls), timeout=120)
    proc.send_signal(signal.SIGINT)
    out, _ = finish(proc, timeout=60)
    assert proc.returncode == 130, out[-2000:]
    assert "interrupted while waiting for told to be usable again: the job was not relaunched" in out, out[-2000:]
    assert not job_pids(emulator, "told", "noticed.py"), "a process of the job outlived tpurun"


def test_a_detached_job_whose_host_went_ends_its_follow_keeps_its_end_and_shows_what_it_can(cli, emulator):
    create_node(cli, "far", "v4-16")
    node = emulator.node_name("far")
    (cli.cwd / "ignores.py").write_text(IGNORES)
    r = cli("train", "ignores.py", "--runtime", "cpu", "--launch", "host", "--detach", "--on-notice", "file")
    assert r.code == 0, r.err
    job = r.out.strip().splitlines()[-1]
    proc = popen(cli, "--plain", "logs", job, "--follow")
    read_until(proc, _ticking, timeout=120)
    emulator.admin.maintenance(node, 1, notice=2, duration=1)
    out, err = finish(proc, timeout=180)  # it waited forever before
    assert proc.returncode == 75, err[-3000:]
    assert f"job {job} ended (maintenance)" in err, err[-3000:]
    _back(cli, "far")

    # what still runs of it is stopped, and its end stays the notice's (it read `stopped` before)
    row = _row(cli, job)
    assert (row["status"], row["end"]) == ("maintenance", "maintenance"), row
    stopped = cli("cancel", job)
    assert stopped.code == 0, stopped.err
    row = _row(cli, job)
    assert (row["status"], row["end"], row["exit_code"]) == ("maintenance", "maintenance", 75), row
    again = cli("cancel", job)
    assert again.code == 0 and f"job {job} had already ended (maintenance): nothing to stop" in again.err, again.err

    # a worker lost since: the record's end stands; what cannot be seen now is said beside it
    emulator.kill_worker(node, 1)
    row = _row(cli, job)
    assert (row["status"], row["end"], row["seen"]) == ("maintenance", "maintenance", "w1 unreachable now"), row
    shown = cli("--plain", "logs", job)
    assert shown.code == 4, shown.err
    assert "[w0] tick 3 w0" in shown.out and "w1" not in shown.out, shown.out[-500:]
    assert "error: w1" in shown.err and "--worker" in shown.err, shown.err
    followed = cli("--plain", "logs", job, "--follow")  # the same, and it ends
    assert followed.code == 4 and "[w0] tick 3 w0" in followed.out, followed.err
