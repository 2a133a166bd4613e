"""One attempt of a job across all workers: each worker's agent starts its part, and its records stream back.

Each worker gets one SSH channel running `agent start` then `agent stream --attached`: the channel's stdin is
the job's lifeline, so closing it (fail-fast, Ctrl-C) or losing it (tpurun killed, laptop gone) stops the
processes of an attached job on that worker. `JobRun` renders every line through an `Output`, follows how
each process ends, and stops the job everywhere on the first failure; `launcher` decides the job and
makes the attempts.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Protocol

from tpurun.errors import TpurunError
from tpurun.fleet.interface import Call, Session
from tpurun.fleet.targets import Target
from tpurun.job import ends, env_contract, stacks, status, watch
from tpurun.job.stacks import Stacks
from tpurun.job.watch import Waiting, Watch
from tpurun.transport.runner import Worker
from tpurun.worker import agent_notices, protocol
from tpurun.worker.protocol import AgentExit, Launch, ProcessStatus
from tpurun.worker.protocol_calls import JobSpec, ProcessSpec, claim_start


@dataclass
class SlotOutcome:
    """How the process in one slot of a worker stands or ended, as the launcher follows it."""

    worker: int
    slot: int
    exit_code: int | None = None
    status: ProcessStatus = ProcessStatus.RUNNING
    started: float = 0.0
    ended: float = 0.0
    last_lines: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    lost: bool = False  # its worker was lost (its connection, or the relay that reached it) before its end was heard

    @property
    def shown_status(self) -> str:
        """Its status as the job's summary shows it: the agent's word, or `unreachable` where its worker was lost
        before its end was heard (what became of it is not known here: not `running`)."""
        return UNREACHABLE if self.lost else str(self.status)

    @property
    def failed(self) -> bool:
        # died: a chip process of a host launch that vanished unreported (its exit status is its parent's)
        return self.exit_code not in (0, None) or self.status is ProcessStatus.DIED

    @property
    def ending(self) -> str:
        if self.status is ProcessStatus.DIED:
            return "no exit status: it died, killed by a signal or crashed"
        return f"exit code {self.exit_code}"


UNREACHABLE = "unreachable"  # a process whose worker was lost before its end was heard (tpurun's word, not the agent's)


class Output(Protocol):
    """How the launcher reports (it prints nothing itself): status lines, every process's lines, and the
    lines a worker's setup prints."""

    def name_workers(self, names: dict[int, str]) -> None: ...
    def info(self, text: str) -> None: ...
    def warn(self, text: str) -> None: ...
    def lines(self, worker: int, lines: list[tuple[int, str]]) -> None: ...  # (slot, text) each, in order
    def worker_line(self, worker: int, stream: str, text: str) -> None: ...
    def flush(self) -> None: ...
    def progress(self) -> AbstractContextManager[Callable[[str], None]]: ...
    def waiting(self, waiting: Waiting | None) -> None: ...  # who the processes wait for, now (None: nobody)
    def starting(self, started: int, workers: int) -> None: ...  # each second until every worker started the job
    def hung(self, found: Stacks | None, why: str, quiet: float, stopping: bool) -> None: ...  # see HangWatch
    def notice(self, notice: protocol.Notice, worker: str) -> None: ...  # a host event announced for WORKER


class OnHang(str, Enum):
    """What `train` does when the job stops making progress (`--on-hang`)."""

    report = "report"  # print every process's stacks, grouped, and keep waiting
    stop = "stop"  # the same, then stop the job: it ends hung (ExitCode.HUNG)


# a job's workers hear each other's notices on one port of these, its id's: below Linux's ephemeral ports (32768 up),
# which the workers' own outgoing connections take
NOTICE_PORTS = (30000, 32000)
DEFAULT_HANG_TIMEOUT = 1800.0  # seconds: a long compile prints nothing for minutes; half an hour of nothing is not that


@dataclass(frozen=True)
class HangWatch:
    """`train --hang-timeout`: when no process of the job has printed a line or changed state (started, ended,
    entered or left a rendezvous) for TIMEOUT seconds, every process's stacks are read, reported, and then
    ON_HANG; once more after each further TIMEOUT of silence. The dump goes under HOME."""

    timeout: float
    on_hang: OnHang
    home: Path


