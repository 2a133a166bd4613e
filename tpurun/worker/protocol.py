"""The agent's protocol, written once: what the client (tpurun) and the worker agent say to each other.

Part of the agent bundle (stdlib only, Python >= 3.8). On a worker the agent, its supervisor and the hook
import it from the bundle's directory; in tpurun it is `tpurun.worker.protocol`. Nothing else spells a
record key, an event, a status or an exit code. Two modules, by subject: this one holds the words, the job's
state (`JobState`, state.json), the records `stream` sends and the hook's connections, and imports nothing of
the bundle (the hook loads it alone, into the user's processes); protocol_calls.py holds the documents of the
agent's other commands (the `JobSpec` `start` reads, the `Preflight` and `ProcessStack` answers), and imports
this one.

The conversation, for one job on one worker:

* `agent.py preflight --claim JOB` holds the worker for the job (`Preflight`) until the job's start ends it;
  the client runs `agent.py start` with a `JobSpec` (JSON) on stdin; the agent answers one line, a
  `started` event (with the job's processes) or a `start-failed` event (with the reason), and exits
  `AgentExit.OK`, or `AgentExit.BUSY` when another job holds the worker (nothing of this job started);
* the supervisor writes each line a process prints to its .rec file as a `Line` without worker, slot
  and offset (`encode_rec`); `agent.py stream` adds them in front (`frame_recs`) and sends, after a process's
  last line, an `exit` event (how it ended: a `ProcessStatus` and its exit code), and once the job is over
  a `done` event carrying the job's state (state.json, a `JobState`: a `JobStatus`, its processes' `SlotState`s,
  the `FirstFailure`);
* the hook in each Python process of the job but those tpurun starts connects its stdout and stderr to the
  supervisor's log socket at its start (`HookStream.OWN_*`, each connection starting with a `hook_header`
  line); one a script's spawner makes opens a `ctl` one at its chip, to report how its task ended (`TaskEnd`);
* the hook in any process of the job reports on a `wait` connection each time the process enters and
  leaves a runtime's rendezvous point (`Passage`); the supervisor keeps each process's latest passage per
  point in state.json ("passages") and `stream` sends a `passages` event when they change;
* `agent.py stacks` answers with a `ProcessStack` for each process of the job: the hook registered
  faulthandler for `STACKS_SIGNAL` in every Python process of it, and the agent asks those (py-spy, where
  installed, any Python process);
* `agent.py stop`, `state` and `jobs` answer with the job's state (or a list of them) as JSON (`JobState`).

Every record is one JSON object per line; `decode` reads any of them, `encode` writes them.

Words: a *slot* is the number a process is filed under on its worker (its `[wN/cM]` tag's M, its files
w<W>-c<C>.log, its TPURUN_CORE): a chip launch's process k, `HOST` for a host launch's one process per
worker, and for each chip process a script's spawner makes, the index of the chip it is bound to. A *chip*
is a physical chip (TPU_VISIBLE_CHIPS), a *core* a TensorCore or what the user's `--cores`/`--core` count
(PJRT devices), a *device* a PJRT device. On the wire a slot keeps its old key: "core" ("c" in a line).
"""

from __future__ import annotations

import json
from enum import Enum, IntEnum

TYPE_CHECKING = False  # typing is not imported on a worker (see the records below); type checkers read True
if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Sequence
    from typing import Any, Union

# ---------------------------------------------------------------- names


class Word(str, Enum):
    """A word of the protocol: equal to its wire value, and printed as it (`f"{status}"` is `exited`)."""

    def __str__(self) -> str:
        return str(self.value)


class AgentExit(IntEnum):
    """The exit codes of `agent.py COMMAND` (and of the bundle's runner, for a worker without the bundle)."""

    OK = 0
    INTERNAL = 1  # the agent failed (its message on stderr)
    USAGE = 2  # bad usage, or no such job on this worker
    BUSY = 3  # `start`: another job runs on this worker or claims it; nothing of this job started
    RELAY_STREAMS = 4  # `preflight --claim` forked by a relay's zygote: its job started; the relay streams it
    MISSING = 93  # the bundle is not installed on the worker (yet): install it and run the command again


