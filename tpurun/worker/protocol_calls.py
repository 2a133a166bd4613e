"""The agent's protocol, its commands' documents: what `agent.py start` reads on stdin (a `JobSpec`: one
`ProcessSpec` per process, kept in the job's directory), what `stop` leaves there for the supervisor (a
`StopRequest`), what `preflight` answers before a job (`Preflight`: the jobs there, each a `JobState`) and what
`stacks` answers (a `ProcessStack` per process), and `profile` (a `ProfileAnswer`). The words, the job's state, the records `stream` sends and the
hook's connections are protocol.py's; this module imports it (the bundle's files sit side by side on a worker;
tpurun imports both as `tpurun.worker.protocol_calls` and `tpurun.worker.protocol`). What tpurun tells the TPU's
watchdog and what the watchdogs publish are watchdog_reports.py's.

Part of the agent bundle (stdlib only, Python >= 3.8); its records are protocol.py's kind (`RecordBase`)."""

from __future__ import annotations

import base64
import json

if __package__:  # tpurun, the tests
    from tpurun.worker.protocol import DEFAULT_PRE_TIMEOUT, JOB_GRACE, JobState, Launch, RecordBase, Word
else:  # the bundle on a worker, whose files sit side by side
    from protocol import DEFAULT_PRE_TIMEOUT, JOB_GRACE, JobState, Launch, RecordBase, Word  # type: ignore[no-redef]

TYPE_CHECKING = False  # typing is not imported on a worker (see protocol.py's records); type checkers read True
if TYPE_CHECKING:
    from typing import Any, Union

    Versions = dict[str, Union[str, None]]  # noqa: UP007 (Python 3.8 has no X | Y)


# ---------------------------------------------------------------- the job spec (`start`'s stdin)


class ProcessSpec(RecordBase):
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


# `train --on-notice` (JobSpec.on_notice): signal:NAME to every process of the job, file (the notice written where
# its processes' TPURUN_NOTICE_FILE says), stop (the job)
ON_SIGNAL, ON_FILE, ON_STOP = "signal:", "file", "stop"