class JobRun:
    """One attempt of a job across all workers."""

    def __init__(
        self,
        target: Target,
        job_id: str,
        specs: list[list[env_contract.SlotSpec]],
        out: Output,
        *,
        cwd: str,
        python: str,
        detach: bool,
        grace: float,
        pre: Callable[[int], list[list[str]]],
        launch: Launch,
        cancel: threading.Event | None = None,
        down: bool = False,
        hang: HangWatch | None = None,
        on_notice: str = "",
        spend_for: float | None = None,  # `train --budget`: seconds its supervisors let it run (job/spend_limit.py)
        held: Mapping[int, Session] | None = None,  # the claim's programs still holding their workers for the job
        began: threading.Event | None = None,  # set once the job started on every worker
    ) -> None:
        self.held = dict(held or {})
        self.began = began
        self.target = target
        self.job_id = job_id
        self.specs = specs
        self.out = out
        self.cwd = cwd
        self.python = python
        self.detach = detach
        self.grace = grace
        self.pre = pre
        self.launch = launch
        self.down = down
        self.cancel = cancel or threading.Event()  # set by the caller (Ctrl-C): stop the job everywhere
        self.outcomes: dict[tuple[int, int], SlotOutcome] = {
            (c.worker, c.slot): SlotOutcome(c.worker, c.slot) for per in specs for c in per
        }
        self.first_failure: SlotOutcome | None = None
        self.ended: dict[int, protocol.JobState] = {}  # worker -> the job's state there when it ended (Done)
        self.unreachable: dict[int, str] = {}  # worker -> why it could not be reached, or vanished
        self.busy: dict[int, str] = {}  # worker -> why the agent refused (another job runs there)
        self.started: set[int] = set()  # the workers whose agent started the job
        self.size = len(target.workers)  # (counted once: each Started record would count them anew)
        self.all_started = False  # every worker's (then no longer reported)
        self.stop = threading.Event()
        self.started_at = time.monotonic()
        self.lock = threading.Lock()
        self.watch = Watch(target.workers)  # what each process last did, who waits for whom
        self.hang = hang
        self.last_activity = time.monotonic()  # a record from any worker: a line, an end, a passage
        self.hung = False  # stopped by --on-hang stop
        self.notice: protocol.Notice | None = None  # the first notice of a host event its workers heard of
        self.on_notice = on_notice  # what the job's processes are told of one (ends.on_notice)
        self.noticed_at = 0.0  # when the notice came (monotonic)
        self.settle_at: float | None = None  # a process ended after the notice: what still runs is stopped then (monotonic)
        self.spend_for = spend_for
        # the workers' supervisors pass notices on to each other at their internal addresses, signed with this key
        # (the workers the job runs on: every one, or the one `--worker` chose; the first of them is the hub)
        self.addresses = {i: w.internal or w.address for i, w in enumerate(target.all_workers) if specs[i]}
        self.notice_key = secrets.token_hex(32)
        self.notice_port = NOTICE_PORTS[0] + int(hashlib.sha256(job_id.encode()).hexdigest(), 16) % (
            NOTICE_PORTS[1] - NOTICE_PORTS[0]
        )

    def job_spec(self, worker: int) -> JobSpec:
        return JobSpec(
            job_id=self.job_id,
            worker=worker,
            cores=[ProcessSpec(c.slot, c.argv, c.env, self.cwd) for c in self.specs[worker]],
            launch=self.launch,
            detach=self.detach,
            down=self.down,
            grace=self.grace,
            pre_commands=self.pre(worker),
            on_notice=self.on_notice,
            notice_address=self.addresses.get(worker, "") if len(self.addresses) > 1 else "",
            peers=self.notice_peers(worker),
            notice_port=self.notice_port,
            notice_key=self.notice_key,
            spend_for=self.spend_for,
        )

    def notice_peers(self, worker: int) -> list[str]:
        """Whom WORKER's supervisor tells a notice: the job's first worker (the hub) tells every other worker of the
        job, any other the hub (so no spec carries every address but the hub's, and relays do not carry the pod's
        addresses per worker)."""
        if len(self.addresses) < 2:
            return []
        hub, *rest = self.addresses
        return [self.addresses[w] for w in rest] if worker == hub else [self.addresses[hub]]

    def _call(self, worker: Worker) -> Call:
        """WORKER's part of the job: the agent's `start` with its spec, then (attached) its `stream`, whose stdin
        is the lifeline, on the same channel."""
        then = () if self.detach else ("stream", self.job_id, "--follow", "--attached")
        return Call.program_of(self.python, "agent.py", *then, first=("start", self._spec(worker.index)))

    def _spec(self, worker: int) -> bytes:
        return self.job_spec(worker).to_json().encode()

    def _lose(self, w: int, why: str) -> None:
        with self.lock:
            self.unreachable[w] = why
        self.stop.set()

    def _lost(self, w: int, why: str) -> None:
        """W's stream lost for WHY (W, or the relay that reached it, gone): its processes whose end was not heard
        are unreachable, not running."""
        with self.lock:
            for o in self.outcomes.values():
                if o.worker == w and o.status in (ProcessStatus.PENDING, ProcessStatus.RUNNING):
                    o.lost = True
        self._lose(w, why)

    def _read(self, source: int, recs: Iterable[protocol.Record]) -> None:
        """A read's worth of records from SOURCE's stream; idle: what is buffered is shown now, not when the
        next line comes."""
        if self.cancel.is_set():
            self.stop.set()
        if not self._take(source, recs):
            self.out.flush()

    def _ended(self, w: int, rc: int, err: str, done: bool) -> bool:
        """W's stream ended with RC (its part of the job over when DONE); never opened again."""
        if done:
            return False
        err = err.strip()
        if rc == AgentExit.BUSY:
            # another job holds this worker: a refusal (nothing of ours started), not a lost worker
            with self.lock:
                self.busy[w] = err.splitlines()[-1]
            self.stop.set()
        elif not (self.detach and rc == 0):
            detail = err.splitlines()[-1] if err else f"connection closed (exit {rc})"
            self._lost(w, f"lost worker {self.target.all_workers[w].label()}: {detail}")
        return False

    def _take(self, source: int, recs: Iterable[protocol.Record]) -> bool:
        """A read's worth of records from SOURCE's stream, each of the worker it names, each run of a worker's
        lines to the output at once: whether there were any."""
        took = False
        batch: list[tuple[int, str]] = []
        at = source  # the worker of BATCH
        t = 0.0
        for rec in recs:
            if not took:
                self.last_activity = time.monotonic()
            took = True
            if isinstance(rec, protocol.Line):
                if rec.worker != at and batch:
                    self._lines(at, batch, t)
                    batch = []
                at = rec.worker
                batch.append((rec.slot, rec.text))
                t = rec.time
                continue
            if batch:
                self._lines(at, batch, t)
                batch = []
            self._event(source, rec)
        if batch:
            self._lines(at, batch, t)
        return took

    def _lines(self, w: int, batch: list[tuple[int, str]], t: float) -> None:
        """W's BATCH of lines, the last printed at T."""
        kept: dict[int, deque[str]] = {}  # each slot's last lines (an outcome's lookup takes the lock)
        for slot, text in batch:
            last = kept.get(slot)
            if last is None:
                last = kept[slot] = self.outcome(w, slot).last_lines
            last.append(text)
        for slot, last in kept.items():
            self.watch.lines(w, slot, last[-1], t)
        self.out.lines(w, batch)

    def _event(self, source: int, rec: protocol.Record) -> None:
        """Take one record other than a line, of the worker it names (SOURCE's, the stream's, for one that names
        none)."""
        if isinstance(rec, protocol.Exit):
            self._exited(rec.worker, rec)
            return
        if isinstance(rec, protocol.Passages):
            self.watch.take(rec)
            return
        if isinstance(rec, protocol.Done):
            w = rec.worker
            origin = rec.state.first_failure
            if rec.state.notice is not None:
                self._noticed(rec.state.notice)
            with self.lock:
                self.ended[w] = rec.state
                if origin is not None and self.first_failure is None:
                    self.first_failure = self.outcome(w, origin.slot)
            for ps in rec.state.slots:
                o = self.outcome(w, ps.slot)
                if o.exit_code is None:
                    o.exit_code, o.status = ps.exit_code, ps.status
        elif isinstance(rec, protocol.Notice):
            self._noticed(rec)
        elif isinstance(rec, protocol.StartFailed):
            why = f"{self.target.all_workers[source].name}: the agent could not start the job: {rec.reason}"
            self._lose(source, why)
        elif isinstance(rec, protocol.Started):
            with self.lock:
                self.started.add(rec.worker)
                everywhere = len(self.started) >= self.size
            if everywhere and self.began is not None:
                self.began.set()

    def _noticed(self, notice: protocol.Notice) -> None:
        """The first notice of a host event any worker reports: kept for the job's end, and shown once."""
        with self.lock:
            if self.notice is not None:
                return
            self.notice, self.noticed_at = notice, time.monotonic()
        workers = self.target.all_workers
        self.out.notice(notice, workers[notice.worker].name if notice.worker < len(workers) else f"w{notice.worker}")

    def _exited(self, w: int, rec: protocol.Exit) -> None:
        o = self.outcome(w, rec.slot)
        o.exit_code, o.status = rec.code, rec.status
        o.ended = time.monotonic() - self.started_at
        if o.failed and not self.stop.is_set():
            # a process the agent killed because a sibling failed is not the origin: wait for the sibling's record
            if o.status is not ProcessStatus.KILLED:
                with self.lock:
                    if self.first_failure is None:
                        self.first_failure = o
            name = env_contract.process_name(w, rec.slot, self.target.all_workers[w].name)
            if self.spent():  # its own supervisor stopped it, as every other worker's does
                self.out.info(f"{name} was stopped ({o.ending}): the job's --budget is spent")
                self.stop.set()
            elif self.notice is None:
                self.out.info(f"{name} failed ({o.ending}): stopping the job everywhere")
                self.stop.set()
            else:
                self._settle(name, o.ending)
        elif o.failed and o.status is not ProcessStatus.KILLED and self.first_failure is None:
            with self.lock:
                self.first_failure = o  # its worker's agent reported the killed sibling first

    def _settle(self, name: str, ending: str) -> None:
        """NAME ended (ENDING) after the notice: its doing, not a failure of the program (ends.judge). The others
        were told too and may still be saving: they are left to end until the host may go (`settle_by`, on the
        worker's clock: counted here from when the notice came, this machine's clock may differ)."""
        assert self.notice is not None
        with self.lock:
            if self.settle_at is not None:
                return
            since = time.monotonic() - self.noticed_at
            by = agent_notices.settle_by(self.notice, self.notice.seen + since)
            left = None if by is None else by - (self.notice.seen + since)
            self.settle_at = time.monotonic() + (left or 0.0)
        if left is None:
            self.out.info(f"{name} ended after the notice ({ending}): stopping the job everywhere")
            self.stop.set()
        else:
            self.out.info(f"{name} ended after the notice ({ending}): the others may end on their own within "
                          f"{left:.0f} s, then the job is stopped everywhere")  # fmt: skip

    def spent(self) -> bool:
        """Whether the job's --budget is (about to be) spent: its supervisors stop it then, a grace early."""
        return self.spend_for is not None and time.monotonic() >= self.started_at + self.spend_for - self.grace - 1

    def failure_detail(self) -> str:
        """Which process failed first and how (ends.failure), "" where none did."""
        f = self.first_failure
        if f is None:
            return ""
        code = None if f.status is ProcessStatus.DIED else f.exit_code
        return ends.failure(self.target.all_workers[f.worker].name, f.slot, code)

    def outcome(self, w: int, slot: int) -> SlotOutcome:
        """W's SLOT, also one the script's spawner made after the start (a host launch's chips)."""
        with self.lock:
            if (w, slot) not in self.outcomes:
                self.outcomes[(w, slot)] = SlotOutcome(w, slot)
            return self.outcomes[(w, slot)]

    def run(self) -> None:
        with watch.reporting(self.watch, self._tick):
            lifeline = None if self.detach else self.stop  # closed: the agents stop the job and stream to its end
            # where the claim's program still holds its worker, it starts the job there and streams it (one program
            # on the worker from the claim to the job's end); elsewhere a new one does (`_call`)
            held = {
                w: (s, claim_start(self._spec(w), stream=not self.detach))
                for w, s in self.held.items()
            }
            self.held = {}
            self.target.fleet.follow(self._call, self._read, self._ended, self._lost, lifeline=lifeline, held=held)
        self.out.flush()
        # the first failure by the agents' own account, as `jobs` and `logs` name it (records came in the
        # order the workers' streams delivered them, not always the order the processes failed in)
        found = status.earliest_failure(self.ended)
        if found is not None and found[1] is not None:
            self.first_failure = self.outcome(found[0], found[1].slot)

    def _tick(self, waiting: Waiting | None) -> None:
        """Each second while the job runs: how far its start has come, who waits for whom, and whether the job
        has gone quiet."""
        if not self.all_started:
            with self.lock:
                started = len(self.started)
            self.all_started = started >= self.size
            self.out.starting(started, self.size)
        self.out.waiting(waiting)
        if self.settle_at is not None and time.monotonic() >= self.settle_at and not self.stop.is_set():
            self.out.info("the notice's time to end is up: stopping the job everywhere")
            self.stop.set()
        h = self.hang
        if h is None or h.timeout <= 0 or self.detach or self.stop.is_set():
            return
        quiet = time.monotonic() - self.last_activity
        if quiet < h.timeout:
            return
        found, why = None, ""
        try:
            found = stacks.gather(self.target, self.python, self.job_id, h.home)
        except TpurunError as exc:
            why = exc.message
        except Exception as exc:  # a transport's own error: the report says so, the watch goes on
            why = f"{type(exc).__name__}: {exc}"
        stopping = h.on_hang is OnHang.stop and not self.stop.is_set()
        self.out.hung(found, why, quiet, stopping)
        self.last_activity = time.monotonic()  # the next report after another whole quiet period
        if stopping:
            self.hung = True
            self.stop.set()
