"""A job's state over every worker, for `jobs` and `logs`: each worker's agent keeps its own; tpurun judges the job's
one end from them (job.ends.judge, as `train` does from what it saw) and writes it in the job's record the first time
it sees it, never again: what a later look cannot see (a worker unreachable, the TPU gone) is said beside the end,
not instead of it. One connection round and one agent call per worker, all at once, per TPU, however many jobs it
ran.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from tpurun import naming
from tpurun.errors import NoSuchTpu, TpurunError
from tpurun.fleet.interface import Answer, Call
from tpurun.fleet.targets import Target
from tpurun.job import ends
from tpurun.job.ends import End
from tpurun.job.records import JobRecord, forget, list_records
from tpurun.job.watch import Waiting, Watch
from tpurun.settings import Settings
from tpurun.worker import protocol
from tpurun.worker.protocol import JobState, JobStatus

K = TypeVar("K")

ACTIVE = (JobStatus.STARTING, JobStatus.RUNNING)
RUNNING = "running"  # a job's status while it has not ended (its end's word once it has)
UNKNOWN = "unknown"  # neither: where its end is not known and it runs nowhere that could be asked


@dataclass(frozen=True)
class JobSummary:
    """A job's state over every worker: how it ended (END), else whether it runs; what of it cannot be seen now
    (SEEN, said beside); the TPU it ran on GONE."""

    end: End | None = None
    running: bool = False  # processes of it run on some worker
    detail: str = ""  # which process failed first (ends.failure); why a worker's part is lost; where it runs not
    seen: str = ""  # what this look could not see: workers unreachable now, the TPU deleted
    gone: bool = False  # the TPU it ran on no longer exists (`jobs --prune` forgets it)
    waiting: Waiting | None = None  # running: the processes that wait at a rendezvous for others (watch)
    notice: protocol.Notice | None = None  # a host event announced for one of its workers, as an agent recorded it
    ended_at: float | None = None  # ended: when its last process ended, as its workers' agents recorded it

    @property
    def status(self) -> str:
        """The job's state in one word: its end's (also where a part lost leaves others running: DETAIL says
        so), else running, else unknown."""
        return self.end.value if self.end is not None else RUNNING if self.running else UNKNOWN

    def label(self) -> str:
        detail = "; ".join(d for d in (self.detail, self.waiting.text() if self.waiting else "") if d)
        text = f"{self.status} ({detail})" if detail else self.status
        return f"{text} [{self.seen}]" if self.seen else text


@dataclass(frozen=True)
class JobRow:
    record: JobRecord
    state: JobSummary

    def to_dict(self) -> dict[str, Any]:
        """The job in `jobs --json`: its record, its state; its notice the record's (what ended it), else the one
        an agent recorded."""
        record, state = self.record, self.state
        return {
            "job_id": record.job_id,
            "tpu": record.tpu,
            "status": state.status,
            "end": state.end.value if state.end is not None else None,
            "exit_code": int(state.end.exit_code) if state.end is not None else None,
            "detail": state.detail,
            "seen": state.seen or None,
            "waiting": state.waiting.to_dict() if state.waiting else None,
            "created": record.created,
            "detached": record.detached,
            "command": " ".join(record.command),
            "restart": record.restart,
            "restartReason": record.restart_reason or None,
            "notice": record.notice or (state.notice.to_dict() if state.notice else None),
            "pricePerHour": record.per_hour,
            "cost": round(cost, 6) if (cost := record.cost()) is not None else None,
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
    """One job's state from every worker's: STATES is {worker name: its agent's state, None where the job is
    unknown there}, in worker order. Its end (ends.judge) once every worker's part has ended, or once one part is
    lost (a slice is interrupted as a whole: the other parts cannot finish, though they may run on)."""
    notice = next((st.notice for st in states.values() if st is not None and st.notice is not None), None)
    missing = [name for name, st in states.items() if st is None]
    active = [name for name, st in states.items() if st is not None and st.status in ACTIVE]
    lost = [name for name, st in states.items() if st is not None and st.status is JobStatus.LOST]
    if active and not lost:
        return JobSummary(running=True, detail=f"not on {', '.join(missing)}" if missing else "", notice=notice)
    if missing and not lost:
        return JobSummary(detail=f"no trace on {', '.join(missing)}", notice=notice)
    ended = [st for st in states.values() if st is not None and st.status not in ACTIVE]
    found = earliest_failure(states)
    end = ends.judge(
        ends.Facts(
            notice=notice,
            user=notice is None and all(st.status is JobStatus.STOPPED for st in ended),
            spent=any(st.status is JobStatus.SPENT for st in ended),
            failed=found is not None,
            lost=End.LOST if lost else None,
            all_zero=all(st.status is JobStatus.FINISHED for st in ended),
        )
    )
    details = []
    if end is End.FAILED and found is not None:
        name, first = found
        details.append(ends.failure(name, first.slot, first.exit_code) if first is not None else name)
    elif lost:
        details.append(f"supervisor gone on {naming.listed(lost)}")
    if active:
        details.append(f"still running on {naming.listed(active)}")
    last = max((sl.ended_at for st in ended for sl in st.slots if sl.ended_at), default=None)
    return JobSummary(end, running=bool(active), detail="; ".join(details), notice=notice, ended_at=last)


def settle(home: Path, record: JobRecord, summary: JobSummary) -> JobSummary:
    """SUMMARY, what a look saw of RECORD's job, with the end the record keeps where it has one; else, where the look
    saw it ended on every worker, that end, written in the record now, once (under HOME)."""
    if record.end is not None:
        return replace(summary, end=record.end, running=False, detail=record.detail, waiting=None)
    if summary.end is not None and not summary.running:
        record.close(home, summary.end, summary.detail, summary.notice, summary.ended_at)
    return summary


def jobs(
    s: Settings, tpu: str | None = None, *, project: str | None = None, zone: str | None = None, prune: bool = False
) -> list[JobRow]:
    """The jobs started from this machine (S: its settings, for tpurun's home) (on TPU, in PROJECT and ZONE when
    given; else everywhere), with their states, asking each TPU once; with PRUNE, the records of jobs whose TPU no
    longer exists are forgotten (and still returned, this once)."""

    def chosen(r: JobRecord) -> bool:
        return (not tpu or r.tpu == tpu) and (not project or r.project == project) and (not zone or r.zone == zone)

    home = s.home_path
    records = [r for r in list_records(home) if chosen(r)]
    groups: dict[tuple[str, str, str, tuple[str, ...]], list[JobRecord]] = {}
    for r in records:
        groups.setdefault(r.where(), []).append(r)
    seen: dict[str, JobSummary] = {}
    for (name, _, _, ids), group in groups.items():
        seen.update(_tpu_states(s, name, list(ids), group))
    rows = [JobRow(r, settle(home, r, seen[r.job_id])) for r in records]
    if prune:
        for row in rows:
            if row.state.gone:
                forget(home, row.record.job_id)
    return rows


def _tpu_states(s: Settings, tpu: str, ids: list[str], group: list[JobRecord]) -> dict[str, JobSummary]:
    """What one look sees of every job of GROUP, all run on the TPU TPU whose nodes had IDS."""

    def every(seen: str, gone: bool = False) -> dict[str, JobSummary]:
        return {r.job_id: JobSummary(seen=seen, gone=gone) for r in group}

    every_worker = replace(group[0], workers=sorted({w for r in group for w in r.workers}))
    target: Target | None = None
    try:
        target = every_worker.target(s)
        errors = dict(target.fleet.connect())
        if target.other_than(ids):
            return every(f"TPU {tpu} deleted; another has its name", gone=True)
        answers = target.fleet.call(Call.program_of(group[-1].python, "agent.py", "jobs"), timeout=30)
        errors.update({w: a.error for w, a in answers.items() if a.rc is None})
        listed = {w: _agent_jobs(a) for w, a in answers.items()}
    except NoSuchTpu:
        return every(f"TPU {tpu} deleted", gone=True)
    except TpurunError as exc:
        return every(exc.message)
    finally:
        if target is not None:
            target.close()
    names = {w.index: w.name for w in target.all_workers}
    out = {}
    for r in group:
        unreachable = [names.get(w, str(w)) for w in r.workers if w in errors]
        states = {names.get(w, str(w)): listed.get(w, {}).get(r.job_id) for w in r.workers if w not in errors}
        summary = combine(states)
        if unreachable:  # the others' parts alone tell no end: said beside whatever the record keeps
            seen = f"{naming.listed(unreachable)} unreachable now"
            summary = JobSummary(running=summary.running, seen=seen, notice=summary.notice)
        elif summary.running and summary.end is None:
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
