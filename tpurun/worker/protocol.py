"""The agent's protocol, written once: what the client (tpurun) and the worker agent say to each other.

Part of the agent bundle (stdlib only, Python >= 3.8). On a worker the agent, its supervisor and the hook
import it from the bundle's directory; in tpurun it is `tpurun.worker.protocol`. Nothing else spells a
record key, an event, a status or an exit code.

The conversation, for one job on one worker:

* `agent.py preflight --claim JOB` holds the worker for the job (`Preflight`) until the job's start ends it;
  the client runs `agent.py start` with a `JobSpec` (JSON) on stdin; the agent answers one line, a
  `started` event (with the job's processes) or a `start-failed` event (with the reason), and exits
  `AgentExit.OK`, or `AgentExit.BUSY` when another job holds the worker (nothing of this job started);
* the supervisor writes each line a process prints to its .rec file as a `Line` without worker, slot
  and offset (`encode_rec`); `agent.py stream` adds them in front (`frame_recs`) and sends, after a process's
  last line, an `exit` event (how it ended: a `ProcessStatus` and its exit code), and once the job is over
  a `done` event carrying the job's state (state.json: a `JobStatus`, its processes, the first failure);
* the hook in each Python process of the job but those tpurun starts connects its stdout and stderr to the
  supervisor's log socket at its start (`HookStream.OWN_*`, each connection starting with a `hook_header`
  line); one a script's spawner makes opens a `ctl` one at its chip, to report how its task ended (`TaskEnd`);
* the hook in any process of the job reports on a `wait` connection each time the process enters and
  leaves a runtime's rendezvous point (`Passage`); the supervisor keeps each process's latest passage per
  point in state.json ("passages") and `stream` sends a `passages` event when they change;
* `agent.py stacks` answers with a `ProcessStack` for each process of the job: the hook registered
  faulthandler for `STACKS_SIGNAL` in every Python process of it, and the agent asks those (py-spy, where
  installed, any Python process);
* `agent.py stop`, `state` and `jobs` answer with the job's state (or a list of them) as JSON.

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
    from collections.abc import Iterable, Iterator, Mapping
    from typing import Any, Union

    Versions = dict[str, Union[str, None]]  # noqa: UP007 (Python 3.8 has no X | Y)

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
    MISSING = 93  # the bundle is not installed on the worker (yet): install it and run the command again


class Launch(Word):
    """How a job's processes are made (`train --launch`): lower case, like the command line's other choices."""

    host = "host"  # one process per worker; the script's spawner makes the chip processes, the hook files them
    chip = "chip"  # one process per chip, started by the agent


class JobStatus(Word):
    """A job's state on one worker (state.json's "status")."""

    STARTING = "starting"  # `start` wrote the spec; the supervisor is not up yet
    RUNNING = "running"  # until every process is gone, even while it stops
    FINISHED = "finished"  # every process exited 0
    STOPPED = "stopped"  # stopped on request (cancel, Ctrl-C, the client gone)
    FAILED = "failed"  # a process failed, or the job could not start
    LOST = "lost"  # the supervisor was killed: nobody watches the processes any more


TERMINAL = frozenset({JobStatus.FINISHED, JobStatus.STOPPED, JobStatus.FAILED, JobStatus.LOST})
# how a job can have ended by itself before a stop reached it (`cancel` says it had nothing to stop)
ENDED = frozenset({JobStatus.FINISHED, JobStatus.STOPPED, JobStatus.FAILED})


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


class StackSource(Word):
    """How a process's stacks were read (`ProcessStack.source`)."""

    FAULTHANDLER = "faulthandler"  # its own faulthandler, on STACKS_SIGNAL (the hook registered it): Python frames
    PY_SPY = "py-spy"  # py-spy from outside (installed on the worker): Python frames, native ones too
    NONE = "none"  # not read: not Python, a handler of its own on the signal, or it did not answer in time


class TaskEnd(Word):
    """How a spawner's task in a chip process ended, as the hook reports it on its ctl connection."""

    OK = "ok"
    FAILED = "failed"


JOB_GRACE = 5.0  # seconds between SIGTERM and SIGKILL when a job stops
DEFAULT_PRE_TIMEOUT = 300.0  # seconds a pre-command may take
DEFAULT_LEASE = 60.0  # an attached job whose client has had no stream for this long is stopped
HOST = -1  # the slot a host launch's one process per worker is filed under (its files: w<W>.log, .rec)
HOOK_ACCEPTED = b"ok\n"  # the supervisor's answer to a hook connection it files under the process
# `tpurun stacks`: the signal on which faulthandler writes a process's stacks. SIGURG (23 on Linux): its default
# action is to ignore it, so a process that cannot answer (it exec'd another program since) is not harmed; and
# the agent sends it only to a process whose kernel record says it catches it
STACKS_SIGNAL = 23

