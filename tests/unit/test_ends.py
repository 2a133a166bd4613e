"""Why a job ended and what it may cost (job.ends), the notice on the wire (protocol.Notice), and a worker's
notice watch (worker/agent_notices): what the metadata server says, and peers that pass a signed notice on."""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from tpurun.emulator._metadata import MetadataService
from tpurun.emulator.tpu_vm import HOST_EVENTS
from tpurun.errors import UsageError
from tpurun.fleet.targets import Target
from tpurun.job.attempt import JobRun
from tpurun.job.ends import Budgets, End, on_notice
from tpurun.job.env_contract import SlotSpec
from tpurun.transport.runner import Worker
from tpurun.worker import agent_notices, metaserver, protocol
from tpurun.worker.protocol import JobState, JobStatus, Launch, Notice, NoticeKind
from tpurun.worker.protocol_calls import JobSpec


def test_budgets_by_kind_and_max_restarts_for_preemption_and_infra_together():
    b = Budgets.parse("program=1,maintenance=2", max_restarts=2)
    assert [b.spend(End.FAILED), b.spend(End.FAILED)] == [True, False]
    assert [b.spend(End.MAINTENANCE) for _ in range(3)] == [True, True, False]
    # --max-restarts 2: preemption and infrastructure draw on one budget
    assert [b.spend(End.PREEMPTED), b.spend(End.LOST), b.spend(End.PREEMPTED)] == [True, True, False]
    assert b.left(End.LOST) == "2/2" and b.left(End.FAILED) == "1/1"
    assert not b.spend(End.STOPPED) and not b.spend(End.FINISHED)
    assert b.spend(End.MAINTENANCE) is False and b.left(End.HUNG) == "1/1"  # a hang draws on the program's
    # a kind named on its own leaves the shared budget to the other
    b = Budgets.parse("preempted=1", max_restarts=1)
    assert [b.spend(End.PREEMPTED), b.spend(End.PREEMPTED)] == [True, False]
    assert b.spend(End.LOST) and not b.spend(End.LOST)
    assert Budgets.parse("", 0).to_dict()["maintenance"] == {"used": 0, "budget": 0}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("crash=1", "unknown kind 'crash'"),
        ("program=-1", "cannot be negative"),
        ("program", "expected KIND=N"),
        ("user=2", "unknown kind 'user'"),
    ],
)
def test_bad_restarts_are_one_clear_line(text, says):
    with pytest.raises(UsageError, match=says):
        Budgets.parse(text)


def test_on_notice_choices_and_the_runtimes_default():
    assert on_notice(None, "jax") == "signal:SIGTERM"
    assert on_notice(None, "torch") == "file"
    assert on_notice("signal:usr1", "torch") == "signal:SIGUSR1"
    assert on_notice("stop", "jax") == "stop"
    for bad, says in (("signal:SIGNOPE", "unknown signal"), ("signal:KILL", "unknown signal"), ("wave", "bad")):
        with pytest.raises(UsageError, match=says):
            on_notice(bad, "torch")


def test_a_notice_travels_in_a_record_and_in_the_jobs_state():
    n = Notice(NoticeKind.MAINTENANCE, 1, 100.5, 160.0, "signal:SIGTERM", "instance/upcoming-maintenance: {}")
    assert protocol.decode(protocol.encode(n)) == n
    st = JobState("j", 0, JobStatus.RUNNING, notice=n)
    again = JobState.from_json(st.to_json())
    assert again.notice == n
    assert "notice" not in json.loads(JobState("j", 0, JobStatus.RUNNING).to_json())


def _metadata(values: dict[str, str]):
    return lambda path: values.get(path)


