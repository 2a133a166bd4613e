"""Faults during `tpurun train` on a 2-worker emulated node (2 cores each): each case checks the outcome,
the message, the exit code, that no process of the job is left in any worker's process table, and that
every line printed before the fault is in the per-core log files and (attached) on tpurun's output. The
cases share one node, on whose workers each finds no job of another; those that kill a worker or have their
node preempted make their own."""

from __future__ import annotations

import json
import re
import shutil
import signal
import time

import pytest

from tests.helpers import assert_clean_error
from tests.integration.conftest import one_pod_per_file
from tests.reliability.conftest import (
    TICKER,
    core_log,
    create,
    finish,
    job_id,
    job_pids,
    lines_by_core,
    popen,
    read_until,
    timing,
    wait_no_pids,
    worker_home,
)

pytestmark = pytest.mark.integration

NODE = "rel"  # the shared v4-16: each test's default TPU
shared_pod, cli = one_pod_per_file(NODE, "v4-16")

TRAIN = ("--runtime", "cpu", "--cores", "2", "--python", "python3")
CORES = [(0, 0), (0, 1), (1, 0), (1, 1)]


def _each_core_printed(k: int):
    """Predicate over stdout lines: every core printed its line n K."""
    return lambda lines: all(any(line == f"[w{w}/c{c}] n {k} w{w} c{c}" for line in lines) for w, c in CORES)


def _assert_lines_kept(emulator, node: str, job: str, out: str, seen: list[str], cores=CORES) -> None:
    """Every line seen before the fault is in the per-core log and on the client's output, in order."""
    by_core = lines_by_core(out)
    before = lines_by_core("\n".join(seen))
    for w, c in cores:
        log = core_log(emulator, node, job, w, c)
        got = by_core.get((w, c), [])
        assert log[: len(got)] == got, ((w, c), log, got)  # the client's lines are the file's, in order
        assert len(log) - len(got) <= 1, ((w, c), log, got)  # at most one line in flight at the fault
        assert before.get((w, c), []) == got[: len(before.get((w, c), []))]


@pytest.fixture
def node(cli, ticker, emulator):
    """The shared node; the jobs' files and markers the test left on its workers go after it (its processes go
    with the `cli` fixture's end)."""
    cli.env["TPURUN_PREEMPT_CHECK"] = "3"  # a lost worker on a READY node: look 3 s for a preemption, not 20
    yield NODE
    for w in range(2):
        home = worker_home(emulator, NODE, w)
        shutil.rmtree(home / "race", ignore_errors=True)
        shutil.rmtree(home / ".tpurun" / "jobs", ignore_errors=True)


def test_sshd_killed_mid_train_job_finishes(cli, emulator, node):
    """Killing a worker's listening sshd leaves its open sessions alive (as OpenSSH does): the job runs to
    the end with every line; only new connections to that worker fail, clearly."""
    proc = popen(cli, "train", "ticker.py", "20", "0.1", *TRAIN)
    seen = read_until(proc, _each_core_printed(2))
    emulator.kill_sshd(emulator.node_name(node), 1)
    try:
        out, err = finish(proc, 120)
        out = "\n".join(seen) + "\n" + out
        assert proc.returncode == 0, err
        job = job_id(err)
        for w, c in CORES:
            want = [f"n {i} w{w} c{c}" for i in range(20)] + [f"done w{w} c{c}"]
            assert lines_by_core(out)[(w, c)] == want
            assert core_log(emulator, node, job, w, c) == want
        assert job_pids(emulator, node, "ticker.py") == []
        r = cli("logs", job)  # a new connection to w1 cannot be made
        assert r.code == 4 and "w1" in r.err and "Traceback" not in r.err, (r.code, r.err)
    finally:
        emulator.emu.hosts.restart_sshd(emulator.node_name(node), 1)  # the node as the other tests find it


def test_worker_killed_mid_train(own_cli, emulator):
    cli, node = own_cli, "dies"  # a node of its own: a worker goes down
    cli.env["TPURUN_PREEMPT_CHECK"] = "3"
    create(cli, node, "v4-16")
    (cli.cwd / "ticker.py").write_text(TICKER)
    proc = popen(cli, "train", "ticker.py", "600", "0.1", *TRAIN)
    seen = read_until(proc, _each_core_printed(3))
    t0 = time.monotonic()
    emulator.kill_worker(emulator.node_name(node), 1)
    out, err = finish(proc, 120)
    timing("worker killed: tpurun exits", time.monotonic() - t0)
    assert proc.returncode == 75, err  # cut short by the infrastructure
    assert "ended (lost)" in err and "lost worker w1" in err and "Traceback" not in err, err
    job = job_id(err)
    timing("worker killed: no process left", time.monotonic() - t0 + wait_no_pids(emulator, node, "ticker.py", 30))
    _assert_lines_kept(emulator, node, job, "\n".join(seen) + "\n" + out, seen)