# ---------------------------------------------------------------- records
# Classes with __slots__ and their own __init__, not dataclasses: on every worker three processes import this
# module at each job's start (`start`, the supervisor, `stream`), and so does the hook in every chip process;
# `dataclasses` and `typing` would cost each of them 10 ms of a CPU the job's processes are starting on
# (docs/benchmarks.md). A client makes a Line for every line a job prints: slots make that cheaper too.


class _Record:
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


class Line(_Record):
    """One line a process printed: worker, slot, byte offset after its record in the .rec file."""

    __slots__ = ("worker", "slot", "offset", "source", "time", "text")

    def __init__(self, worker: int, slot: int, offset: int, source: Source, time: float, text: str) -> None:
        self.worker = worker
        self.slot = slot
        self.offset = offset
        self.source = source
        self.time = time
        self.text = text


class Exit(_Record):
    """A process ended: how (its status) and its exit code (None where it died unreported)."""

    __slots__ = ("worker", "slot", "code", "status")

    def __init__(self, worker: int, slot: int, code: int | None, status: ProcessStatus) -> None:
        self.worker = worker
        self.slot = slot
        self.code = code
        self.status = status


class Done(_Record):
    """The job is over on a worker: its state.json (`process_states`, `first_failure` read it)."""

    __slots__ = ("worker", "state")

    def __init__(self, worker: int, state: dict[str, Any]) -> None:
        self.worker = worker
        self.state = state


class Passage(_Record):
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


class Passages(_Record):
    """`stream`: the latest passage of a process through each rendezvous point it reached, oldest first."""

    __slots__ = ("worker", "slot", "passages")

    def __init__(self, worker: int, slot: int, passages: list[Passage]) -> None:
        self.worker = worker
        self.slot = slot
        self.passages = passages


class Started(_Record):
    """`start`'s answer: the job runs, under its supervisor, with each process's entry of the state."""

    __slots__ = ("job", "worker", "supervisor_pid", "cores")

    def __init__(self, job: str, worker: int, supervisor_pid: int, cores: list[dict[str, Any]]) -> None:
        self.job = job
        self.worker = worker
        self.supervisor_pid = supervisor_pid
        self.cores = cores


class StartFailed(_Record):
    """`start`'s answer when nothing of the job runs, and why."""

    __slots__ = ("job", "reason")

    def __init__(self, job: str, reason: str) -> None:
        self.job = job
        self.reason = reason