def test_what_the_metadata_server_announces():
    quiet = {
        "instance/preempted": "FALSE",
        "instance/maintenance-event": "NONE",
        "instance/upcoming-maintenance": json.dumps({"error": "no notifications have been received yet"}),
    }
    assert agent_notices.look(0, "file", _metadata(quiet)) is None
    soon = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
    window = {"maintenance_status": "PENDING", "type": "SCHEDULED", "window_start_time": soon}
    n = agent_notices.look(2, "file", _metadata(quiet | {"instance/upcoming-maintenance": json.dumps(window)}))
    assert n is not None and n.kind is NoticeKind.MAINTENANCE and n.worker == 2
    assert n.deadline == pytest.approx(time.time() + 120, abs=2)
    # a window days ahead is the job's only in its last minutes (LEAD)
    window["window_start_time"] = "2030-01-01T00:00:00Z"
    assert (
        agent_notices.look(2, "file", _metadata(quiet | {"instance/upcoming-maintenance": json.dumps(window)})) is None
    )
    n = agent_notices.look(0, "stop", _metadata(quiet | {"instance/preempted": "TRUE"}))
    assert n is not None and n.kind is NoticeKind.PREEMPTED and n.action == "stop"
    assert n.deadline is None  # the metadata says TRUE and nothing of when: no deadline is made up
    n = agent_notices.look(
        0, "file", _metadata(quiet | {"instance/maintenance-event": "TERMINATE_ON_HOST_MAINTENANCE"})
    )
    assert n is not None and n.kind is NoticeKind.MAINTENANCE
    assert agent_notices.look(0, "file", _metadata({})) is None  # no metadata server: nothing announced


class _Host:
    """One VM's host events, as the emulator's metadata server serves them (a MetadataSource)."""

    def __init__(self) -> None:
        self.events = dict(HOST_EVENTS)

    def tree(self) -> dict:
        return {"instance": dict(self.events)}


