"""How a job's one end is judged (tpurun.job.ends.judge) from every worker's state (tpurun.job.status.combine) and
from what `train` saw, and the exit code each end gives `train` and `logs`."""

from __future__ import annotations

import pytest

from tpurun.errors import ExitCode
from tpurun.job.control import LogsResult
from tpurun.job.ends import End, Facts, judge
from tpurun.job.status import JobSummary, combine
from tpurun.worker.protocol import JobState, Notice, NoticeKind


def _st(status: str, **extra) -> JobState:
    return JobState.from_dict({"status": status, **extra})


def _notice(action: str, kind: NoticeKind = NoticeKind.MAINTENANCE) -> dict:
    return Notice(kind, 1, 100.0, 160.0, action, "instance/maintenance-event: MIGRATE_ON_HOST_MAINTENANCE").to_dict()


def test_a_failure_anywhere_is_failed_naming_the_worker_chip_and_code():
    got = combine({"w0": _st("finished"), "w1": _st("failed", first_failure={"core": 2, "exit_code": 3})})
    assert got == JobSummary(End.FAILED, detail="w1/c2: exit code 3")
    host = combine({"s0/w0": _st("stopped"), "s1/w0": _st("failed", first_failure={"core": -1, "exit_code": 1})})
    assert host.label() == "failed (s1/w0: exit code 1)"


def test_the_first_failure_is_the_earliest_any_agent_saw_not_the_first_worker():
    """A failure on w3 brings down w0's processes a moment later (a collective with a dead peer): both workers'
    agents record a failure, and the job's first is w3's, by the time each agent saw its own."""
    states = {
        "w0": _st("failed", first_failure={"core": 0, "exit_code": 1, "time": 1000.5}),
        "w3": _st("failed", first_failure={"core": 0, "exit_code": 3, "time": 1000.1}),
    }
    assert combine(states) == JobSummary(End.FAILED, detail="w3/c0: exit code 3")
    # a state written before failures were timed: the first failed worker in order
    untimed = {"w0": _st("failed", first_failure={"core": 1, "exit_code": 1}), "w3": states["w3"]}
    assert combine(untimed).detail == "w3/c0: exit code 3"
    assert combine({"w0": untimed["w0"], "w1": _st("failed")}).detail == "w0/c1: exit code 1"


def test_lost_running_unknown_finished_stopped():
    lost = combine({"w0": _st("stopped"), "w1": _st("lost")})
    assert (lost.status, lost.detail) == ("lost", "supervisor gone on w1")
    # a part lost ends the job (its other parts cannot finish), though w0's processes run on: said beside
    on = combine({"w0": _st("running"), "w1": _st("lost")})
    assert (on.status, on.running, on.detail) == ("lost", True, "supervisor gone on w1; still running on w0")
    assert combine({"w0": _st("running"), "w1": _st("finished")}) == JobSummary(running=True)
    assert combine({"w0": _st("running"), "w1": None}) == JobSummary(running=True, detail="not on w1")
    assert combine({"w0": _st("finished"), "w1": None}) == JobSummary(detail="no trace on w1")
    assert combine({"w0": _st("finished"), "w1": None}).status == "unknown"
    assert combine({"w0": _st("finished"), "w1": _st("finished")}) == JobSummary(End.FINISHED)
    assert combine({"w0": _st("finished"), "w1": _st("stopped")}) == JobSummary(End.STOPPED)
    # `train --budget`: each worker's supervisor stopped its part (one may have ended before, or been cancelled)
    assert combine({"w0": _st("spent"), "w1": _st("spent")}) == JobSummary(End.BUDGET)
    assert combine({"w0": _st("finished"), "w1": _st("spent")}) == JobSummary(End.BUDGET)
    assert combine({"w0": _st("spent"), "w1": _st("running")}) == JobSummary(running=True)


@pytest.mark.parametrize("action", ["signal:SIGUSR1", "file", "stop"])
def test_a_job_a_notice_cut_short_is_never_a_program_failure_whatever_its_action(action):
    """The issue's case: a script told of maintenance saves and exits 3 (or is stopped, or its host goes down and
    its supervisor with it): the job's end is the notice's, on every worker's account."""
    n = _notice(action)
    failed = _st("failed", first_failure={"core": 0, "exit_code": 3}, notice=n)
    assert combine({"w0": failed, "w1": _st("stopped", notice=n)}).status == "maintenance"
    assert combine({"w0": _st("stopped", notice=n), "w1": _st("stopped", notice=n)}).status == "maintenance"
    assert combine({"w0": _st("lost", notice=n), "w1": _st("lost", notice=n)}).status == "maintenance"
    pre = _notice(action, NoticeKind.PREEMPTED)
    assert combine({"w0": _st("failed", notice=pre), "w1": _st("lost")}).status == "preempted"


def test_after_a_notice_a_job_that_finished_by_itself_finished_unless_tpurun_signalled_or_stopped_it():
    done = {"w0": _st("finished", notice=_notice("file")), "w1": _st("finished")}
    assert combine(done).status == "finished"
    signalled = {"w0": _st("finished", notice=_notice("signal:SIGTERM")), "w1": _st("finished")}
    assert combine(signalled).status == "maintenance"  # a JAX job saved at the agreed step and exited 0


def test_judge_the_order_of_the_facts():
    n = Notice(NoticeKind.MAINTENANCE, 0, 1.0, 2.0, "stop", "")
    assert judge(Facts(user=True, notice=n, failed=True)) is End.STOPPED  # Ctrl-C is the user's, always
    assert judge(Facts(notice=n, failed=True, lost=End.LOST)) is End.MAINTENANCE
    assert judge(Facts(hung=True, failed=True)) is End.HUNG
    assert judge(Facts(spent=True, notice=n, hung=True)) is End.BUDGET  # its own stop made the rest
    assert judge(Facts(user=True, spent=True)) is End.STOPPED
    assert judge(Facts(failed=True, lost=End.PREEMPTED)) is End.PREEMPTED  # the failure its loss caused
    assert judge(Facts(failed=True, lost=End.LOST)) is End.FAILED  # a failure first, then a worker went
    assert judge(Facts(lost=End.LOST)) is End.LOST
    assert judge(Facts(all_zero=True)) is End.FINISHED


def test_each_end_s_exit_code_one_table_for_train_and_logs():
    codes = {
        End.FINISHED: 0, End.FAILED: 1, End.HUNG: 124, End.BUDGET: 125, End.STOPPED: 130,
        End.PREEMPTED: 75, End.MAINTENANCE: 75, End.LOST: 75,
    }  # fmt: skip
    for end, code in codes.items():
        assert end.exit_code == code
        assert LogsResult(ended=JobSummary(end)).exit_code == code, end
    assert {e.cause for e in End} == {"", "program", "preempted", "maintenance", "infra"}
    assert End.read("program") is End.FAILED and End.read("infra") is End.LOST and End.read("") is None


def test_logs_exit_code_is_the_library_s():
    """`logs`' exit code, decided by the library (control.LogsResult): stopped 130; a worker without the job 2,
    one unreadable 4 (the others' lines shown); a job still running, or not followed, 0."""
    assert LogsResult().exit_code == ExitCode.OK  # replayed, not followed
    assert LogsResult(ended=JobSummary(running=True)).exit_code == ExitCode.OK
    assert LogsResult(interrupted=True, errors={"w1": "gone"}).exit_code == ExitCode.INTERRUPTED
    assert LogsResult(errors={"w1": "no such job"}, missing=True).exit_code == ExitCode.USAGE
    assert LogsResult(errors={"w1": "unreachable"}).exit_code == ExitCode.UNREACHABLE