if TYPE_CHECKING:
    Record = Union[Line, Exit, Done, Passages, Started, StartFailed]  # noqa: UP007 (Python 3.8 has no X | Y)

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
        data: dict[str, Any] = {
            "event": Event.EXIT.value,
            "w": record.worker,
            "c": record.slot,
            "code": record.code,
            "status": record.status.value,
        }
    elif isinstance(record, Done):
        data = {"event": Event.DONE.value, "w": record.worker, "state": record.state}
    elif isinstance(record, Passages):
        data = {
            "event": Event.PASSAGES.value,
            "w": record.worker,
            "c": record.slot,
            "passages": [p.to_dict() for p in record.passages],
        }
    elif isinstance(record, Started):
        data = {
            "event": Event.STARTED.value,
            "job": record.job,
            "worker": record.worker,
            "supervisor_pid": record.supervisor_pid,
            "cores": record.cores,
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
            return Done(int(data["w"]), dict(data["state"]))
        if event == Event.PASSAGES:
            return Passages(int(data["w"]), int(data["c"]), [Passage.from_dict(p) for p in data["passages"]])
        if event == Event.STARTED:
            return Started(str(data["job"]), int(data["worker"]), int(data["supervisor_pid"]), list(data["cores"]))
        if event == Event.START_FAILED:
            return StartFailed(str(data["job"]), str(data["reason"]))
    except (KeyError, TypeError, ValueError):
        return None
    return None


def decode_lines(raws: Iterable[bytes]) -> Iterator[Record]:
    """The records of RAWS, one per line; what is not one (an empty line) is skipped. A line record is
    made here, without `decode`'s checks of each field's type: `stream` writes them as numbers."""
    loads, sources, line = json.loads, _SOURCES, Line
    for raw in raws:
        try:
            data = loads(raw)
            if data.get("event") is None:
                yield line(data["w"], data["c"], data["o"], sources[data["s"]], data["t"], data["l"])
                continue
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
        rec = decode(raw)
        if rec is not None:
            yield rec


# ---------------------------------------------------------------- the job spec (`start`'s stdin)


class ProcessSpec(_Record):
    """One process tpurun starts on a worker, filed under SLOT (a chip launch's process index, or `HOST`).
    On the wire its slot is "core"."""

    __slots__ = ("slot", "argv", "env", "cwd")

    def __init__(self, slot: int, argv: list[str], env: dict[str, str] | None = None, cwd: str = "~") -> None:
        self.slot = slot
        self.argv = argv
        self.env = {} if env is None else env
        self.cwd = cwd

    def to_dict(self) -> dict[str, Any]:
        return {"core": self.slot, "argv": self.argv, "env": self.env, "cwd": self.cwd}

    @classmethod
    def from_dict(cls, data: Any) -> ProcessSpec:
        """A process of a job spec as the wire has it (its slot under "core"), or TypeError naming what is
        wrong: a missing or unknown field (as a call with them would raise)."""
        if not isinstance(data, dict):
            raise TypeError(f"a process is an object, not {data!r}")
        unknown = sorted(set(data) - {"core", "argv", "env", "cwd"})
        if unknown:
            raise TypeError(f"a process has unknown fields {unknown}")
        missing = [k for k in ("core", "argv") if k not in data]
        if missing:
            raise TypeError(f"a process needs {missing}")
        return cls(data["core"], data["argv"], data.get("env"), data.get("cwd", "~"))


class JobSpec(_Record):
    """What `agent.py start` reads on stdin: one worker's part of a job (CORES: one ProcessSpec per slot,
    under the wire's name)."""

    __slots__ = (
        "job_id", "worker", "cores", "launch", "detach", "down", "grace", "pre_commands", "pre_timeout",
        "lease_timeout", "allow_concurrent",
    )  # fmt: skip

    def __init__(
        self,
        job_id: str,
        worker: int,
        cores: list[ProcessSpec],
        launch: Launch = Launch.chip,
        detach: bool = False,
        down: bool = False,  # `train --down`: the TPU's watchdog deletes it once the job has ended
        grace: float = JOB_GRACE,
        pre_commands: list[Any] | None = None,  # argv lists, or {"argv": [...], "wait": false}
        pre_timeout: float = DEFAULT_PRE_TIMEOUT,
        lease_timeout: float | None = None,  # attached: DEFAULT_LEASE unless given (0: none)
        allow_concurrent: bool = False,  # start even while another job runs on the worker
    ) -> None:
        self.job_id = job_id
        self.worker = worker
        self.cores = cores
        self.launch = launch
        self.detach = detach
        self.down = down
        self.grace = grace
        self.pre_commands = [] if pre_commands is None else pre_commands
        self.pre_timeout = pre_timeout
        self.lease_timeout = lease_timeout
        self.allow_concurrent = allow_concurrent

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["cores"] = [p.to_dict() for p in self.cores]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        """The spec, or ValueError naming what is wrong with it."""
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: Any) -> JobSpec:
        """The spec, or ValueError naming what is wrong with it."""
        data = dict(data) if isinstance(data, dict) else data
        if not isinstance(data, dict) or not data.get("job_id") or not data.get("cores"):
            raise ValueError("the job spec needs job_id and a non-empty cores list")
        unknown = sorted(set(data) - set(cls.__slots__))
        if unknown:
            raise ValueError(f"the job spec has unknown fields {unknown}")
        try:
            cores = [ProcessSpec.from_dict(p) for p in data.pop("cores")]
            launch = Launch(data.pop("launch", Launch.chip))
            return cls(cores=cores, launch=launch, **data)
        except TypeError as e:
            raise ValueError(f"the job spec is malformed: {e}") from e


# ---------------------------------------------------------------- the job's state (state.json)


class ProcessState(_Record):
    """One process's entry in the job's state."""

    __slots__ = ("slot", "status", "exit_code")

    def __init__(self, slot: int, status: ProcessStatus, exit_code: int | None) -> None:
        self.slot = slot
        self.status = status
        self.exit_code = exit_code


def process_states(state: dict[str, Any]) -> list[ProcessState]:
    """The processes of a job's state (state.json, a `done` record's, `stop`'s answer)."""
    return [
        ProcessState(int(c["core"]), ProcessStatus(c["status"]), c.get("exit_code")) for c in state.get("cores", [])
    ]