class Launch(Word):
    """How a job's processes are made (`train --launch`): lower case, like the command line's other choices."""

    host = "host"  # one process per worker; the script's spawner makes the chip processes, the hook files them
    chip = "chip"  # one process per chip, started by the agent


class JobStatus(Word):
    """A job's state on one worker (state.json's "status"), as its agent writes it. How the whole job ended is
    tpurun's to judge from every worker's (job/ends.py's `End`)."""

    STARTING = "starting"  # `start` wrote the spec; the supervisor is not up yet
    RUNNING = "running"  # until every process is gone, even while it stops; a `train --detach` job once started
    FINISHED = "finished"  # every process exited 0
    STOPPED = "stopped"  # stopped on request (cancel, Ctrl-C, the client gone, `--on-notice stop`)
    FAILED = "failed"  # a process failed, or the job could not start (its pre-commands, `train --setup`)
    LOST = "lost"  # the supervisor was killed (or its host went down): nobody watches the processes any more
    SPENT = "spent"  # stopped by its supervisor at its spend limit (`train --budget`: JobSpec.spend_until)


# the states of a job's part that has ended on its worker (`cancel` finding it there has nothing to stop)
TERMINAL = frozenset({JobStatus.FINISHED, JobStatus.STOPPED, JobStatus.FAILED, JobStatus.LOST, JobStatus.SPENT})


class ProcessStatus(Word):
    """How one process of a job stands or ended (a process slot: the per-worker process in a host launch,
    one per chip otherwise, and each chip process a script's spawner makes)."""

    PENDING = "pending"  # not started yet
    RUNNING = "running"
    EXITED = "exited"  # ended by itself: its exit code says how
    FAILED = "failed"  # its spawner task reported a failure
    KILLED = "killed"  # ended by the job's stop (after a sibling failed, or on request)
    DIED = "died"  # ended without a word (killed from outside, crashed): blamed as the job's first failure


class Event(Word):
    """The "event" of a record that is not a line."""

    STARTED = "started"  # `start`: the supervisor runs the job
    START_FAILED = "start-failed"  # `start`: the job could not start (a pre-command failed, ...)
    EXIT = "exit"  # `stream`: a process ended, after its last line
    DONE = "done"  # `stream`: the job is over on this worker; its state follows
    PASSAGES = "passages"  # `stream`: a process entered or left a rendezvous point (`Passages`)
    NOTICE = "notice"  # `stream`: a host event was announced for a worker of the job (`Notice`)


class NoticeKind(Word):
    """What a notice announces for a worker's VM: its host's maintenance, or its preemption."""

    MAINTENANCE = "maintenance"
    PREEMPTED = "preempted"


class Source(Word):
    """Which of a process's outputs a line came from."""

    OUT = "out"
    ERR = "err"


class HookStream(Word):
    """The hook's connections to the supervisor's log socket, one per kind."""

    OUT = "out"
    ERR = "err"
    CTL = "ctl"  # reports: how the spawner's task ended (`TaskEnd`), faulthandler's crash report
    WAIT = "wait"  # any process of the job, the host's too: its passages through rendezvous points (`Passage`)
    OWN_OUT, OWN_ERR = "own-out", "own-err"  # a Python process's own stdout/stderr from its start (HOST: no chip yet)


class TaskEnd(Word):
    """How a spawner's task in a chip process ended, as the hook reports it on its ctl connection."""

    OK = "ok"
    FAILED = "failed"


JOB_GRACE = 5.0  # seconds between SIGTERM and SIGKILL when a job stops
DEFAULT_PRE_TIMEOUT = 300.0  # seconds a pre-command may take
DEFAULT_LEASE = 60.0  # an attached job whose client has had no stream for this long is stopped
HOST = -1  # the slot a host launch's one process per worker is filed under (its files: w<W>.log, .rec)
HOOK_ACCEPTED = b"ok\n"  # the supervisor's answer to a hook connection it files under the process
# `agent.py --first COMMAND ...`: COMMAND's input, base64, in this variable of the agent's environment (which only
# its user can read, unlike its command line; bundle.program_argv's shell puts it there)
FIRST_INPUT = "TPURUN_FIRST_INPUT"
NOTICE_LEAD = 600.0  # a maintenance window is told to a job in its last seconds before it (agent_notices)
# `tpurun stacks`: the signal on which faulthandler writes a process's stacks. SIGURG (23 on Linux): its default
# action is to ignore it, so a process that cannot answer (it exec'd another program since) is not harmed; and
# the agent sends it only to a process whose kernel record says it catches it
STACKS_SIGNAL = 23
# `tpurun profile`: the variable giving a job's processes the first port of their profiler servers (the hook starts one
# in each process once its runtime is loaded), each on the first free port of its slot's `profile_ports`
PROFILE_PORT = "TPURUN_PROFILE_PORT"


