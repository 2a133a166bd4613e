"""Every selected worker of a target, reached at once: the one road from `job/`, `sync/` and the commands
to the workers. A `Fleet` offers a few declarative operations, and every answer and record it hands back
names its worker:

* `connect`: reach every worker, at most `connect_window()` connection attempts in flight at once;
* `run`: an argv on every worker to completion (exec, a job's setup), each with its own variables, each
  worker's starting the moment it is reached where the fleet is not connected yet;
* `call`: a program (a bundle program, installed where missing, or any argv) with each worker's own input,
  each worker's `Answer` back (preflight, jobs, stacks, stop, the probe, the watchdog's start);
* `open` and `answer`: a program left running on every worker with its stdin open (a job's claim holds
  the workers while the `Session` lasts);
* `follow`: an agent's records from every worker under a lifeline (a job's attempt, `logs`): closing it
  stops the job there, a broken stream is opened again where asked;
* `converse`: a helper program on every worker spoken to over a byte `Pipe` (sync pushes one stream to
  many, download pulls), helpers started as soon as each worker is connected;
* `chorus`: a helper program on many workers spoken to all at once, what is said to many said once (sync).

`threads.Threads` is the first implementation: one thread per worker of this machine. `relays.Relays` is
the second: this machine reaches a few workers, and relays on them reach the rest. Callers hold a `Fleet`
and never ask which.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, TypeVar

from tpurun import config
from tpurun.errors import UnreachableError, UsageError
from tpurun.transport.runner import RUN_GRACE, LineSink, Pipe, Runner, Stream, Worker
from tpurun.worker import protocol

T = TypeVar("T")


def connect_window() -> int:
    """How many workers are being connected to at once, at most (TPURUN_CONNECT_WINDOW)."""
    try:
        window = config.CONNECT_WINDOW.integer()
    except ValueError:
        raise UsageError("TPURUN_CONNECT_WINDOW must be a whole number of connections (1 or more)") from None
    if window < 1:
        raise UsageError("TPURUN_CONNECT_WINDOW must be 1 or more")
    return window


@dataclass
class RunResult:
    """How `run` went on one worker."""

    worker: int
    exit_code: int | None  # None: never ran (unreachable)
    error: str = ""  # why it could not run
    stopped: bool = False  # stopped by tpurun (fail-fast, Ctrl-C)
    duration: float = 0.0


@dataclass(frozen=True)
class Call:
    """What one worker runs for `call`, `open` or `follow`: a file of tpurun's worker bundle (installed where
    missing) run by a Python, or any argv; with INPUT on its stdin. Made by `program` or `command`."""

    args: tuple[str, ...]  # the program's arguments, or the whole argv of a command
    input: bytes = b""
    program: str = ""  # the bundle's file ("": ARGS is a whole command)
    python: str = ""  # what runs the program
    first: tuple[str, bytes] | None = None  # a command of the same program run first (bundle.program_argv)

    @classmethod
    def program_of(
        cls, python: str, program: str, *args: str, input: bytes = b"", first: tuple[str, bytes] | None = None
    ) -> Call:
        """PROGRAM of the bundle with ARGS, run by PYTHON."""
        return cls(tuple(args), input, program, python, first)

    @classmethod
    def command(cls, argv: Sequence[str], input: bytes = b"") -> Call:
        return cls(tuple(argv), input)


@dataclass(frozen=True)
class Answer:
    """One worker's answer to a `call`: its exit code and output, or why there is none."""

    worker: int
    rc: int | None  # None: no answer (the worker could not be reached, or stopped answering)
    out: bytes = b""
    err: str = ""
    error: str = ""  # why there is no answer
    sent: float = 0.0  # when it was sent, and when the answer came (this machine's clock, time.time())
    answered: float = 0.0

    def why(self) -> str:
        """The last line of what went wrong: the error, else stderr's last line, else the exit code."""
        if self.error:
            return self.error
        return (self.err.strip().splitlines() or [f"exit {self.rc}"])[-1]


class Session:
    """A program left running on one worker with its stdin open (`Fleet.open`): the hold lasts while it runs."""

    worker: int

    def line(self, say: bytes | None, wait: float) -> str | None:
        """Send SAY (None: close stdin), then the first line of the answer; None when it ended without one
        (`ended` says how). Raises UnreachableError when no answer came within WAIT seconds."""
        raise NotImplementedError

    def alive(self) -> bool:
        """Whether the program still runs."""
        raise NotImplementedError

    def ended(self) -> tuple[int, str]:
        """(exit code, stderr) once it ended."""
        raise NotImplementedError

    def release(self) -> None:
        """End its stdin: the program ends (and lets go of what it holds)."""
        raise NotImplementedError

    def wait_end(self, deadline: float) -> None:
        """Wait until it has ended, or DEADLINE (monotonic) has passed."""
        raise NotImplementedError