def slot_passages(state: Mapping[str, Any]) -> dict[int, list[Passage]]:
    """Each process's passages through rendezvous points in a job's state (slot -> oldest first)."""
    out = {}
    for c in state.get("cores", []):
        try:
            out[int(c["core"])] = [Passage.from_dict(p) for p in c.get("passages") or []]
        except (KeyError, TypeError, ValueError):
            continue
    return out


class FirstFailure(_Record):
    """The process whose failure stopped the job on a worker (exit code None: died unreported), and when."""

    __slots__ = ("slot", "exit_code", "time")

    def __init__(self, slot: int, exit_code: int | None, time: float | None = None) -> None:
        self.slot = slot
        self.exit_code = exit_code
        self.time = time


def first_failure(state: Mapping[str, Any]) -> FirstFailure | None:
    """The process whose failure stopped the job on this worker, if one did."""
    origin = state.get("first_failure") or {}
    return FirstFailure(int(origin["core"]), origin.get("exit_code"), origin.get("time")) if "core" in origin else None


# ---------------------------------------------------------------- preflight (before a job starts)


class Preflight(_Record):
    """`agent.py preflight`'s answer before `train` starts a job: the jobs there (the state of each), what decides
    a job there (the job's Python, the versions of the packages asked about: None where not installed), HELD_BY:
    the job that runs there or claims it for its start ("" if none; with `--claim JOB`: it is JOB's now)."""

    __slots__ = ("jobs", "python", "executable", "packages", "held_by")

    def __init__(
        self, jobs: list[dict[str, Any]], python: str, executable: str, packages: Versions, held_by: str = ""
    ) -> None:
        self.jobs = jobs
        self.python = python
        self.executable = executable
        self.packages = packages
        self.held_by = held_by

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Preflight:
        """The answer, or ValueError."""
        data = json.loads(text)
        try:
            jobs, packages, held_by = list(data["jobs"]), dict(data["packages"]), str(data["held_by"])
            return cls(jobs, str(data["python"]), str(data["executable"]), packages, held_by)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a preflight answer: {text[:100]!r}") from e


# ---------------------------------------------------------------- stacks (`agent.py stacks`)


class ThreadStack(_Record):
    """One thread's stack, innermost frame first: each frame [file, line, function, its source line] (a native
    frame of py-spy's: [library, 0, function, ""]). MAIN: the process's main thread."""

    __slots__ = ("name", "main", "frames")

    def __init__(self, name: str, main: bool, frames: list[list[Any]]) -> None:
        self.name = name
        self.main = main
        self.frames = frames

    @classmethod
    def from_dict(cls, data: Any) -> ThreadStack:
        return cls(
            str(data["name"]),
            bool(data["main"]),
            [[str(f), int(n), str(fn), str(src)] for f, n, fn, src in data["frames"]],
        )


class ProcessStack(_Record):
    """One process of a job on a worker and its threads' stacks: its SLOT (HOST, a chip's; for a process one of
    them started, CHILD), its command line and working directory, how its stacks were read, its THREADS and
    DUMP, the text the reader wrote (faulthandler's or py-spy's), WHY none where none."""

    __slots__ = ("pid", "ppid", "slot", "child", "argv", "cwd", "source", "threads", "dump", "why")

    def __init__(
        self,
        pid: int,
        ppid: int,
        slot: int | None,
        child: bool,
        argv: str,
        cwd: str,
        source: StackSource,
        threads: list[ThreadStack] | None = None,
        dump: str = "",
        why: str = "",
    ) -> None:
        self.pid = pid
        self.ppid = ppid
        self.slot = slot
        self.child = child
        self.argv = argv
        self.cwd = cwd
        self.source = source
        self.threads = [] if threads is None else threads
        self.dump = dump
        self.why = why

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["threads"] = [t.to_dict() for t in self.threads]
        return data

    @classmethod
    def from_dict(cls, data: Any) -> ProcessStack:
        """A process as `agent.py stacks` writes it, or ValueError."""
        try:
            slot = data.get("slot")
            return cls(
                int(data["pid"]),
                int(data["ppid"]),
                None if slot is None else int(slot),
                bool(data["child"]),
                str(data["argv"]),
                str(data["cwd"]),
                StackSource(data["source"]),
                [ThreadStack.from_dict(t) for t in data.get("threads") or []],
                str(data.get("dump") or ""),
                str(data.get("why") or ""),
            )
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a process's stacks: {str(data)[:100]!r}") from e


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