def test_client_sigkilled_attached_job_stops(cli, emulator, node):
    proc = popen(cli, "train", "ticker.py", "600", "0.1", *TRAIN)
    seen = read_until(proc, _each_core_printed(3))
    assert job_pids(emulator, node, "ticker.py")
    t0 = time.monotonic()
    proc.kill()  # no cleanup code runs in tpurun: the dropped connections (stdin EOF) stop the agents
    out, err = finish(proc)
    cleanup = wait_no_pids(emulator, node, "ticker.py", 30)  # far below the agent's 60 s lease
    timing("client SIGKILLed (attached): no process left", time.monotonic() - t0)
    assert cleanup < 30
    _assert_lines_kept(emulator, node, job_id(err), "\n".join(seen) + "\n" + out, seen)


def test_client_sigkilled_detached_job_goes_on_and_logs_reattach(cli, emulator, node):
    r = cli("train", "ticker.py", "40", "0.1", *TRAIN, "--detach")
    assert r.code == 0, r.err
    job = r.out.strip().splitlines()[-1]
    follower = popen(cli, "logs", job, "--follow")
    read_until(follower, lambda lines: len(lines) >= 4)
    follower.kill()  # SIGKILL the attached reader
    follower.wait()
    time.sleep(0.5)
    assert job_pids(emulator, node, "ticker.py"), "a detached job must survive its client"
    r = cli("logs", job, "--follow", timeout=120)
    assert r.code == 0, r.err
    by_core = lines_by_core(r.out)
    for w, c in CORES:
        want = [f"n {i} w{w} c{c}" for i in range(40)] + [f"done w{w} c{c}"]
        assert by_core[(w, c)] == want  # every line exactly once
        assert core_log(emulator, node, job, w, c) == want
    assert job_pids(emulator, node, "ticker.py") == []


def test_preempted_mid_train_without_restarts(own_cli, emulator):
    cli = own_cli
    cli.env["TPURUN_PREEMPT_CHECK"] = "20"
    create(cli, "spot", "v4-16", "--spot")
    (cli.cwd / "ticker.py").write_text(TICKER)
    proc = popen(cli, "train", "ticker.py", "600", "0.1", *TRAIN)
    seen = read_until(proc, _each_core_printed(3))
    t0 = time.monotonic()
    emulator.preempt(emulator.node_name("spot"))
    out, err = finish(proc, 120)
    timing("preempted (no restarts): tpurun exits", time.monotonic() - t0)
    assert proc.returncode == 75, err
    assert "on spot ended (preempted)" in err and "--max-restarts" in err and "lost worker" not in err, err
    assert job_pids(emulator, "spot", "ticker.py") == []
    _assert_lines_kept(emulator, "spot", job_id(err), "\n".join(seen) + "\n" + out, seen)


def test_preempted_mid_train_with_restarts_finishes(own_cli, emulator):
    cli = own_cli
    create(cli, "spot2", "v4-16", "--spot")
    (cli.cwd / "resume.py").write_text(
        "import os, time\n"
        "w, c, n = os.environ['TPURUN_WORKER_ID'], os.environ['TPURUN_CORE'], os.environ['TPURUN_RESTART_COUNT']\n"
        "for i in range(3 if n != '0' else 600):\n"
        "    print(f'n {i} w{w} c{c} restart {n}', flush=True); time.sleep(0.1)\n"
    )
    proc = popen(cli, "train", "resume.py", *TRAIN, "--max-restarts", "1")
    seen = read_until(
        proc, lambda lines: all(any(f"[w{w}/c{c}] n 2 w{w} c{c} restart 0" == x for x in lines) for w, c in CORES)
    )
    t0 = time.monotonic()
    emulator.preempt(emulator.node_name("spot2"))
    out, err = finish(proc, 240)
    timing("preempted (--max-restarts 1): job finished after recreate", time.monotonic() - t0)
    assert proc.returncode == 0, err
    assert "restart 1/1" in err and "spot2 was preempted" in err
    by_core = lines_by_core("\n".join(seen) + "\n" + out)
    job = job_id(err.split("restart 1/1")[1])  # the relaunched attempt's job
    for w, c in CORES:
        first = [x for x in by_core[(w, c)] if x.endswith("restart 0")]
        assert first == [f"n {i} w{w} c{c} restart 0" for i in range(len(first))] and len(first) >= 3
        again = [f"n {i} w{w} c{c} restart 1" for i in range(3)]
        assert [x for x in by_core[(w, c)] if x.endswith("restart 1")] == again
        assert core_log(emulator, "spot2", job, w, c) == again
    assert job_pids(emulator, "spot2", "resume.py") == []