def profile_ports(first: int, slot: int, worker: int = 0) -> list[int]:  # the host process's (HOST: -1) from FIRST+WORKER
    ports = range(first + 1 + slot, min(first + 1 + slot + 64 * 32, 65536), 64)  # *64, chip C's +1+C; then +64 where
    return [*ports[worker % 32 :], *ports[: worker % 32]]  # hosts share one network (the emulator's): none race for one

# ---------------------------------------------------------------- records
# Classes with __slots__ and their own __init__, not dataclasses: on every worker three processes import this
# module at each job's start (`start`, the supervisor, `stream`), and so does the hook in every chip process;
# `dataclasses` and `typing` would cost each of them 10 ms of a CPU the job's processes are starting on
# (docs/benchmarks.md). A client makes a Line for every line a job prints: slots make that cheaper too.


class RecordBase:
    """A record: its fields are its __slots__; equal to a record of its class with equal fields."""

    __slots__: tuple[str, ...] = ()
    __hash__ = None  # type: ignore[assignment]  # mutable, as a dataclass is

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in self.__slots__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{f}={getattr(self, f)!r}' for f in self.__slots__)})"

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}


class Line(RecordBase):
    """One line a process printed: worker, slot, byte offset after its record in the .rec file."""

    __slots__ = ("worker", "slot", "offset", "source", "time", "text")

    def __init__(self, worker: int, slot: int, offset: int, source: Source, time: float, text: str) -> None:
        self.worker = worker
        self.slot = slot
        self.offset = offset
        self.source = source
        self.time = time
        self.text = text


class Exit(RecordBase):
    """A process ended: how (its status) and its exit code (None where it died unreported)."""

    __slots__ = ("worker", "slot", "code", "status")

    def __init__(self, worker: int, slot: int, code: int | None, status: ProcessStatus) -> None:
        self.worker = worker
        self.slot = slot
        self.code = code
        self.status = status


class Done(RecordBase):
    """The job is over on a worker: its state there (state.json's)."""

    __slots__ = ("worker", "state")

    def __init__(self, worker: int, state: JobState) -> None:
        self.worker = worker
        self.state = state


class Passage(RecordBase):
    """A process's way through a rendezvous point (jax.distributed.initialize, init_process_group, ...): AT
    names it; ENTERED and LEFT are the worker's clock, LEFT None while the process is still inside."""

    __slots__ = ("at", "entered", "left")

    def __init__(self, at: str, entered: float, left: float | None = None) -> None:
        self.at = at
        self.entered = entered
        self.left = left

    @classmethod
    def from_dict(cls, data: Any) -> Passage:
        """A passage as state.json or the hook writes it, or ValueError."""
        try:
            left = data.get("left")
            return cls(str(data["at"]), float(data["entered"]), None if left is None else float(left))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a passage: {data!r}") from e


class Passages(RecordBase):
    """`stream`: the latest passage of a process through each rendezvous point it reached, oldest first."""

    __slots__ = ("worker", "slot", "passages")

    def __init__(self, worker: int, slot: int, passages: list[Passage]) -> None:
        self.worker = worker
        self.slot = slot
        self.passages = passages


class Started(RecordBase):
    """`start`'s answer: the job runs, under its supervisor, with each process's entry of the state (CORES)."""

    __slots__ = ("job", "worker", "supervisor_pid", "cores")

    def __init__(self, job: str, worker: int, supervisor_pid: int, cores: list[SlotState]) -> None:
        self.job = job
        self.worker = worker
        self.supervisor_pid = supervisor_pid
        self.cores = cores


