"""The first `Fleet`: one thread of this machine per worker, each on that worker's own connection, joined
in short waits so Ctrl-C stays live; at most `connect_window()` workers being connected to at once. Its
`chorus` is a `PipeChorus`: each worker's helper over its own pipe, a reader and a writer thread each."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol

from tpurun.errors import TpurunError, UnreachableError
from tpurun.fleet import bundle
from tpurun.fleet.interface import (
    Answer,
    Call,
    Chorus,
    Ended,
    Fleet,
    Helper,
    RecordStream,
    RunResult,
    Session,
    Take,
    Talk,
    connect_all,
    connect_window,
    each,
    lost_connection,
    watching,
)
from tpurun.transport.runner import RUN_GRACE, LineSink, Pipe, Runner, Stream, Worker, open_stream, run_capture
from tpurun.worker.protocol import AgentExit


class Reach(Protocol):
    """What a `Threads` fleet stands on (a `targets.Target`): the runners, and how they are connected."""

    runners: list[Runner]
    connected: bool  # connect was called

    def connect(
        self, then: Callable[[Runner], None] | None = None, *, only: Collection[int] | None = None
    ) -> dict[int, str]: ...


class Threads(Fleet):
    """One thread per worker; see `Fleet`."""

    def __init__(self, reach: Reach) -> None:
        self.reach = reach
        self._unreached: dict[int, str] = {}
        self._helpers: dict[int, Pipe | BaseException] = {}  # started at connect, for the next converse
        self.gate = threading.BoundedSemaphore(connect_window())

    @property
    def workers(self) -> list[Worker]:
        return [r.worker for r in self.reach.runners]

    @property
    def unreached(self) -> dict[int, str]:
        return dict(self._unreached)

    def _reached(self, only: Collection[int] | None = None) -> list[Runner]:
        return [
            r
            for r in self.reach.runners
            if r.worker.index not in self._unreached and (only is None or r.worker.index in only)
        ]

    def connect(self, *, helper: Helper | None = None) -> dict[int, str]:
        self._unreached = self.reach.connect(self._starter(helper) if helper else None)
        return dict(self._unreached)

    def _starter(self, helper: Helper) -> Callable[[Runner], None]:
        def start(r: Runner) -> None:
            try:
                self._helpers[r.worker.index] = r.pipe(helper(r.python))
            except Exception as exc:  # reported by the conversation, as this worker's failure
                self._helpers[r.worker.index] = exc

        return start

    def start_helpers(self, helper: Helper) -> None:
        each(self._reached(), self._starter(helper), name="helper")

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
        results: dict[int, RunResult] = {}
        running: dict[int, threading.Thread] = {}
        raised: list[BaseException] = []
        lock = threading.Lock()

        def one(r: Runner) -> None:
            started = time.monotonic()
            try:
                rc = r.run(argv, sink, stop, grace, env(r.worker) if env else None)
                res = RunResult(r.worker.index, rc, stopped=stop.is_set(), duration=time.monotonic() - started)
            except UnreachableError as exc:
                res = RunResult(r.worker.index, None, error=str(exc), duration=time.monotonic() - started)
            except BaseException as exc:  # raised below, in the caller's thread
                raised.append(exc)
                return
            if fail_fast and (res.exit_code not in (0, None) or res.error) and not stop.is_set():
                stop.set()
            results[r.worker.index] = res
            if on_exit:
                on_exit(res)

        def start(r: Runner) -> None:
            w = r.worker.index
            with lock:
                if w in running or (only is not None and w not in only) or stop.is_set():
                    return  # once, whatever its connection; nothing new once stopped (fail-fast, Ctrl-C)
                running[w] = thread = threading.Thread(target=one, args=(r,), daemon=True, name=f"run-w{w}")
            thread.start()

        def wait_all() -> None:
            for thread in list(running.values()):
                while thread.is_alive():
                    thread.join(0.1)  # short waits: Ctrl-C stays live

        if not self.reach.connected:
            try:
                self._unreached = self.reach.connect(start)
            except BaseException:  # e.g. the API says the TPU is not READY: what started stops, then it is said
                stop.set()
                wait_all()
                raise
            for _, why in sorted(self._unreached.items()):
                if unreached is not None:
                    unreached(why)
        for r in self._reached(only):  # connected before, or needing no connection (this machine)
            start(r)
        wait_all()
        if raised:
            raise raised[0]
        for w, why in self._unreached.items():
            if only is None or w in only:
                results.setdefault(w, RunResult(w, None, error=why))
        return [results[w.index] for w in self.workers if w.index in results]

    def call(
        self, call: Call | Callable[[Worker], Call], *, timeout: float = 60, only: Collection[int] | None = None
    ) -> dict[int, Answer]:
        answers: dict[int, Answer] = {}

        def one(r: Runner) -> None:
            c = call if isinstance(call, Call) else call(r.worker)
            w = r.worker.index
            sent = time.time()
            try:
                rc, out, err = run_capture(r, bundle.call_argv(c), c.input, timeout=timeout)
                if rc == AgentExit.MISSING and c.program:  # a worker new to this version of tpurun
                    bundle.install(r)
                    sent = time.time()
                    rc, out, err = run_capture(r, bundle.call_argv(c), c.input, timeout=timeout)
                answers[w] = Answer(w, rc, out, err, sent=sent, answered=time.time())
            except TpurunError as exc:
                answers[w] = Answer(w, None, error=str(exc), sent=sent, answered=time.time())

        each(self._reached(only), one, name="call")
        return answers

    def open(self, call: Call) -> dict[int, Session | str]:
        opened: dict[int, Session | str] = {}

        def one(r: Runner) -> None:
            try:
                opened[r.worker.index] = _StreamSession(r, call)
            except TpurunError as exc:
                opened[r.worker.index] = str(exc)

        each(self._reached(), one, name="open")
        return opened

    def answer(self, sessions: Mapping[int, Session], say: bytes | None, wait: float) -> dict[int, str | Exception]:
        got: dict[int, str | Exception] = {}
        by_worker = {r.worker.index: r for r in self.reach.runners}

        def one(r: Runner) -> None:
            s = sessions[r.worker.index]
            assert isinstance(s, _StreamSession)
            try:
                got[r.worker.index] = s.answer(say, wait)
            except TpurunError as exc:
                got[r.worker.index] = exc

        each([by_worker[w] for w in sessions], one, name="answer")
        return got

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
        only: Collection[int] | None = None,
        held: Mapping[int, tuple[Session, bytes]] | None = None,
    ) -> None:
        """As `Fleet.follow`; of ONLY's workers (relays hand over those their tree lost), connected or not."""

        def one(r: Runner) -> None:
            broken = 0
            installed = False
            first = (held or {}).get(r.worker.index)
            while stop is None or not stop.is_set():
                try:
                    if first is not None:
                        session, say = first
                        first = None
                        assert isinstance(session, _StreamSession)
                        stream = session.stream
                        stream.write(say)
                    else:
                        stream = open_stream(r, bundle.call_argv(call(r.worker)))
                    rc, done = _pump(r.worker.index, stream, take, lifeline, stop)
                    if rc is None:
                        return  # stopped here: the job goes on
                    if rc == AgentExit.MISSING and not done and not installed:  # its bundle is new to the worker
                        bundle.install(r)
                        installed = True
                        continue
                    if not ended(r.worker.index, rc, stream.stderr_text(), done):
                        return
                except TpurunError as exc:
                    why: str | None = str(exc)
                    while why is not None:  # reach it again (a failed try is a drop too), RECONNECTS times
                        if stop is not None and stop.is_set():
                            return  # stopped here: no one waits for this worker any more
                        broken += 1
                        if broken > reconnects:
                            lost(r.worker.index, why)
                            return
                        time.sleep(1)
                        r.close()
                        why = connect_all([r], gate=self.gate).get(r.worker.index)

        each(self._reached(only), one, name="follow")

    def converse(
        self,
        helper: Helper,
        talk: Talk,
        *,
        stop: threading.Event,
        only: Collection[int] | None = None,
    ) -> None:
        if not self.reach.connected:
            self.connect(helper=helper)
        pipes: dict[int, Pipe] = {}
        shut: set[int] = set()  # the pipes the stop closed
        unreached = self.unreached

        def one(r: Runner) -> None:
            w = r.worker.index

            def opened() -> Pipe:
                if w in unreached:
                    raise UnreachableError(unreached[w])
                early = self._helpers.pop(w, None)
                if isinstance(early, BaseException):
                    raise early
                pipe = pipes[w] = early or r.pipe(helper(r.python))
                return pipe

            try:
                talk(r.worker, opened)
            finally:
                if w in pipes:
                    pipes[w].close()

        def close_on_stop() -> None:
            if stop.is_set():
                # a thread waiting for a reply would not notice the stop: closing its pipe wakes it (also a
                # pipe opened after the stop)
                for w, pipe in list(pipes.items()):
                    if w not in shut:
                        shut.add(w)
                        pipe.close()

        chosen = [r for r in self.reach.runners if only is None or r.worker.index in only]
        try:
            each(chosen, one, name="converse", tick=close_on_stop)
        finally:
            self._close_early()

    def chorus(
        self, helper: Helper, *, only: Collection[int], stop: threading.Event
    ) -> PipeChorus:
        """Each worker's helper over its own pipe (the one started at `connect`, else a new one, opened at once)."""
        if not self.reach.connected:
            self.connect(helper=helper)
        pipes: dict[int, Pipe] = {}
        failed: dict[int, str] = {}

        def one(r: Runner) -> None:
            w = r.worker.index
            early = self._helpers.pop(w, None)
            try:
                if isinstance(early, BaseException):
                    raise early
                pipes[w] = early or r.pipe(helper(r.python))
            except Exception as exc:  # this worker's helper could not start: its failure, not the others'
                failed[w] = str(exc) or type(exc).__name__

        reached = self._reached(only)
        try:
            each(reached, one, name="chorus")
        finally:
            self._close_early()
        return PipeChorus({r.worker.index: pipes[r.worker.index] for r in reached if r.worker.index in pipes},
                          failed, stop)  # fmt: skip

    def _close_early(self) -> None:
        """The helpers started at `connect` that the conversation did not take (its workers' were popped): they
        were for it alone, and a helper left open would outlive the command on a one-host pod."""
        while self._helpers:
            _, early = self._helpers.popitem()
            if not isinstance(early, BaseException):
                early.close()

    def close(self) -> None:
        self._close_early()
        for r in self.reach.runners:
            r.close()