@pytest.fixture
def metadata_server(monkeypatch):
    """The emulator's metadata server on a free port of 127.0.0.1, serving a _Host, found by the watch through
    GCE_METADATA_HOST; each exchange a watch makes with it counted."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    service, host, exchanges = MetadataService(port), _Host(), []
    service.add("127.0.0.1", host)  # type: ignore[arg-type]
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{port}")
    exchange = metaserver._exchange
    monkeypatch.setattr(metaserver, "_exchange", lambda *a: exchanges.append(a[1]) or exchange(*a))
    yield service, host, exchanges
    service.close()


def _watch(spec_worker: int = 0):
    told: queue.Queue = queue.Queue()
    spec = SimpleNamespace(
        job_id="j", worker=spec_worker, on_notice="file", notice_address=None, peers=[], notice_port=0, notice_key=""
    )
    watch = agent_notices.NoticeWatch(spec, told.put)
    watch.start(print)
    return watch, told


def test_the_watch_waits_on_the_metadata_server_for_a_change_rather_than_asking_again(metadata_server):
    """One GET per value, then one more held by the metadata server while nothing changes (a watch that asked
    every second would have made twelve in the 4.5 s); a preemption is then told as soon as it is announced."""
    service, host, exchanges = metadata_server
    watch, told = _watch()
    try:
        time.sleep(4.5)  # the quiet the count is about
        assert told.empty() and len(exchanges) <= 6, exchanges
        host.events["preempted"] = "TRUE"
        service.touch()
        notice = told.get(timeout=10)
        assert notice.kind is NoticeKind.PREEMPTED and notice.detail == "instance/preempted: TRUE"
    finally:
        watch.stop()


def test_a_window_announced_beyond_the_lead_is_told_once_the_lead_begins_with_nothing_changed(metadata_server):
    """The GET for upcoming-maintenance is held no longer than until NOTICE_LEAD before the window: the
    window is told then, though the metadata server's value never changed."""
    service, host, _ = metadata_server
    start = time.time() + protocol.NOTICE_LEAD + 2
    window = {"maintenance_status": "PENDING", "type": "SCHEDULED"}
    host.events["upcoming-maintenance"] = json.dumps(
        window | {"window_start_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start))}
    )
    watch, told = _watch(3)
    try:
        assert told.empty()
        notice = told.get(timeout=15)
        assert notice.kind is NoticeKind.MAINTENANCE and notice.worker == 3
        assert time.time() >= start - protocol.NOTICE_LEAD - 1
    finally:
        watch.stop()


def test_how_long_the_others_may_run_once_a_process_ended_after_a_notice():
    """Until the host may go (a window's start; a preemption's 30 s from when it was seen), a minute at most; a
    notice to stop, or none, stops them at once."""
    t = 1_000_000.0
    maintenance = Notice(NoticeKind.MAINTENANCE, 1, t, t + 20, "file")
    assert agent_notices.settle_by(maintenance, t + 5) == t + 20
    assert agent_notices.settle_by(maintenance, t + 25) == t + 25  # past the window's start: stopped now
    window = Notice(NoticeKind.MAINTENANCE, 1, t, t + 600, "signal:SIGTERM")  # told 10 minutes ahead
    assert agent_notices.settle_by(window, t + 5) == t + 5 + agent_notices.SETTLE
    preempted = Notice(NoticeKind.PREEMPTED, 0, t, None, "file")
    assert agent_notices.settle_by(preempted, t + 2) == t + agent_notices.PREEMPTION_NOTICE
    assert agent_notices.settle_by(Notice(NoticeKind.PREEMPTED, 0, t, None, "stop"), t + 2) is None
    assert agent_notices.settle_by(None, t) is None


class _Said:
    """An Output that keeps what the job run says (the calls this test makes it take)."""

    def __init__(self) -> None:
        self.said: list[str] = []

    def info(self, text: str) -> None:
        self.said.append(text)

    def notice(self, notice: Notice, worker: str) -> None:
        self.said.append(f"notice for {worker}")

    def starting(self, started: int, workers: int) -> None:
        pass

    def waiting(self, waiting) -> None:
        pass


def test_the_client_counts_the_time_after_a_notice_on_the_workers_clock_not_its_own():
    """A worker's clock an hour ahead of this machine's: its notice gives the host 20 s. When a process fails
    after it, the others are left those 20 s (counted from the notice's arrival here), not stopped at once;
    a notice to stop stops them at once."""
    workers = [Worker(i, f"127.0.0.{71 + i}") for i in range(2)]
    specs = [[SlotSpec(i, 0, 0, i, {}, ["true"])] for i in range(2)]
    for action, stops in (("file", False), ("stop", True)):
        out = _Said()
        run = JobRun(Target("t", None, [], workers, False), "j", specs, out, cwd="/", python="python3",  # type: ignore[arg-type]
                     detach=False, grace=1, pre=lambda w: [], launch=Launch.host, on_notice=action)  # fmt: skip
        ahead = time.time() + 3600
        run._take(1, [Notice(NoticeKind.MAINTENANCE, 1, ahead, ahead + 20, action, "window")])
        run._take(1, [protocol.Exit(1, 0, 75, protocol.ProcessStatus.EXITED)])
        assert run.stop.is_set() is stops, out.said
        if not stops:
            assert run.settle_at is not None and 17 < run.settle_at - time.monotonic() <= 20, out.said
            assert "w1/c0 ended after the notice (exit code 75): the others may end on their own within 20 s" in out.said[-1]
            run.settle_at = time.monotonic()  # the time is up: the next tick stops the job everywhere
            run._tick(None)
            assert run.stop.is_set() and "the notice's time to end is up" in out.said[-1]


def _watch_spec(job: str, worker: int, addresses: list[str], key: str) -> JobSpec:
    """WORKER's spec as the client makes it (`JobRun.job_spec`: worker 0 tells every other, the others worker 0),
    signed with KEY and listening on a port of its own."""
    workers = [Worker(i, a) for i, a in enumerate(addresses)]
    specs = [[SlotSpec(i, 0, 0, i, {}, ["true"])] for i in range(len(workers))]
    run = JobRun(Target("t", None, [], workers, False), job, specs, None, cwd="/", python="python3",  # type: ignore[arg-type]
                 detach=True, grace=1, pre=lambda w: [], launch=Launch.host, on_notice="file")  # fmt: skip
    run.notice_key, run.notice_port = key, 31999
    return run.job_spec(worker)


def test_a_job_on_one_worker_of_the_pod_tells_no_other_worker():
    """`train --worker 1` on a three-host pod: worker 1 runs the job alone, so its notices stay there (the pod's
    worker 0 runs no supervisor of this job to tell)."""
    workers = [Worker(i, f"127.0.0.{71 + i}") for i in range(3)]
    specs: list[list[SlotSpec]] = [[], [SlotSpec(1, 0, 0, 0, {}, ["true"])], []]
    run = JobRun(Target("t", None, [], workers, False), "alone", specs, None, cwd="/", python="python3",  # type: ignore[arg-type]
                 detach=True, grace=1, pre=lambda w: [], launch=Launch.host, on_notice="file")  # fmt: skip
    spec = run.job_spec(1)
    assert (spec.peers, spec.notice_address) == ([], "")


def test_a_notice_goes_through_worker_0_to_every_worker_signed_with_the_jobs_key_and_only_that():
    """Three workers' watches on 127.0.0.x: worker 2 tells worker 0, which tells every other; a notice signed
    with another key, or for another job, is taken nowhere."""
    addresses = ["127.0.0.71", "127.0.0.72", "127.0.0.73"]
    key = "ab" * 32
    got: dict[int, list[Notice]] = {i: [] for i in range(3)}
    watches = []
    for i in range(3):
        w = agent_notices.NoticeWatch(_watch_spec("job1", i, addresses, key), got[i].append)
        w.start(lambda m: None)
        watches.append(w)
    try:
        forged = agent_notices.NoticeWatch(_watch_spec("job1", 2, addresses, "cd" * 32), lambda n: None)
        forged.tell_peers(Notice(NoticeKind.PREEMPTED, 2, time.time(), None, "file"))
        other = agent_notices.NoticeWatch(_watch_spec("job2", 2, addresses, key), lambda n: None)
        other.tell_peers(Notice(NoticeKind.PREEMPTED, 2, time.time(), None, "file"))
        time.sleep(0.3)
        assert got == {0: [], 1: [], 2: []}
        n = Notice(NoticeKind.MAINTENANCE, 2, time.time(), None, "file", "from w2")
        watches[2].tell_peers(n)
        deadline = time.time() + 5
        while not all(got.values()) and time.time() < deadline:
            time.sleep(0.05)
        assert got == {0: [n], 1: [n], 2: [n]}  # each once: worker 2 too, told by worker 0
    finally:
        for w in watches:
            w.stop()


def test_a_supervisor_that_ends_right_after_a_notice_has_passed_it_on():
    """Worker 1's watch takes a notice and its supervisor ends at once (its processes exited on the notice): worker
    0 is told all the same. The telling runs on a daemon thread, which the process's exit would cut short."""
    with socket.socket() as s:
        s.bind(("127.0.0.91", 0))
        port = s.getsockname()[1]
    key = "12" * 32
    spec = dict(job_id="jx", on_notice="file", notice_port=port, notice_key=key)
    got: list[Notice] = []
    hub = agent_notices.NoticeWatch(SimpleNamespace(worker=0, notice_address="127.0.0.91", peers=[], **spec), got.append)
    hub.start(lambda m: None)
    ending = f"""
import time
from types import SimpleNamespace
from tpurun.worker import agent_notices
from tpurun.worker.protocol import Notice, NoticeKind
spec = SimpleNamespace(worker=1, notice_address="", peers=["127.0.0.91"], **{spec!r})
watch = agent_notices.NoticeWatch(spec, lambda n: None)
watch._take(Notice(NoticeKind.MAINTENANCE, 1, time.time(), None, "file", "seen on w1"))
watch.stop()  # the supervisor's finish: then the process exits
"""
    try:
        subprocess.run([sys.executable, "-c", ending], check=True, timeout=30)
        deadline = time.time() + 5
        while not got and time.time() < deadline:
            time.sleep(0.02)
        assert [n.detail for n in got] == ["seen on w1"]
    finally:
        hub.stop()


def test_deliver_signals_every_process_group_of_the_job(tmp_path):
    """signal:SIGUSR1 reaches a process and the child it started (one group); `file` writes the notice."""
    script = "import signal, subprocess, sys, time\n" + (
        "signal.signal(signal.SIGUSR1, lambda s, f: (open(sys.argv[1], 'a').write('got\\n'), sys.exit(0)))\n"
        "time.sleep(30)\n"
    )
    marks = [tmp_path / "a", tmp_path / "b"]
    procs = [subprocess.Popen([sys.executable, "-c", script, str(m)], start_new_session=True) for m in marks]
    time.sleep(0.5)
    n = Notice(NoticeKind.PREEMPTED, 3, time.time(), None, "signal:SIGUSR1")
    did = agent_notices.deliver(n, "nojob", [p.pid for p in procs], str(tmp_path))
    assert "SIGUSR1" in did
    assert [p.wait(timeout=10) for p in procs] == [0, 0]
    assert [m.read_text() for m in marks] == ["got\n", "got\n"]
    n = Notice(NoticeKind.MAINTENANCE, 3, time.time(), 5.0, "file")
    agent_notices.deliver(n, "nojob", [], str(tmp_path))
    assert Notice.from_dict(json.loads((tmp_path / "notice.json").read_text())) == n