class StartFailed(RecordBase):
    """`start`'s answer when nothing of the job runs, and why."""

    __slots__ = ("job", "reason")

    def __init__(self, job: str, reason: str) -> None:
        self.job = job
        self.reason = reason


class Notice(RecordBase):
    """A host event announced for WORKER's VM (its metadata server said so, SEEN on that worker's clock) and
    what the job's processes were told (ACTION, `train --on-notice`'s): by DEADLINE (the window's start, the
    preemption's end of notice; None: not known) the host may go. DETAIL: the metadata's own words."""

    __slots__ = ("kind", "worker", "seen", "deadline", "action", "detail")

    def __init__(
        self, kind: NoticeKind, worker: int, seen: float, deadline: float | None, action: str, detail: str = ""
    ) -> None:
        self.kind, self.worker, self.seen, self.deadline = kind, worker, seen, deadline
        self.action, self.detail = action, detail

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["kind"] = self.kind.value
        return data

    @classmethod
    def from_dict(cls, d: Any) -> Notice:
        """A notice as state.json and the wire have it, or ValueError."""
        try:
            deadline = d.get("deadline")
            return cls(NoticeKind(d["kind"]), int(d["worker"]), float(d["seen"]), _opt(float, deadline),
                       str(d.get("action") or ""), str(d.get("detail") or ""))  # fmt: skip
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a notice: {str(d)[:100]!r}") from e


# ---------------------------------------------------------------- the job's state (state.json)
# The supervisor writes it, the agent's commands answer with it (`state`, `stop`, `jobs`, preflight's jobs, a
# `done` record), the watchdog and the client read it: through these records only. A state an older bundle wrote
# reads too (a field it lacks takes its default), and fields a newer one adds are left out.


def _opt(kind: Any, value: Any) -> Any:
    return None if value is None else kind(value)


class FirstFailure(RecordBase):
    """The process whose failure stopped the job on a worker (exit code None: died unreported), and when."""

    __slots__ = ("slot", "exit_code", "time", "worker")

    def __init__(self, slot: int, exit_code: int | None, time: float | None = None, worker: int | None = None) -> None:
        self.slot = slot
        self.exit_code = exit_code
        self.time = time
        self.worker = worker

    def to_dict(self) -> dict[str, Any]:
        return {"worker": self.worker, "core": self.slot, "exit_code": self.exit_code, "time": self.time}

    @classmethod
    def from_dict(cls, data: Any) -> FirstFailure:
        return cls(
            int(data["core"]),
            _opt(int, data.get("exit_code")),
            _opt(float, data.get("time")),
            _opt(int, data.get("worker")),
        )


class SlotState(RecordBase):
    """One process's entry in the job's state, under its slot ("core" on the wire): how it stands (and its exit
    code once it ended), its pid and process group, when it started and ended, its last line and when it printed it,
    its passages through rendezvous points (oldest first, one per point), its command line, and SPAWNED: a chip
    process a host launch's spawner made, not the agent."""

    __slots__ = (
        "slot", "status", "exit_code", "pid", "pgid", "started_at", "ended_at", "last_line", "last_line_at",
        "passages", "argv", "spawned",
    )  # fmt: skip

    def __init__(
        self,
        slot: int,
        status: ProcessStatus = ProcessStatus.PENDING,
        exit_code: int | None = None,
        pid: int | None = None,
        pgid: int | None = None,
        started_at: float | None = None,
        ended_at: float | None = None,
        last_line: str = "",
        last_line_at: float | None = None,
        passages: list[Passage] | None = None,
        argv: list[str] | None = None,
        spawned: bool = False,
    ) -> None:
        self.slot = slot
        self.status = status
        self.exit_code = exit_code
        self.pid = pid
        self.pgid = pgid
        self.started_at = started_at
        self.ended_at = ended_at
        self.last_line = last_line
        self.last_line_at = last_line_at
        self.passages = [] if passages is None else passages
        self.argv = [] if argv is None else argv
        self.spawned = spawned

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        del data["slot"]
        data["core"] = self.slot
        data["status"] = self.status.value
        data["passages"] = [p.to_dict() for p in self.passages]
        return data

    @classmethod
    def from_dict(cls, data: Any) -> SlotState:
        """A process's entry as the wire has it, or ValueError."""
        try:
            return cls(
                int(data["core"]),
                ProcessStatus(data.get("status", ProcessStatus.PENDING)),
                _opt(int, data.get("exit_code")),
                _opt(int, data.get("pid")),
                _opt(int, data.get("pgid")),
                _opt(float, data.get("started_at")),
                _opt(float, data.get("ended_at")),
                str(data.get("last_line") or ""),
                _opt(float, data.get("last_line_at")),
                [Passage.from_dict(p) for p in data.get("passages") or []],
                [str(a) for a in data.get("argv") or []],
                bool(data.get("spawned")),
            )
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a process's state: {str(data)[:100]!r}") from e