OUTBOX_BYTES = 8 << 20  # what may wait for one worker's pipe: a few of sync's segments, whatever the tree's size


class _Outbox:
    """What is still to be written to one worker's pipe: at most OUTBOX_BYTES (a larger piece alone)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.items: deque[bytes] = deque()
        self.size = 0
        self.shut = False  # nothing more goes: its pipe failed, or the chorus closed

    def put(self, data: bytes, stop: threading.Event) -> None:
        with self.cond:
            while self.size and self.size + len(data) > OUTBOX_BYTES and not self.shut and not stop.is_set():
                self.cond.wait(0.1)
            if not self.shut and not stop.is_set():
                self.items.append(data)
                self.size += len(data)
                self.cond.notify_all()

    def take(self) -> bytes | None:
        """The next piece to write (waiting for one); None once shut."""
        with self.cond:
            while not self.items and not self.shut:
                self.cond.wait()
            if self.shut:
                return None
            data = self.items.popleft()
            self.size -= len(data)
            self.cond.notify_all()
            return data

    def close(self) -> None:
        with self.cond:
            self.shut = True
            self.items.clear()
            self.cond.notify_all()


class PipeChorus(Chorus):
    """A helper on each of many workers over its own pipe (`Threads.chorus`). A reader thread per pipe gathers
    what its helper writes; a writer thread per pipe writes what `say` left in its bounded outbox, so `say`
    waits for no worker's connection, only for a worker a whole outbox behind (which must then pace what is
    said to it, or memory would fill). STOP ends the saying."""

    def __init__(self, pipes: Mapping[int, Pipe], failed: Mapping[int, str], stop: threading.Event) -> None:
        self.pipes = dict(pipes)
        self.workers = list(pipes)
        self.failed = dict(failed)
        super().__init__()
        self.stop = stop
        self.out.update((w, bytearray()) for w in pipes)
        self.outboxes = {w: _Outbox() for w in pipes}
        self.causes: dict[int, BaseException] = {}  # what a writer ran into (its reader says why it ended)
        for w, pipe in self.pipes.items():
            threading.Thread(target=self._read, args=(w, pipe), daemon=True, name=f"chorus-read-w{w}").start()
            threading.Thread(target=self._write, args=(w, pipe), daemon=True, name=f"chorus-write-w{w}").start()

    def _write(self, w: int, pipe: Pipe) -> None:
        outbox = self.outboxes[w]
        while (data := outbox.take()) is not None:
            try:
                pipe.send(data)
            except TpurunError as exc:  # the helper or the connection ended: its reader hears how
                self.causes.setdefault(w, exc)
                outbox.close()

    def _read(self, w: int, pipe: Pipe) -> None:
        cause: BaseException | None = None
        try:
            while data := pipe.recv(1 << 16):
                with self.changed:
                    self.out[w].extend(data)
                    self.changed.notify_all()
        except TpurunError as exc:
            cause = exc
        self.outboxes[w].close()
        rc, err = pipe.ended()
        if rc is None:  # the connection, not the helper, ended: why, in place of its stderr
            err = lost_connection(cause or self.causes.get(w)).encode()
        with self.changed:
            self.ends[w] = (rc, err)
            self.changed.notify_all()

    def say(self, workers: Collection[int], data: bytes) -> None:
        for w in workers:
            outbox = self.outboxes.get(w)
            if outbox is not None:
                outbox.put(data, self.stop)

    def close(self) -> None:
        """Every pipe closed: each helper's stdin ends (what was not written yet is dropped)."""
        for w, pipe in self.pipes.items():
            self.outboxes[w].close()
            pipe.close()


