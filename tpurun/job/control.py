"""A job after its start, from any machine that started it: `logs` (replay or follow, reconnecting without
losing or repeating a line) and `cancel` (stop it on every worker). `jobs` is job.status's. Each one call
that reports lines through a `Lines` and returns what happened; the CLI renders it."""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

from tpurun.errors import ExitCode, UnreachableError, UsageError
from tpurun.fleet import targets
from tpurun.fleet.interface import Call
from tpurun.job import watch
from tpurun.job.ends import End
from tpurun.job.records import JobRecord, connect, same_tpu
from tpurun.job.status import JobSummary, combine, settle
from tpurun.job.watch import Waiting, Watch
from tpurun.naming import each_or_by_reason
from tpurun.settings import Settings
from tpurun.transport.runner import Worker, worker_names
from tpurun.worker import protocol
from tpurun.worker.protocol import AgentExit, JobState, JobStatus

RECONNECTS = 5  # a worker's stream is opened again this many times after it broke, a second apart


class Lines(Protocol):
    """Where a job's lines go: each worker's name first, then every line as [wN/cM]."""

    def name_workers(self, names: dict[int, str]) -> None: ...
    def lines(self, worker: int, lines: list[tuple[int, str]]) -> None: ...  # (slot, text) each, in order
    def flush(self) -> None: ...
    def waiting(self, waiting: Waiting | None) -> None: ...  # while following: who the processes wait for


@dataclass
class LogsResult:
    interrupted: bool = False  # the caller's stop was set
    errors: dict[str, str] = field(default_factory=dict)  # worker name -> why its lines could not all be read
    missing: bool = False  # the job is not on some worker it ran on (its files are gone)
    ended: JobSummary | None = None  # followed to its end on every worker, or ended before: how (its record's end)
    notice: protocol.Notice | None = None  # a host event the job was told of (why a worker may be unreachable)

    @property
    def exit_code(self) -> ExitCode:
        """`logs`' exit code: 130 stopped; 2 where the job is not on a worker, 4 where one could not be read (every
        other worker's lines shown); followed to its end, the code `train` gives that end (ends.End)."""
        if self.interrupted:
            return ExitCode.INTERRUPTED
        if self.errors:
            return ExitCode.USAGE if self.missing else ExitCode.UNREACHABLE
        if self.ended is None or self.ended.end is None:
            return ExitCode.OK
        return self.ended.end.exit_code


def logs(
    s: Settings,
    job_id: str,
    lines: Lines,
    stop: threading.Event,
    *,
    worker: str = "all",
    follow: bool = False,
    tail: int | None = None,
    tpu: str | None = None,
) -> LogsResult:
    """Every line of every process of JOB_ID on WORKER (a --worker spec) to LINES: the last TAIL of each
    process (all without TAIL) in time order, then, with FOLLOW, new ones as they come until the job ends
    on every worker (lost included) or STOP is set. A worker that cannot be reached is named in the result's
    errors; every other's lines are shown. TPU: the TPU the caller says the job ran on (checked)."""
    record = JobRecord.load(s.home_path, job_id, tpu)
    target = record.target(s, worker)
    names = worker_names(target.all_workers)
    lines.name_workers(names)
    viewer = _Viewer(record, target, lines, stop, follow and tail is None)
    try:
        viewer.errors.update(target.fleet.connect())
        same_tpu(target, record)
        with watch.reporting(viewer.watch, lines.waiting) if viewer.follow else contextlib.nullcontext():
            viewer.view()
        replay = sorted(viewer.replay)
        rows = replay if tail is None else _last_lines(replay, tail)
        for w, run in itertools.groupby(rows, key=lambda row: row[1]):
            lines.lines(w, [(slot, text) for _, _, slot, _, text in run])
        lines.flush()
        if follow and tail is not None and not stop.is_set():  # then on from where the tail ended
            viewer.follow = True
            with watch.reporting(viewer.watch, lines.waiting):
                viewer.view()
        lines.flush()
    finally:
        target.close()
    ended = None
    if follow and not stop.is_set() and (viewer.lost or all(w in viewer.ended for w in viewer.shown)):
        running = JobState(job_id, 0, JobStatus.RUNNING)  # a part not ended where another was lost
        ended = combine({names[w]: viewer.ended.get(w, running) for w in viewer.shown})
        if worker == "all":
            ended = settle(s.home_path, record, ended)
        elif record.end is not None:  # some workers' parts alone: the job's end is its record's where written
            ended = replace(ended, end=record.end, detail=record.detail)
    return LogsResult(
        interrupted=stop.is_set(),
        errors={names[w]: why for w, why in sorted(viewer.errors.items())},
        missing=bool(viewer.missing),
        ended=ended,
        notice=viewer.notice,
    )