class JobState(RecordBase):
    """A job's state on one worker (state.json): its status, its supervisor's pid, when it started and ended,
    STOPPING while a stop is under way, whether it runs detached, how its processes are made, the REASON it could
    not start, its first failure and its processes (SLOTS, "cores" on the wire). What the agent's readers add:
    SUPERVISOR_ALIVE (None in state.json itself), and `stop`'s answer STATUS_BEFORE_STOP (None elsewhere)."""

    __slots__ = (
        "job_id", "worker", "status", "supervisor_pid", "started_at", "ended_at", "stopping", "detach", "launch",
        "reason", "first_failure", "slots", "supervisor_alive", "status_before_stop", "notice",
    )  # fmt: skip

    def __init__(
        self,
        job_id: str,
        worker: int,
        status: JobStatus,
        supervisor_pid: int | None = None,
        started_at: float | None = None,
        ended_at: float | None = None,
        stopping: bool = False,
        detach: bool = False,
        launch: Launch = Launch.chip,
        reason: str = "",
        first_failure: FirstFailure | None = None,
        slots: list[SlotState] | None = None,
        supervisor_alive: bool | None = None,
        status_before_stop: JobStatus | None = None,
        notice: Notice | None = None,  # the first notice of a host event the job got (agent_notices)
    ) -> None:
        self.job_id = job_id
        self.worker = worker
        self.status = status
        self.supervisor_pid = supervisor_pid
        self.started_at = started_at
        self.ended_at = ended_at
        self.stopping = stopping
        self.detach = detach
        self.launch = launch
        self.reason = reason
        self.first_failure = first_failure
        self.slots = [] if slots is None else slots
        self.supervisor_alive = supervisor_alive
        self.status_before_stop = status_before_stop
        self.notice = notice

    def slot(self, slot: int) -> SlotState | None:
        """The entry of the process in SLOT, if it has one."""
        return next((s for s in self.slots if s.slot == slot), None)

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        del data["slots"]
        data["cores"] = [s.to_dict() for s in self.slots]
        data["status"] = self.status.value
        data["launch"] = self.launch.value
        data["first_failure"] = None if self.first_failure is None else self.first_failure.to_dict()
        data["notice"] = None if self.notice is None else self.notice.to_dict()
        for f in ("supervisor_alive", "status_before_stop", "notice"):  # absent where there is none
            if data[f] is None:
                del data[f]
        if self.status_before_stop is not None:
            data["status_before_stop"] = self.status_before_stop.value
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> JobState:
        """A job's state as the wire (or state.json) has it, or ValueError."""
        try:
            failure = data.get("first_failure")
            return cls(
                str(data.get("job_id") or ""),
                int(data.get("worker") or 0),
                JobStatus(data["status"]),
                _opt(int, data.get("supervisor_pid")),
                _opt(float, data.get("started_at")),
                _opt(float, data.get("ended_at")),
                bool(data.get("stopping")),
                bool(data.get("detach")),
                Launch(data.get("launch") or Launch.chip),
                str(data.get("reason") or ""),
                FirstFailure.from_dict(failure) if failure else None,
                [SlotState.from_dict(s) for s in data.get("cores") or []],
                _opt(bool, data.get("supervisor_alive")),
                _opt(JobStatus, data.get("status_before_stop")),
                _opt(Notice.from_dict, data.get("notice")),
            )
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a job's state: {str(data)[:100]!r}") from e

    @classmethod
    def from_json(cls, text: str | bytes) -> JobState:
        """A job's state, or ValueError."""
        return cls.from_dict(json.loads(text))


