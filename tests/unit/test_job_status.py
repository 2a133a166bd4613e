"""How `jobs` combines the workers' states of one job (tpurun.job.status.combine)."""

from __future__ import annotations

from tpurun.job.status import JobSummary, combine
from tpurun.worker.protocol import JobState


def _st(status: str, **extra) -> JobState:
    return JobState.from_dict({"status": status, **extra})


def test_a_failure_anywhere_is_failed_naming_the_worker_chip_and_code():
    got = combine({"w0": _st("finished"), "w1": _st("failed", first_failure={"core": 2, "exit_code": 3})})
    assert got == JobSummary("failed", "w1/c2: exit code 3")
    host = combine({"s0/w0": _st("stopped"), "s1/w0": _st("failed", first_failure={"core": -1, "exit_code": 1})})
    assert host.label() == "failed (s1/w0: exit code 1)"


def test_the_first_failure_is_the_earliest_any_agent_saw_not_the_first_worker():
    """A failure on w3 brings down w0's processes a moment later (a collective with a dead peer): both workers'
    agents record a failure, and the job's first is w3's, by the time each agent saw its own."""
    states = {
        "w0": _st("failed", first_failure={"core": 0, "exit_code": 1, "time": 1000.5}),
        "w3": _st("failed", first_failure={"core": 0, "exit_code": 3, "time": 1000.1}),
    }
    assert combine(states) == JobSummary("failed", "w3/c0: exit code 3")
    # a state written before failures were timed: the first failed worker in order
    untimed = {"w0": _st("failed", first_failure={"core": 1, "exit_code": 1}), "w3": states["w3"]}
    assert combine(untimed).detail == "w3/c0: exit code 3"
    assert combine({"w0": untimed["w0"], "w1": _st("failed")}).detail == "w0/c1: exit code 1"


def test_lost_running_unknown_finished_stopped():
    assert combine({"w0": _st("running"), "w1": _st("lost")}) == JobSummary("lost", "w1: its supervisor is gone")
    assert combine({"w0": _st("running"), "w1": _st("finished")}) == JobSummary("running")
    assert combine({"w0": _st("running"), "w1": None}) == JobSummary("running", "not on w1")
    assert combine({"w0": _st("finished"), "w1": None}) == JobSummary("unknown", "no trace on w1")
    assert combine({"w0": _st("finished"), "w1": _st("finished")}) == JobSummary("finished")
    assert combine({"w0": _st("finished"), "w1": _st("stopped")}) == JobSummary("stopped")


def test_logs_exit_code_is_the_library_s_as_train_gives_each_end():
    """`logs`' exit code, decided by the library (control.LogsResult): stopped 130; a worker without the job 2,
    one unreadable 4; followed to its end, the code train gives that end."""
    from tpurun.errors import ExitCode
    from tpurun.job.control import LogsResult
    from tpurun.job.status import JobSummary

    assert LogsResult().exit_code == ExitCode.OK  # replayed, not followed
    assert LogsResult(interrupted=True, errors={"w1": "gone"}).exit_code == ExitCode.INTERRUPTED
    assert LogsResult(errors={"w1": "no such job"}, missing=True).exit_code == ExitCode.USAGE
    assert LogsResult(errors={"w1": "unreachable"}).exit_code == ExitCode.UNREACHABLE
    ends = {"finished": 0, "failed": 1, "lost": 4, "stopped": 130}
    for status, code in ends.items():
        assert LogsResult(ended=JobSummary(status)).exit_code == code, status