class Chorus:
    """A helper program on many workers spoken to all at once (`Fleet.chorus`): what is said to many is said
    once (down each relay's link once, however many workers below it hear it; read once and left for each
    worker's own writer on this machine), and what they answer is read as it comes, keyed by worker. `say`
    may be called from several threads at once, for different workers."""

    workers: list[int]  # the workers whose helper started
    failed: dict[int, str]  # {worker: why its helper could not start}

    def __init__(self) -> None:
        # what each implementation's readers fill, under CHANGED (notified at each change): each worker's helper's
        # output not heard yet, and how each ended
        self.changed = threading.Condition()
        self.out: dict[int, bytearray] = {}
        self.ends: dict[int, tuple[int | None, bytes]] = {}

    def say(self, workers: Collection[int], data: bytes) -> None:
        """DATA to the helper of each of WORKERS (those still running), in the order said. It may wait while
        one of them is far behind (what waits for each worker is bounded), never for a connection's write."""
        raise NotImplementedError

    def heard(self, wait: float) -> dict[int, bytes]:
        """What each worker's helper wrote since the last call ({} when nothing came within WAIT seconds)."""
        with self.changed:
            if not any(self.out.values()):
                self.changed.wait(wait)
            got = {w: bytes(b) for w, b in self.out.items() if b}
            for b in self.out.values():
                b.clear()
            return got

    def ended(self, worker: int) -> tuple[int | None, bytes] | None:
        """None while WORKER's helper runs; then (its exit code, or None where the connection ended; stderr, or
        why the connection ended, in a line that does not name the worker)."""
        with self.changed:  # not while what it wrote before its end waits to be heard
            return None if self.out.get(worker) else self.ends.get(worker)

    def close(self) -> None:
        """End every helper's stdin (and stop reading them)."""
        raise NotImplementedError


def lost_connection(cause: BaseException | None) -> str:
    """Why a helper's connection, not the helper, ended, in one line that leaves its worker for the caller to
    name: what the transport said of it (CAUSE, an UnreachableError), where it said anything."""
    said = str(cause) if isinstance(cause, UnreachableError) else ""
    if said.startswith("worker ") and "): " in said:  # the worker is named by the caller already
        said = said.split("): ", 1)[1]
    return f"the connection was lost ({said})" if said else "the connection was lost"


# A read's worth of records from a worker's stream: SOURCE is the worker the stream belongs to (for a record
# that names no worker: StartFailed); every other record names its own.
Take: TypeAlias = "Callable[[int, Iterable[protocol.Record]], None]"


class Helper(Protocol):
    """A helper program's argv on a worker, given the worker's PYTHON. BUNDLED: the worker has this version's
    bundle for certain (a relayed one: its relay runs from it), so the bundle's own copy runs, as a program of the
    bundle (bundle.program_argv: what a relay's zygote forks instead of starting an interpreter)."""

    def __call__(self, python: str, bundled: bool = False) -> Sequence[str]: ...


Ended = Callable[[int, int, str, bool], bool]  # (worker, exit code, stderr, its Done came) -> open it again?
Talk = Callable[[Worker, Callable[[], Pipe]], None]  # one worker's conversation; the callable opens its pipe