def job_states(raw: bytes | str) -> list[JobState]:
    """`agent.py jobs`'s answer, the state of every job on a worker; or ValueError."""
    data = json.loads(raw)
    if not isinstance(data, list):
        raise ValueError(f"not a list of jobs' states: {str(data)[:100]!r}")
    return [JobState.from_dict(d) for d in data]


if TYPE_CHECKING:
    Record = Union[Line, Exit, Done, Passages, Started, StartFailed, Notice]  # noqa: UP007 (Python 3.8 has no X | Y)

# The .rec line's fixed start: `stream` splices the worker, slot and offset in front of it without
# re-encoding, which is what keeps streaming fast; its time starts at _TIME_AT (every source's name has
# three letters). The supervisor and `stream` handle lines a read's worth at a time (encode_recs,
# frame_recs), the client likewise (decode_lines): no call per line.
_REC_HEAD = b'{"s":"'
_TIME_AT = len(_REC_HEAD) + 3 + len(b'","t":')
assert all(len(s.value) == 3 for s in Source)


def encode_recs(source: Source, t: float, texts: Iterable[str]) -> bytes:
    """Lines a process printed on SOURCE, read at T, as the supervisor writes them to the process's .rec
    file: one record (a `Line` without its place) each."""
    head = b'%s%s","t":%.6f,"l":' % (_REC_HEAD, source.value.encode(), t)
    dumps = json.dumps
    return b"".join([head + dumps(text).encode() + b"}\n" for text in texts])


def encode_rec(source: Source, t: float, text: str) -> bytes:
    """One line as the supervisor writes it to the process's .rec file."""
    return encode_recs(source, t, (text,))


def frame_recs(worker: int, slot: int, offset: int, recs: list[bytes]) -> tuple[list[tuple[float, bytes]], int]:
    """.rec lines (without their newlines) that follow OFFSET in the file of WORKER's process in SLOT as
    `stream` sends them (worker, slot and the offset after each in front), each with its time (what `stream`
    merges processes' lines by); and the offset after the last."""
    head = b'{"w":%d,"c":%d,"o":' % (worker, slot)
    out = []
    for rec in recs:
        offset += len(rec) + 1
        try:
            t = float(rec[_TIME_AT : rec.find(b",", _TIME_AT)])
        except ValueError:
            t = 0.0
        out.append((t, b"%s%d,%s\n" % (head, offset, rec[1:])))
    return out, offset


def encode(record: Record) -> bytes:
    """Any record as one JSON line."""
    if isinstance(record, Line):
        rec = encode_rec(record.source, record.time, record.text)[:-1]
        start = record.offset - len(rec) - 1  # a Line's offset is the one after its record
        (_, framed), *_ = frame_recs(record.worker, record.slot, start, [rec])[0]
        return framed
    if isinstance(record, Exit):
        data: dict[str, Any] = {"event": Event.EXIT.value, "w": record.worker, "c": record.slot,
                                "code": record.code, "status": record.status.value}  # fmt: skip
    elif isinstance(record, Done):
        data = {"event": Event.DONE.value, "w": record.worker, "state": record.state.to_dict()}
    elif isinstance(record, Passages):
        data = {"event": Event.PASSAGES.value, "w": record.worker, "c": record.slot,
                "passages": [p.to_dict() for p in record.passages]}  # fmt: skip
    elif isinstance(record, Notice):
        data = {"event": Event.NOTICE.value, "notice": record.to_dict()}
    elif isinstance(record, Started):
        data = {
            "event": Event.STARTED.value,
            "job": record.job,
            "worker": record.worker,
            "supervisor_pid": record.supervisor_pid,
            "cores": [c.to_dict() for c in record.cores],
        }
    else:
        data = {"event": Event.START_FAILED.value, "job": record.job, "reason": record.reason}
    return (json.dumps(data) + "\n").encode()


_SOURCES = {s.value: s for s in Source}


