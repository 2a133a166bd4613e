"""A job's state over every worker, for `jobs`: each worker's agent keeps its own; tpurun combines them.

A failure anywhere makes the job failed, naming the worker (and chip and exit code) that failed first; a
job whose TPU no longer exists is `gone`, and `jobs --prune` forgets it. Its words are the protocol's
`JobStatus`, the agent's and tpurun's in one vocabulary. One connection round and one agent call per worker,
all at once, per TPU, however many jobs it ran.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from tpurun import naming
from tpurun.errors import NoSuchTpu, TpurunError
from tpurun.job.records import JobRecord, forget, list_records
from tpurun.job.watch import Waiting, Watch
from tpurun.settings import Settings
from tpurun.targets import Target
from tpurun.transport.fleet import Answer, Call
from tpurun.worker import protocol
from tpurun.worker.protocol import JobState, JobStatus

K = TypeVar("K")

ACTIVE = (JobStatus.STARTING, JobStatus.RUNNING)


@dataclass(frozen=True)
class JobSummary:
    """A job's state over every worker (each worker's agent knows its own `JobStatus`)."""

    status: JobStatus  # running | failed | lost | stopped | finished | unreachable | unknown | gone
    detail: str = ""  # which worker failed and how; why the state is not known; what became of the TPU
    waiting: Waiting | None = None  # running: the processes that wait at a rendezvous for others (watch)
    notice: protocol.Notice | None = None  # a host event announced for one of its workers, as an agent recorded it

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", JobStatus(self.status))  # its word, however it was given

    def label(self) -> str:
        detail = "; ".join(d for d in (self.detail, self.waiting.text() if self.waiting else "") if d)
        return f"{self.status} ({detail})" if detail else self.status


@dataclass(frozen=True)
class JobRow:
    record: JobRecord
    state: JobSummary

    def to_dict(self) -> dict[str, Any]:
        """The job in `jobs --json`: its record, its state over every worker; its notice the record's (what ended
        its `train`), else the one an agent recorded."""
        record, state = self.record, self.state
        return {
            "job_id": record.job_id,
            "tpu": record.tpu,
            "status": state.status,
            "detail": state.detail,
            "waiting": state.waiting.to_dict() if state.waiting else None,
            "created": record.created,
            "detached": record.detached,
            "command": " ".join(record.command),
            "end": record.end or None,
            "restart": record.restart,
            "restartReason": record.restart_reason or None,
            "notice": record.notice or (state.notice.to_dict() if state.notice else None),
        }


def earliest_failure(states: Mapping[K, JobState | None]) -> tuple[K, protocol.FirstFailure | None] | None:
    """The job's first failure over every worker's state (STATES: worker -> its state, in worker order; None
    where unknown): the failed worker whose failure its agent saw first, by time, else the first failed worker
    in order; (its key, its FirstFailure), or None where no worker failed. train's summary, `jobs` and `logs`
    name it, so all three name the same process."""
    failed = [(key, st.first_failure) for key, st in states.items() if st is not None and st.status == JobStatus.FAILED]
    if not failed:
        return None
    timed = [(f.time, n) for n, (_, f) in enumerate(failed) if f is not None and f.time is not None]
    return failed[min(timed)[1]] if timed else failed[0]


def combine(states: Mapping[str, JobState | None]) -> JobSummary:
    """One job's state from every worker's: STATES is {worker name: its agent's state, None where the
    job is unknown there}, in worker order."""
    notice = next((st.notice for st in states.values() if st is not None and st.notice is not None), None)
    summary = _combined(states)
    return summary if notice is None else dataclasses.replace(summary, notice=notice)


def _combined(states: Mapping[str, JobState | None]) -> JobSummary:
    found = earliest_failure(states)
    if found is not None:
        name, first = found
        where = f"{name}/c{first.slot}" if first is not None and first.slot != protocol.HOST else name
        code = first.exit_code if first is not None else None
        return JobSummary(JobStatus.FAILED, where + (f": exit code {code}" if code is not None else ""))
    lost = [name for name, st in states.items() if st is not None and st.status == JobStatus.LOST]
    if lost:
        return JobSummary(JobStatus.LOST, f"{', '.join(lost)}: its supervisor is gone")
    missing = [name for name, st in states.items() if st is None]
    if any(st is not None and st.status in ACTIVE for st in states.values()):
        return JobSummary(JobStatus.RUNNING, f"not on {', '.join(missing)}" if missing else "")
    if missing:
        return JobSummary(JobStatus.UNKNOWN, f"no trace on {', '.join(missing)}")
    ended = {st.status for st in states.values() if st is not None}  # only FINISHED and STOPPED are left
    return JobSummary(JobStatus.FINISHED if ended == {JobStatus.FINISHED} else JobStatus.STOPPED)


def _rows(s: Settings, records: list[JobRecord]) -> list[JobRow]:
    """Every job of RECORDS with its state over every worker, asking each TPU once."""
    groups: dict[tuple[str, str, str, tuple[str, ...]], list[JobRecord]] = {}
    for r in records:
        groups.setdefault(r.where(), []).append(r)
    rows: dict[str, JobSummary] = {}
    for (tpu, _, _, ids), group in groups.items():
        rows.update(_tpu_states(s, tpu, list(ids), group))
    return [JobRow(r, rows[r.job_id]) for r in records]


def jobs(
    s: Settings, tpu: str | None = None, *, project: str | None = None, zone: str | None = None, prune: bool = False
) -> list[JobRow]:
    """The jobs started from this machine (S: its settings, for tpurun's home) (on TPU, in PROJECT and ZONE when given; else everywhere), with
    their states; with PRUNE, the records of jobs whose TPU no longer exists are forgotten (and still
    returned, this once)."""

    def chosen(r: JobRecord) -> bool:
        return (not tpu or r.tpu == tpu) and (not project or r.project == project) and (not zone or r.zone == zone)

    home = s.home_path
    rows = _rows(s, [r for r in list_records(home) if chosen(r)])
    if prune:
        for row in rows:
            if row.state.status is JobStatus.GONE:
                forget(home, row.record.job_id)
    return rows


def _tpu_states(s: Settings, tpu: str, ids: list[str], group: list[JobRecord]) -> dict[str, JobSummary]:
    """The state of every job of GROUP, all run on the TPU TPU whose nodes had IDS."""

    def every(status: JobStatus, detail: str) -> dict[str, JobSummary]:
        return {r.job_id: JobSummary(status, detail) for r in group}

    every_worker = replace(group[0], workers=sorted({w for r in group for w in r.workers}))
    target: Target | None = None
    try:
        target = every_worker.target(s)
        errors = target.fleet.connect()
        if target.other_than(ids):
            return every(JobStatus.GONE, f"TPU {tpu} deleted; another has its name")
        answers = target.fleet.call(Call.program_of(group[-1].python, "agent.py", "jobs"), timeout=30)
        listed = {w: _agent_jobs(a) for w, a in answers.items()}
    except NoSuchTpu:
        return every(JobStatus.GONE, f"TPU {tpu} deleted")
    except TpurunError as exc:
        return every(JobStatus.UNKNOWN, exc.message)
    finally:
        if target is not None:
            target.close()
    names = {w.index: w.name for w in target.all_workers}
    out = {}
    for r in group:
        unreachable = [names.get(w, str(w)) for w in r.workers if w in errors]
        if unreachable:
            out[r.job_id] = JobSummary(JobStatus.UNREACHABLE, naming.listed(unreachable))
            continue
        summary = combine({names.get(w, str(w)): listed.get(w, {}).get(r.job_id) for w in r.workers})
        if summary.status is JobStatus.RUNNING:
            summary = replace(summary, waiting=_waiting(target, r, listed))
        out[r.job_id] = summary
    return out


def _waiting(target: Target, record: JobRecord, listed: Mapping[int, Mapping[str, JobState]]) -> Waiting | None:
    """Who RECORD's processes wait for, from each worker's state of it (its processes' passages, last lines)."""
    watch = Watch([w for w in target.all_workers if w.index in record.workers])
    for w in record.workers:
        st = listed.get(w, {}).get(record.job_id)
        if st is not None:
            watch.take_state(w, st)
    return watch.waiting(time.time())


def _agent_jobs(answer: Answer) -> dict[str, JobState]:
    """{job id: its state} of every job the agent on the ANSWER's worker knows ({} without an agent there, or
    when the worker stopped answering meanwhile)."""
    if answer.rc != 0:
        return {}
    try:
        return {st.job_id: st for st in protocol.job_states(answer.out)}
    except ValueError:
        return {}