class _Halt(threading.Event):
    """Set by the viewer when the job's end is known before every stream ended (a part of it lost), or by the
    caller's STOP: either ends a follow."""

    def __init__(self, stop: threading.Event) -> None:
        super().__init__()
        self.stop = stop

    def is_set(self) -> bool:
        return super().is_set() or self.stop.is_set()


def _last_lines(rows: list[tuple[float, int, int, int, str]], n: int) -> list[tuple[float, int, int, int, str]]:
    """ROWS (in time order: time, worker, slot, offset, line) keeping the last N lines of each process."""
    total = Counter((w, slot) for _, w, slot, _, _ in rows)
    seen: Counter[tuple[int, int]] = Counter()
    out = []
    for row in rows:
        seen[row[1], row[2]] += 1
        if seen[row[1], row[2]] > total[row[1], row[2]] - n:
            out.append(row)
    return out


class _Viewer:
    """Each worker's records of a job, from the offsets already shown, across reconnects (no line lost,
    none twice). Without follow the lines are gathered and replayed in time order."""

    def __init__(
        self, record: JobRecord, target: targets.Target, lines: Lines, stop: threading.Event, follow: bool
    ) -> None:
        self.record, self.target, self.lines, self.stop, self.follow = record, target, lines, stop, follow
        self.offsets: dict[int, dict[int, int]] = {w: {} for w in record.workers}  # worker -> slot -> offset
        self.done: set[int] = set()
        self.ended: dict[int, protocol.JobState] = {}  # worker -> the job's state there at its end (its Done record)
        self.errors: dict[int, str] = {}
        self.missing: set[int] = set()  # workers without the job
        self.replay: list[tuple[float, int, int, int, str]] = []  # (time, worker, slot, offset, line)
        self.lock = threading.Lock()
        self.watch = Watch(target.workers)  # who waits for whom, among the workers shown
        self.shown = [w.index for w in target.workers]
        self.lost = False  # a worker's part of the job was lost (its supervisor gone): the job's end is known
        self.halt = _Halt(stop)
        self.notice: protocol.Notice | None = None  # a host event the job was told of, as a stream said

    def view(self) -> None:
        """Every shown worker's records, from the offsets shown so far, until each is done (or without follow,
        has sent what it has), the job's end (a part of it lost included) or STOP."""
        self.target.fleet.follow(self._call, self._take, self._ended, self._lost, stop=self.halt, reconnects=RECONNECTS)

    def _call(self, worker: Worker) -> Call:
        """One `agent stream` from the offsets WORKER's lines were shown up to."""
        w = worker.index
        args = ["stream", self.record.job_id, "--offsets", json.dumps(self.offsets[w])]
        return Call.program_of(self.record.python, "agent.py", *args, *(["--follow"] if self.follow else []))

    def _ended(self, w: int, rc: int, err: str, done: bool) -> bool:
        """Whether to read W's records again once its stream ended with RC (follow after a drop)."""
        if done or w in self.done:
            return False
        if rc == AgentExit.USAGE:
            self.missing.add(w)
            self.errors[w] = err.strip() or f"job {self.record.job_id} is not on {self.target.all_workers[w].name}"
            return False
        return self.follow

    def _lost(self, w: int, why: str) -> None:
        """W could not be reached again: its part's end cannot be followed, so the follow ends with the others'
        lines shown so far (it would wait forever for an end it cannot see)."""
        self.errors[w] = why
        self.halt.set()

    def _take(self, _source: int, recs: Iterable[protocol.Record]) -> None:
        """A read's worth of records, each of the worker it names: a follow's lines to LINES at once (a run of
        one worker's at a time), a replay's kept (every worker's lines first, then in time order). A follow's
        read with none: what LINES holds is shown now, not when the next line comes (a burst's last lines)."""
        batch: list[tuple[int, str]] = []
        at = -1  # the worker of BATCH
        kept: list[tuple[float, int, int, int, str]] = []
        took = False
        for rec in recs:
            took = True
            if isinstance(rec, protocol.Done):
                self.done.add(rec.worker)
                self.ended[rec.worker] = rec.state
                if rec.state.status is JobStatus.LOST and self.follow:
                    self.lost = True  # the other parts cannot finish without it: the follow ends here
                    self.halt.set()
            elif isinstance(rec, protocol.Passages):
                self.watch.take(rec)
            elif isinstance(rec, protocol.Notice):
                self.notice = self.notice or rec
            elif isinstance(rec, protocol.Line):
                w = rec.worker
                if self.follow:
                    if w != at and batch:
                        self.lines.lines(at, batch)
                        batch = []
                    at = w
                    batch.append((rec.slot, rec.text))
                    self.watch.lines(w, rec.slot, rec.text, rec.time)
                else:
                    kept.append((rec.time, w, rec.slot, rec.offset, rec.text))
                self.offsets[w][rec.slot] = rec.offset
        if batch:
            self.lines.lines(at, batch)
        elif not took and self.follow:
            self.lines.flush()
        if kept:
            with self.lock:
                self.replay += kept