def test_worker_stops_answering_is_detected(cli, emulator, node):
    """A silent worker (the proxy swallows every byte, closes nothing) is given up within the keepalive
    timeout; the other workers' cores are stopped; once the network heals `cancel` cleans the silent one."""
    from tpurun.testing.latency_proxy import ProxyGroup, address_map_env, proxy_workers
    from tpurun.transport.ssh import keepalive_settings

    info = emulator.node_info(emulator.node_name(node))
    group = ProxyGroup().start()
    try:
        mapping = proxy_workers(group, [(w["address"], w["sshPort"]) for w in info["workers"]])
        cli.env["TPURUN_ADDRESS_MAP"] = address_map_env(mapping)
        proc = popen(cli, "train", "ticker.py", "600", "0.1", *TRAIN)
        seen = read_until(proc, _each_core_printed(3))
        w1_proxy = group.proxies[1]
        t0 = time.monotonic()
        w1_proxy.set_drop(True)
        out, err = finish(proc, 120)
        detected = time.monotonic() - t0
        timing("worker stops answering: tpurun exits", detected)
        interval, timeout = keepalive_settings()
        assert detected < interval + timeout + 3 + 10, detected  # stated timeout + preemption look + margin
        assert proc.returncode == 75, err
        assert "stopped answering" in err and "w1" in err and "Traceback" not in err, err
        job = job_id(err)
        wait_no_pids(emulator, node, "ticker.py", 30, workers=[0])  # the answering worker is cleaned at once
        _assert_lines_kept(emulator, node, job, "\n".join(seen) + "\n" + out, seen, cores=[(0, 0), (0, 1)])
        w1 = lines_by_core("\n".join(seen) + "\n" + out)
        for c in (0, 1):  # w1's lines up to the partition reached the client and are all in its file
            got = w1.get((1, c), [])
            assert core_log(emulator, node, job, 1, c)[: len(got)] == got
        w1_proxy.set_drop(False)
        t1 = time.monotonic()
        r = cli("cancel", job)
        assert r.code == 0, r.err
        timing("silent worker healed: cancel leaves no process", time.monotonic() - t1)
        assert job_pids(emulator, node, "ticker.py") == []
    finally:
        group.close()


def test_second_train_on_same_node_refuses(cli, emulator, node):
    first = popen(cli, "train", "ticker.py", "600", "0.1", *TRAIN)
    read_until(first, _each_core_printed(1))
    before = len(job_pids(emulator, node, "ticker.py"))
    r = cli("train", "ticker.py", "1", "0", *TRAIN)
    assert r.code == 2, (r.code, r.err)
    assert "rel is busy: job " in r.err and "runs on w0, w1; nothing was started" in r.err, r.err
    assert "cancel" in r.err and "Traceback" not in r.err
    assert len(job_pids(emulator, node, "ticker.py")) == before  # nothing new started, nothing stopped
    first.send_signal(signal.SIGINT)
    assert first.wait(timeout=60) == 130
    assert job_pids(emulator, node, "ticker.py") == []


# Each process of the job leaves a marker on its worker as its first act: which jobs' code ran where.
RACER = """\
import os, sys, time
job, w, c = os.environ["TPURUN_JOB_ID"], os.environ["TPURUN_WORKER_ID"], os.environ["TPURUN_CORE"]
os.makedirs(os.path.expanduser("~/race"), exist_ok=True)
open(os.path.expanduser(f"~/race/{job}-w{w}-c{c}"), "w").close()
time.sleep(float(sys.argv[1]))
print(f"done w{w} c{c}", flush=True)
"""