class JobSpec(RecordBase):
    """What `agent.py start` reads on stdin: one worker's part of a job (CORES: one ProcessSpec per slot,
    under the wire's name)."""

    __slots__ = (
        "job_id", "worker", "cores", "launch", "detach", "down", "grace", "pre_commands", "pre_timeout",
        "lease_timeout", "allow_concurrent", "on_notice", "notice_address", "peers", "notice_port", "notice_key",
        "spend_for",
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
        on_notice: str = "",  # what its processes are told of a host event (ON_SIGNAL+NAME, ON_FILE, ON_STOP; "": none)
        notice_address: str = "",  # where this worker's supervisor hears notices: its internal address
        peers: list[str] | None = None,  # whom it tells a notice: worker 0 every other worker, the others worker 0
        notice_port: int = 0,  # the port every worker's supervisor hears its peers' notices on
        notice_key: str = "",  # the job's secret that signs its notices (hex)
        spend_for: float | None = None,  # `train --budget`: seconds from the supervisor's start to its stop's end
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
        self.on_notice = on_notice
        self.notice_address = notice_address
        self.peers = [] if peers is None else peers
        self.notice_port = notice_port
        self.notice_key = notice_key
        self.spend_for = spend_for

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


class StopRequest(RecordBase):
    """What `agent.py stop` leaves in the job's directory (agent_files.STOP) before it signals the job's supervisor,
    which reads it then: GRACE, the seconds between SIGTERM and SIGKILL; AT, when it was asked (the worker's clock)."""

    __slots__ = ("grace", "at")

    def __init__(self, grace: float, at: float) -> None:
        self.grace = grace
        self.at = at

    @classmethod
    def from_dict(cls, data: Any) -> StopRequest:
        """The request, or ValueError."""
        try:
            return cls(float(data["grace"]), float(data["at"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a stop request: {str(data)[:100]!r}") from e


# ---------------------------------------------------------------- preflight (before a job starts)


class Preflight(RecordBase):
    """`agent.py preflight`'s answer before `train` starts a job: the jobs there (the state of each), what decides
    a job there (the job's Python, the versions of the packages asked about: None where not installed), HELD_BY:
    the job that runs there or claims it for its start ("" if none; with `--claim JOB`: it is JOB's now)."""

    __slots__ = ("jobs", "python", "executable", "packages", "held_by")

    def __init__(
        self, jobs: list[JobState], python: str, executable: str, packages: Versions, held_by: str = ""
    ) -> None:
        self.jobs = jobs
        self.python = python
        self.executable = executable
        self.packages = packages
        self.held_by = held_by

    def to_json(self) -> str:
        data = self.to_dict()
        data["jobs"] = [j.to_dict() for j in self.jobs]
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Preflight:
        """The answer, or ValueError."""
        data = json.loads(text)
        try:
            jobs = [JobState.from_dict(j) for j in data["jobs"]]
            packages, held_by = dict(data["packages"]), str(data["held_by"])
            return cls(jobs, str(data["python"]), str(data["executable"]), packages, held_by)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a preflight answer: {text[:100]!r}") from e


CLAIM_START = b"start"  # the word that turns a held claim into its job's start (`claim_start`)


def claim_start(spec: bytes, stream: bool) -> bytes:
    """The line a held `preflight --claim JOB` is told to start JOB with (the JobSpec SPEC) in the same process,
    then (STREAM) to stream it attached, as `agent.py --first start stream JOB --follow --attached` would."""
    return CLAIM_START + (b" stream " if stream else b" only ") + base64.b64encode(spec) + b"\n"


def read_claim_start(line: bytes) -> tuple[bytes, bool] | None:
    """(the spec, whether to stream after) of a `claim_start` line; None where LINE is not one (ValueError where
    it is one, malformed)."""
    word, _, rest = line.strip().partition(b" ")
    if word != CLAIM_START:
        return None
    how, _, data = rest.partition(b" ")
    if how not in (b"stream", b"only"):
        raise ValueError("a claim's start says `stream` or `only`")
    return base64.b64decode(data, validate=True), how == b"stream"


# ---------------------------------------------------------------- stacks (`agent.py stacks`)


class StackSource(Word):
    """How a process's stacks were read (`ProcessStack.source`)."""

    FAULTHANDLER = "faulthandler"  # its own faulthandler, on STACKS_SIGNAL (the hook registered it): Python frames
    PY_SPY = "py-spy"  # py-spy from outside (installed on the worker): Python frames, native ones too
    NONE = "none"  # not read: not Python, a handler of its own on the signal, or it did not answer in time


class ThreadStack(RecordBase):
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


class ProcessStack(RecordBase):
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


# ---------------------------------------------------------------- profile (`agent.py profile`)


class ProcessProfile(RecordBase):
    """One process's capture on a worker (`agent.py profile`): its SLOT and the PORT its profiler server was asked
    on, the FILE it wrote (relative to the answer's `ProfileAnswer.path`; "": none, WHY) and its size."""

    __slots__ = ("slot", "port", "file", "size", "why")

    def __init__(self, slot: int, port: int, file: str = "", size: int = 0, why: str = "") -> None:
        self.slot = slot
        self.port = port
        self.file = file
        self.size = size
        self.why = why


class ProfileAnswer(RecordBase):
    """What `agent.py profile` did on a worker: PATH, the session's directory there (relative to the home where it
    is under it), each process's capture, how many seconds after the time asked the capture began (LATE; the
    processes start tracing at the time asked, or at once where it had passed), and ENDED: the job runs no more
    here (nothing captured)."""

    __slots__ = ("path", "processes", "late", "ended")

    def __init__(self, path: str, processes: list[ProcessProfile], late: float = 0.0, ended: bool = False) -> None:
        self.path = path
        self.processes = processes
        self.late = late
        self.ended = ended

    def to_json(self) -> str:
        data = self.to_dict()
        data["processes"] = [p.to_dict() for p in self.processes]
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ProfileAnswer:
        """An answer as `agent.py profile` prints it, or ValueError."""
        try:
            data = json.loads(text)
            procs = [
                ProcessProfile(int(p["slot"]), int(p["port"]), str(p["file"]), int(p["size"]), str(p["why"]))
                for p in data["processes"]
            ]
            return cls(str(data["path"]), procs, float(data["late"]), bool(data["ended"]))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a profile answer: {text[:100]!r}") from e