def _pump(
    w: int, stream: Stream, take: Take, lifeline: threading.Event | None, stop: threading.Event | None
) -> tuple[int | None, bool]:
    """W's records to TAKE until its stream ends: (its exit code, whether its part of the job is over (its Done,
    or the start's failure, came)); exit code None when STOP ended it here."""
    reader = RecordStream(stream)
    closed = done = False
    while not done:
        if stop is not None and stop.is_set():
            stream.kill()  # a viewer only ends its own stream: the job goes on
            return None, done
        if lifeline is not None and lifeline.is_set() and not closed:
            stream.close_stdin()  # the agent stops this worker's processes and keeps streaming to the end
            closed = True
        recs = reader.records(0.1)
        if recs is None:
            break
        over: list[bool] = []
        take(w, watching(w, recs, over))
        done = bool(over)
    return stream.wait(), done


class _StreamSession(Session):
    """CALL running on one worker's stream, its stdin open; installed and started again where missing."""

    def __init__(self, runner: Runner, call: Call) -> None:
        self.runner, self.call, self.worker = runner, call, runner.worker.index
        self.stream = self._start()

    def _start(self) -> Stream:
        stream = open_stream(self.runner, bundle.call_argv(self.call))
        if self.call.input:
            stream.write(self.call.input)
        return stream

    def answer(self, say: bytes | None, wait: float) -> str:
        """`line`, installing the bundle and starting again where it is missing; raises UnreachableError with
        why it ended without an answer."""
        for installed in (False, True):
            line = self.line(say, wait)
            if line is not None:
                return line
            rc, err = self.ended()
            if rc == AgentExit.MISSING and self.call.program and not installed:
                bundle.install(self.runner)
                self.stream = self._start()
                continue
            raise UnreachableError((err.strip().splitlines() or [f"exit {rc}"])[-1])
        raise AssertionError("the bundle was installed")

    def line(self, say: bytes | None, wait: float) -> str | None:
        try:
            if say is None:
                self.stream.close_stdin()
            else:
                self.stream.write(say)
        except TpurunError:
            pass  # it has ended: reading says why
        buf = b""
        deadline = time.monotonic() + wait
        while b"\n" not in buf:
            data = self.stream.read(0.2)
            if data is None:
                return None
            buf += data
            if time.monotonic() > deadline:
                self.stream.kill()
                raise UnreachableError(f"its agent did not answer within {wait:.0f} s")
        return buf.split(b"\n", 1)[0].decode()

    def alive(self) -> bool:
        return self.stream.read(0) is not None

    def ended(self) -> tuple[int, str]:
        rc = self.stream.wait()
        return rc, self.stream.stderr_text()

    def release(self) -> None:
        self.stream.close_stdin()

    def wait_end(self, deadline: float) -> None:
        try:
            while time.monotonic() < deadline:
                if self.stream.read(0.1) is None:
                    self.stream.wait()
                    return
        except TpurunError:
            pass
