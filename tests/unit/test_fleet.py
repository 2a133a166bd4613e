"""The Fleet's operations on this machine's workers (LocalRunners): each answer and record names its worker,
bundle programs are installed where missing, the connect window holds."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from tpurun.errors import UnreachableError, UsageError
from tpurun.fleet.interface import Call, connect_all, connect_window
from tpurun.fleet.threads import Threads
from tpurun.transport.local import LocalRunner
from tpurun.transport.runner import Runner, Worker
from tpurun.worker import protocol


class Pod:
    """N workers that are this machine (what `Threads` stands on)."""

    def __init__(self, n: int) -> None:
        self.runners: list[Runner] = [LocalRunner(Worker(i, "127.0.0.1")) for i in range(n)]
        self.connected = False

    def connect(self, then=None) -> dict[int, str]:
        self.connected = True
        return connect_all(self.runners, then)


def test_run_gives_each_worker_its_own_variables_and_fail_fast_stops_the_rest():
    fleet = Threads(Pod(3))
    lines: list[tuple[int, str]] = []
    stop = threading.Event()
    argv = ["sh", "-c", 'echo "me=$ME"']
    res = fleet.run(argv, lambda w, _s, line: lines.append((w, line)), stop=stop, env=lambda w: {"ME": str(w.index)})
    assert sorted(lines) == [(0, "me=0"), (1, "me=1"), (2, "me=2")]
    assert [(r.worker, r.exit_code) for r in res] == [(0, 0), (1, 0), (2, 0)]
    argv = ["sh", "-c", '[ "$ME" = 1 ] && exit 3; sleep 30']
    t0 = time.monotonic()
    res = fleet.run(argv, lambda *_: None, stop=stop, fail_fast=True, grace=1, env=lambda w: {"ME": str(w.index)})
    assert time.monotonic() - t0 < 20 and stop.is_set()
    by = {r.worker: r for r in res}  # (a worker not started before w1 failed is not started at all: fail-fast)
    assert by[1].exit_code == 3 and all(r.stopped for w, r in by.items() if w != 1), res


def test_call_answers_per_worker_with_its_own_input():
    fleet = Threads(Pod(3))
    answers = fleet.call(
        lambda w: Call.command(["sh", "-c", "cat; exit $1", "x", str(w.index)], f"in{w.index}".encode())
    )
    assert {w: (a.worker, a.rc, a.out) for w, a in answers.items()} == {
        0: (0, 0, b"in0"),
        1: (1, 1, b"in1"),
        2: (2, 2, b"in2"),
    }
    assert answers[2].why() == "exit 2" and answers[0].sent <= answers[0].answered
    # a program that cannot start is an answer with its reason, not an exception
    (missing,) = fleet.call(Call.command(["/nonexistent/python"]), only=[1]).values()
    assert missing.worker == 1 and missing.rc is None and "cannot start /nonexistent/python" in missing.error


def test_a_bundle_program_is_installed_where_missing_then_run(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # a worker new to tpurun: no bundle under ~/.tpurun
    fleet = Threads(Pod(1))
    (a,) = fleet.call(Call.program_of(sys.executable, "agent.py", "jobs")).values()
    assert a.rc == 0, a.err
    assert a.out.decode().strip() == "[]"
    assert list((tmp_path / ".tpurun" / "bin").iterdir())


def test_open_holds_until_released_and_answer_reads_each_first_line():
    fleet = Threads(Pod(2))
    sessions = fleet.open(Call.command(["sh", "-c", 'read x; echo "said $x"; read y; echo "end $y" >&2']))
    assert all(not isinstance(s, str) for s in sessions.values())
    live = {w: s for w, s in sessions.items() if not isinstance(s, str)}
    got = fleet.answer(live, b"yes\n", 10)
    assert got == {0: "said yes", 1: "said yes"}
    assert all(s.alive() for s in live.values())
    for s in live.values():
        s.release()
    deadline = time.monotonic() + 10
    for s in live.values():
        s.wait_end(deadline)
    assert [s.alive() for s in live.values()] == [False, False]


def _records(worker: int) -> str:
    line = protocol.encode(protocol.Line(worker, 0, 7, protocol.Source.OUT, 1.0, f"hello from {worker}"))
    done = protocol.encode(protocol.Done(worker, protocol.JobState("j", worker, protocol.JobStatus.FINISHED)))
    return (line + b"\n" + done + b"\n").decode()


def test_follow_hands_over_records_naming_the_worker_they_came_from():
    fleet = Threads(Pod(2))
    taken: list[tuple[int, int, str]] = []
    ends: dict[int, tuple[int, bool]] = {}
    lock = threading.Lock()

    def take(source: int, recs) -> None:
        with lock:
            taken.extend((source, r.worker, type(r).__name__) for r in recs)

    def ended(w: int, rc: int, _err: str, done: bool) -> bool:
        ends[w] = (rc, done)
        return False

    fleet.follow(lambda w: Call.command(["printf", "%s", _records(w.index)]), take, ended, lambda w, why: None)
    assert sorted(taken) == [(0, 0, "Done"), (0, 0, "Line"), (1, 1, "Done"), (1, 1, "Line")]
    assert ends == {0: (0, True), 1: (0, True)}


def test_converse_speaks_to_each_workers_helper_over_its_pipe():
    fleet = Threads(Pod(3))
    heard: dict[int, bytes] = {}

    def talk(worker: Worker, opened) -> None:
        pipe = opened()
        pipe.send(f"to {worker.index}\n".encode())
        pipe.close_write()
        heard[worker.index] = pipe.recv(100)

    fleet.connect(helper=lambda _python: ["cat"])  # a helper started early on every worker, worker 1's too
    fleet.converse(lambda _python: ["cat"], talk, stop=threading.Event(), only=[0, 2])
    assert heard == {0: b"to 0\n", 2: b"to 2\n"}
    assert _children("cat") == []  # the helper of worker 1, which the conversation did not take, is closed too


def _children(name: str) -> list[int]:
    """This process's live children called NAME."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        comm, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if comm == name and fields[0] not in ("Z", "X") and int(fields[1]) == os.getpid():
            found.append(int(pid))
    return found