def decode(raw: bytes | str) -> Record | None:
    """One JSON line as a record; None for what is not one (an empty line, another program's output)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    try:
        event = data.get("event")
        if event is None:  # a line: the hot path (a dict lookup, not an Enum call, for its source)
            return Line(
                int(data["w"]), int(data["c"]), int(data["o"]), _SOURCES[data["s"]], float(data["t"]), data["l"]
            )
        if event == Event.EXIT:
            code = data.get("code")
            return Exit(
                int(data["w"]), int(data["c"]), None if code is None else int(code), ProcessStatus(data["status"])
            )
        if event == Event.DONE:
            return Done(int(data["w"]), JobState.from_dict(data["state"]))
        if event == Event.PASSAGES:
            return Passages(int(data["w"]), int(data["c"]), [Passage.from_dict(p) for p in data["passages"]])
        if event == Event.STARTED:
            cores = [SlotState.from_dict(c) for c in data["cores"]]
            return Started(str(data["job"]), int(data["worker"]), int(data["supervisor_pid"]), cores)
        if event == Event.START_FAILED:
            return StartFailed(str(data["job"]), str(data["reason"]))
        if event == Event.NOTICE:
            return Notice.from_dict(data["notice"])
    except (KeyError, TypeError, ValueError):
        return None
    return None


def decode_lines(raws: Sequence[bytes], at_once: int = 512) -> Iterator[Record]:
    """The records of RAWS, one per line (what is not one is skipped); AT_ONCE lines parsed as one JSON array where
    each is one value (a third of the CPU of a parse each), a line's record made without `decode`'s checks."""
    loads, sources, line = json.loads, _SOURCES, Line
    for at in range(0, len(raws), at_once):
        part = raws[at : at + at_once]
        try:
            parsed = loads(b"[" + b",".join(part) + b"]")
        except ValueError:
            parsed = ()
        whole = len(parsed) == len(part)  # (not: an empty line among them)
        for i, raw in enumerate(part):
            try:
                data = parsed[i] if whole else loads(raw)
                if data.get("event") is None:
                    yield line(data["w"], data["c"], data["o"], sources[data["s"]], data["t"], data["l"])
                    continue
            except (ValueError, KeyError, TypeError, AttributeError):
                pass
            rec = decode(raw)
            if rec is not None:
                yield rec


# ---------------------------------------------------------------- the hook's connections


def hook_header(slot: int, stream: HookStream, pool: bool) -> bytes:
    """The first line of a hook connection: which chip process's slot (its chip) and which stream it carries."""
    return (json.dumps({"core": slot, "stream": stream.value, "pool": pool}) + "\n").encode()


def read_hook_header(raw: bytes) -> tuple:
    """(slot, HookStream, pool) of a hook connection's first line, or ValueError. Only a `wait` connection
    or a process's own stream (not yet a chip's: `OWN_OUT`, `OWN_ERR`) may be slot HOST."""
    data = json.loads(raw or b"null")
    if not isinstance(data, dict):
        raise ValueError(f"not a hook header: {raw[:100]!r}")
    try:
        slot, stream = int(data["core"]), HookStream(data["stream"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"not a hook header: {raw[:100]!r}") from e
    if slot < 0 and not (slot == HOST and stream in (HookStream.WAIT, HookStream.OWN_OUT, HookStream.OWN_ERR)):
        raise ValueError(f"a hook header with slot {slot}")
    return slot, stream, bool(data.get("pool"))


def task_end(end: TaskEnd, code: int = 0) -> bytes:
    """The hook's report, on the ctl connection, of how the spawner's task ended."""
    return (json.dumps({"event": end.value, "code": code}) + "\n").encode()


def read_task_end(raw: bytes) -> tuple | None:
    """(TaskEnd, code) of a ctl line, or None for a line that is not a report (faulthandler's text)."""
    try:
        data = json.loads(raw)
        return TaskEnd(data["event"]), int(data.get("code") or 0)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def passage_line(passage: Passage) -> bytes:
    """The hook's report, on a `wait` connection, of a passage as it stands (on entering, then on leaving)."""
    return (json.dumps(passage.to_dict()) + "\n").encode()