class Fleet:
    """The selected workers of one target; see the module's docstring for the operations."""

    @property
    def workers(self) -> list[Worker]:
        """The selected workers, in order."""
        raise NotImplementedError

    @property
    def unreached(self) -> dict[int, str]:
        """{worker: why} for the workers the last `connect` could not reach (the operations leave them out)."""
        raise NotImplementedError

    def connect(self, *, helper: Helper | None = None) -> dict[int, str]:
        """Reach every selected worker, at most `connect_window()` at once; {worker: why not}. HELPER: the argv
        (given the worker's Python) of a helper to start on each worker the moment it is reached, for the next
        `converse`."""
        raise NotImplementedError

    def start_helpers(self, helper: Helper) -> None:
        """Start HELPER on every reached worker now, for the next `converse`."""
        raise NotImplementedError

    def run(
        self,
        argv: Sequence[str],
        sink: LineSink,
        *,
        stop: threading.Event,
        fail_fast: bool = False,
        grace: float = RUN_GRACE,
        env: Callable[[Worker], Mapping[str, str]] | None = None,
        on_exit: Callable[[RunResult], None] | None = None,
        only: Collection[int] | None = None,
        unreached: Callable[[str], None] | None = None,
    ) -> list[RunResult]:
        """ARGV (with the variables ENV gives each worker added) on every worker (of ONLY), to its end, its lines
        to SINK; STOP ends it (after GRACE); with FAIL_FAST the first failure sets STOP. A fleet not connected yet
        is connected here, each worker's command starting the moment that worker is reached (not once every
        worker is); UNREACHED hears why for each worker that cannot be, once every connection was tried. One
        result per worker, in order (an unreached one's with its error); ON_EXIT hears each as it comes."""
        raise NotImplementedError

    def call(
        self, call: Call | Callable[[Worker], Call], *, timeout: float = 60, only: Collection[int] | None = None
    ) -> dict[int, Answer]:
        """CALL (or each worker's own) on every reached worker (of ONLY) to its end: {worker: its Answer}."""
        raise NotImplementedError

    def open(self, call: Call) -> dict[int, Session | str]:
        """CALL started on every reached worker with its stdin open: {worker: its Session, or why not}."""
        raise NotImplementedError

    def answer(self, sessions: Mapping[int, Session], say: bytes | None, wait: float) -> dict[int, str | Exception]:
        """Session.line on every session of SESSIONS at once (the bundle installed where missing, and the
        program started again): {worker: the line, or what went wrong}."""
        raise NotImplementedError

    def follow(
        self,
        call: Callable[[Worker], Call],
        take: Take,
        ended: Ended,
        lost: Callable[[int, str], None],
        *,
        lifeline: threading.Event | None = None,
        stop: threading.Event | None = None,
        reconnects: int = 0,
        held: Mapping[int, tuple[Session, bytes]] | None = None,
    ) -> None:
        """Each reached worker's CALL (an agent's `stream`), its records to TAKE as they come (every fraction
        of a second, also when none came). Setting LIFELINE closes the streams' stdin (the agents stop the job
        and go on to its end); setting STOP ends the streams here (the job goes on). When a stream ends, ENDED
        says whether to open it again (CALL is asked anew); a broken one is reconnected RECONNECTS times, a
        second apart, before LOST hears why it is lost. HELD: {worker: (a Session still running, what it is
        told)}, whose program becomes that worker's first stream once told (a claim turned into its job's start
        and stream: one program on the worker, not two), in place of a new CALL."""
        raise NotImplementedError

    def converse(
        self,
        helper: Helper,
        talk: Talk,
        *,
        stop: threading.Event,
        only: Collection[int] | None = None,
    ) -> None:
        """TALK with HELPER (its argv given the worker's Python) on each worker (of ONLY) at once, over its pipe
        (the one started at `connect`, else a new one; closed after). A fleet not connected yet is connected
        here; for a worker that could not be reached, opening its pipe raises UnreachableError. Setting STOP
        closes every pipe, which wakes a conversation waiting for a reply."""
        raise NotImplementedError

    def chorus(self, helper: Helper, *, only: Collection[int], stop: threading.Event) -> Chorus:
        """HELPER (its argv given the worker's Python) on each reached worker of ONLY, spoken to at once (a
        `Chorus`; the helpers `connect` started are used). A fleet not connected yet is connected here. Setting
        STOP ends a `say` that waits for a worker."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class RecordStream:
    """What the agent's `stream` command sends (protocol records, one per line): the one reader of it."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.buf = b""

    def records(self, timeout: float) -> Iterator[protocol.Record] | None:
        """The records that arrived within TIMEOUT, parsed one at a time as the caller takes them (a read
        may hold tens of thousands); None once the stream has ended."""
        data = self.stream.read(timeout)
        if data is None:
            return None
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        return protocol.decode_lines(lines)


def watching(w: int, recs: Iterable[protocol.Record], over: list[bool]) -> Iterator[protocol.Record]:
    """RECS of W's stream as they are taken, noting in OVER when W's part of the job is over (its Done, or the
    start's failure, came)."""
    for rec in recs:
        if isinstance(rec, protocol.StartFailed) or (isinstance(rec, protocol.Done) and rec.worker == w):
            over.append(True)
        yield rec


def each(
    items: Sequence[T],
    fn: Callable[[T], object],
    *,
    name: str,
    tick: Callable[[], None] | None = None,
    width: int | None = None,
) -> None:
    """FN on every item, one thread each (WIDTH: that many threads at most, each taking the next item in turn).
    This thread waits in short joins, so signal handlers (Ctrl-C) run meanwhile, and calls TICK between them. An
    exception FN raised is raised here once every thread has ended."""
    raised: list[BaseException] = []
    todo = collections.deque(items)

    def run() -> None:
        while True:
            try:
                item = todo.popleft()  # (atomic: each item to one thread)
            except IndexError:
                return
            try:
                fn(item)
            except BaseException as exc:
                raised.append(exc)

    count = len(todo) if width is None else min(width, len(todo))
    threads = [threading.Thread(target=run, daemon=True, name=f"{name}-{i}") for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.1)
            if tick is not None:
                tick()
    if raised:
        raise raised[0]


def connect_all(
    runners: Sequence[Runner], then: Callable[[Runner], None] | None = None, gate: threading.Semaphore | None = None
) -> dict[int, str]:
    """Connect every runner, at most `connect_window()` attempts in flight at once (GATE: a window shared with
    other connects); {worker index: error} for those that failed. THEN runs on each runner's thread as soon as
    it is connected (e.g. to start a remote program while others connect), outside the window."""
    gate = gate or threading.BoundedSemaphore(connect_window())
    errors: dict[int, str] = {}

    def one(r: Runner) -> None:
        while not gate.acquire(timeout=0.1):
            pass
        try:
            r.connect()
        except UnreachableError as exc:
            errors[r.worker.index] = str(exc)
            return
        finally:
            gate.release()
        if then is not None:
            then(r)

    each(runners, one, name="connect")
    return errors