def _markers(emulator, node: str, workers: int = 2) -> dict[int, set[str]]:
    return {w: {p.name for p in (worker_home(emulator, node, w) / "race").glob("*")} for w in range(workers)}


def test_two_trains_at_once_one_runs_the_other_starts_nowhere(cli, emulator, node):
    """Two `train`s started at the same moment on one TPU: one runs, the other exits 2 with one line and
    nothing of it started on any worker, recorded here or there; `cancel` of a job that is nowhere says so (2)."""
    (cli.cwd / "racer.py").write_text(RACER)
    winners = []
    for _ in range(3):
        procs = [popen(cli, "train", "racer.py", "2", "--runtime", "cpu", "--cores", "1", "--python", "python3")]
        procs.append(popen(cli, "train", "racer.py", "2", "--runtime", "cpu", "--cores", "1", "--python", "python3"))
        ends = [finish(p, 180) for p in procs]
        codes = sorted(p.returncode for p in procs)
        assert codes == [0, 2], [(p.returncode, e) for p, (_, e) in zip(procs, ends, strict=True)]
        (_, won_err), (_, lost_err) = sorted((p.returncode, err) for p, (_, err) in zip(procs, ends, strict=True))
        winner = job_id(won_err)
        winners.append(winner)
        lines = [line for line in lost_err.splitlines() if line.strip()]
        assert len(lines) == 1 and "rel is busy: job " + winner in lines[0], lost_err
        assert "nothing was started" in lines[0] and "Traceback" not in lost_err, lost_err
        # the refused job's own id is never shown (nor recorded: below)
        assert re.findall(r"\d{8}-\d{6}-[0-9a-f]{4}", lost_err) == [winner] * lines[0].count(winner), lost_err
        for w, found in _markers(emulator, node).items():  # only the winners' code ever ran, on every worker
            assert found == {f"{j}-w{w}-c0" for j in winners}, (w, found)
    listed = json.loads(cli("jobs", "--json").out)
    assert sorted(row["job_id"] for row in listed) == sorted(winners)
    for home in (worker_home(emulator, node, w) for w in range(2)):
        assert sorted(p.name for p in (home / ".tpurun" / "jobs").iterdir() if not p.name.startswith(".")) == sorted(
            winners
        )
    assert_clean_error(cli("cancel", "20990101-000000-dead"), 2)  # an id no train made: unknown here
    # a record here of a job that is on no worker (what a refused job used to leave): cancel says so, exit 2
    record = json.loads((cli.tpurun_home / "jobs" / f"{winners[0]}.json").read_text())
    record["job_id"], record["end"] = "20990101-000000-beef", None  # (the record of a job that never ran has no end)
    (cli.tpurun_home / "jobs" / "20990101-000000-beef.json").write_text(json.dumps(record))
    r = cli("cancel", "20990101-000000-beef")
    assert_clean_error(r, 2)
    assert "job 20990101-000000-beef is on none of its workers (w0, w1)" in r.err, r.err


def test_kill_stale_ends_a_train_hold_and_that_train_starts_nothing(cli, emulator, node):
    """A `train` holds every worker from its preflight to its start (here through a 6 s setup); `kill-stale`
    ends that hold, and the train then refuses to start, in one line, with nothing of it started or recorded."""
    (cli.cwd / "racer.py").write_text(RACER)
    proc = popen(cli, "train", "racer.py", "0", "--runtime", "cpu", "--cores", "1", "--python", "python3",
                 "--setup", "sleep 6")  # fmt: skip
    deadline = time.monotonic() + 60
    while True:  # until the hold is there on every worker, as kill-stale sees it
        found = json.loads(cli("kill-stale", "--dry-run", "--json").out)
        holds = [h["holds"] for w in found["workers"] for h in w["holders"]]
        if len(holds) == 2:
            break
        assert time.monotonic() < deadline and proc.poll() is None, found
        time.sleep(0.2)
    assert all(h[0].endswith("/.tpurun/jobs/.claim") for h in holds), holds
    r = cli("kill-stale")
    assert r.code == 0, r.err
    out, err = finish(proc)
    assert proc.returncode == 2, err
    assert "stopped being held for job" in err and "nothing was started" in err and "Traceback" not in err, err
    assert _markers(emulator, node) == {0: set(), 1: set()}  # its code ran nowhere
    assert json.loads(cli("jobs", "--json").out) == []
