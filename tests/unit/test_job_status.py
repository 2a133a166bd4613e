"""How `jobs` combines the workers' states of one job (tpurun.job.status.combine)."""

from __future__ import annotations

from tpurun.job.status import JobSummary, combine


def _st(status: str, **extra) -> dict:
    return {"status": status, **extra}


def test_a_failure_anywhere_is_failed_naming_the_worker_chip_and_code():
    got = combine({"w0": _st("finished"), "w1": _st("failed", first_failure={"core": 2, "exit_code": 3})})
    assert got == JobSummary("failed", "w1/c2: exit code 3")
    host = combine({"s0/w0": _st("stopped"), "s1/w0": _st("failed", first_failure={"core": -1, "exit_code": 1})})
    assert host.label() == "failed (s1/w0: exit code 1)"


def test_lost_running_unknown_finished_stopped():
    assert combine({"w0": _st("running"), "w1": _st("lost")}) == JobSummary("lost", "w1: its supervisor is gone")
    assert combine({"w0": _st("running"), "w1": _st("finished")}) == JobSummary("running")
    assert combine({"w0": _st("running"), "w1": None}) == JobSummary("running", "not on w1")
    assert combine({"w0": _st("finished"), "w1": None}) == JobSummary("unknown", "no trace on w1")
    assert combine({"w0": _st("finished"), "w1": _st("finished")}) == JobSummary("finished")
    assert combine({"w0": _st("finished"), "w1": _st("stopped")}) == JobSummary("stopped")