@dataclass
class CancelResult:
    stopped: int  # workers where the job still ran when the stop came
    ended: dict[str, protocol.JobStatus]  # worker name -> how the job had already ended there
    missing: list[str] = field(default_factory=list)  # workers it was to run on that have no trace of it
    end: End | None = None  # how the job had ended, as its record keeps it: nothing was asked of the workers


def cancel(s: Settings, job_id: str, grace: float, tpu: str | None = None) -> CancelResult:
    """Stop JOB_ID on every worker it ran on (SIGTERM, SIGKILL after GRACE seconds); returns when none of its
    processes is left anywhere, or raises UnreachableError naming the workers where that is not known, and
    UsageError when no worker has the job (it never started). A job whose record keeps its end has ended: nothing
    is done, and its end is said. TPU: the TPU the caller says the job ran on (checked)."""
    record = JobRecord.load(s.home_path, job_id, tpu)
    if record.end is not None:
        return CancelResult(stopped=0, ended={}, end=record.end)
    target = record.target(s)
    results: dict[int, tuple[int, str]] = {}
    before: dict[int, protocol.JobStatus | None] = {}  # worker -> the job's status there when the stop came
    try:
        connect(target, record)

        call = Call.program_of(record.python, "agent.py", "stop", job_id, "--grace", str(grace))
        for w, a in target.fleet.call(call, timeout=grace + 120).items():
            if a.rc is None:
                raise UnreachableError(a.error)
            try:
                before[w] = protocol.JobState.from_json(a.out).status_before_stop
            except ValueError:
                pass
            results[w] = (a.rc, a.err)
    finally:
        target.close()
    names = worker_names(target.all_workers)
    missing = [names[w] for w, (rc, _) in sorted(results.items()) if rc == AgentExit.USAGE]  # "no job J here"
    failures = [
        (names[w], f"{names[w]}: {err.strip() or rc}")
        for w, (rc, err) in sorted(results.items())
        if rc not in (AgentExit.OK, AgentExit.USAGE)
    ]
    if failures:
        raise UnreachableError("could not stop the job everywhere: " + "; ".join(each_or_by_reason(failures)))
    if len(missing) == len(target.workers):
        raise UsageError(
            f"job {job_id} is on none of its workers ({', '.join(missing)}): it never started, or its files there "
            "were removed; nothing to stop",
            hint="`tpurun jobs` lists the jobs",
        )
    ended = {names[w]: st for w, st in before.items() if st is not None and st in protocol.TERMINAL}
    return CancelResult(stopped=len(target.workers) - len(ended) - len(missing), ended=ended, missing=missing)