def test_chorus_says_once_to_many_and_hears_each_and_its_end():
    fleet = Threads(Pod(3))
    # each helper answers what it was told, and ends after 4 bytes with a word on stderr
    chorus = fleet.chorus(
        lambda _python: ["sh", "-c", 'head -c 4; echo "bye" >&2; exit 3'], only=[0, 2], stop=threading.Event()
    )
    assert chorus.workers == [0, 2] and chorus.failed == {}
    chorus.say([0, 2], b"ab")
    chorus.say([2], b"cd")
    chorus.say([0], b"xy")
    heard: dict[int, bytes] = {0: b"", 2: b""}
    deadline = time.monotonic() + 10
    while chorus.ended(0) is None or chorus.ended(2) is None:
        assert time.monotonic() < deadline
        for w, data in chorus.heard(0.1).items():
            heard[w] += data
    assert heard == {0: b"abxy", 2: b"abcd"}
    assert chorus.ended(0) == chorus.ended(2) == (3, b"bye\n")
    chorus.say([0, 2], b"to no one")  # they ended: nothing waits
    chorus.close()
    failed = Threads(Pod(2)).chorus(lambda _python: ["/nonexistent/helper"], only=[1], stop=threading.Event())
    assert failed.workers == [] and "cannot start /nonexistent/helper" in failed.failed[1]


def test_chorus_holds_a_bounded_outbox_for_a_worker_that_does_not_read_and_stop_ends_the_wait(tmp_path):
    fleet = Threads(Pod(1))
    stop = threading.Event()
    go = tmp_path / "go"  # the helper reads nothing until then
    helper = ["sh", "-c", f'while [ ! -e "{go}" ]; do sleep 0.05; done; exec cat >/dev/null']
    chorus = fleet.chorus(lambda _python: helper, only=[0], stop=stop)
    said: list[int] = []

    def say() -> None:
        for i in range(100):  # 100 MB to a helper that reads nothing
            chorus.say([0], b"x" * (1 << 20))
            said.append(i)

    t = threading.Thread(target=say, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while len(said) < 8:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t.join(0.5)  # (what it said in the meantime, were nothing bounded: hundreds of MB)
    assert t.is_alive() and len(said) < 12, "what waits for one worker is bounded"
    stop.set()
    t.join(10)
    assert not t.is_alive()
    go.touch()
    chorus.close()


class _Slow(Runner):
    """A worker whose connect takes a while and notes how many connects were in flight at once."""

    inflight = 0
    most = 0
    lock = threading.Lock()

    def __init__(self, index: int) -> None:
        self.worker = Worker(index, "127.0.0.1")

    def connect(self) -> None:
        with _Slow.lock:
            _Slow.inflight += 1
            _Slow.most = max(_Slow.most, _Slow.inflight)
        time.sleep(0.05)
        with _Slow.lock:
            _Slow.inflight -= 1
        if self.worker.index == 5:
            raise UnreachableError("w5 is gone")


def test_connect_all_keeps_to_the_window_and_names_who_failed(monkeypatch):
    monkeypatch.setenv("TPURUN_CONNECT_WINDOW", "4")
    assert connect_window() == 4
    started: list[int] = []
    errors = connect_all([_Slow(i) for i in range(20)], lambda r: started.append(r.worker.index))
    assert errors == {5: "w5 is gone"}
    assert sorted(started) == [i for i in range(20) if i != 5]
    assert 1 < _Slow.most <= 4
    for bad in ("0", "x"):
        monkeypatch.setenv("TPURUN_CONNECT_WINDOW", bad)
        with pytest.raises(UsageError):
            connect_window()


class _Dropped(LocalRunner):
    """A worker whose stream drops and which then refuses every new connection."""

    def __init__(self) -> None:
        super().__init__(Worker(0, "127.0.0.1"))
        self.tries = 0

    def stream(self, argv):
        raise UnreachableError("worker 0: the connection dropped")

    def connect(self) -> None:
        self.tries += 1
        raise UnreachableError("worker 0: connection refused")


def test_follow_counts_a_failed_reconnect_as_a_drop_and_gives_the_worker_up_after_its_reconnects():
    pod = Pod(1)
    pod.runners = [runner := _Dropped()]
    lost: list[tuple[int, str]] = []
    call = lambda w: Call.command(["true"])  # noqa: E731
    Threads(pod).follow(call, lambda *_: None, lambda *_: False, lambda w, why: lost.append((w, why)), reconnects=2)
    assert lost == [(0, "worker 0: connection refused")] and runner.tries == 2


def test_an_ssh_runner_not_connected_is_unreachable_not_a_bug(tmp_path):
    from tpurun.transport.ssh import SshRunner

    runner = SshRunner(Worker(0, "127.0.0.1"), key_path=tmp_path / "key", known_hosts=tmp_path / "known_hosts")
    for use in (lambda: runner.stream(["true"]), lambda: runner.pipe(["cat"])):
        with pytest.raises(UnreachableError, match="not connected to worker"):
            use()
