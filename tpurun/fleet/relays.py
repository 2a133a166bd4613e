"""The second `Fleet`: relays inside the slice (tree.py plants them). Every operation goes through them, on
channels (channels.py): `run`, `call`, `open`/`answer`, `follow`, `converse` (download: a pipe per worker, a
bounded number at once) and `chorus` (sync). A relay lost under an operation takes its subtree with it (a job
stops); a `follow` asked to reconnect plants a tree of their own for the workers it took (`Tree.regrow`), as
`Threads` reaches a dropped worker again, and follows them on from where their lines stopped."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence

from tpurun.errors import TpurunError, UnreachableError
from tpurun.fleet import bundle
from tpurun.fleet.channels import Chan, RelayChorus, RelayPipe, RelaySession
from tpurun.fleet.interface import (
    Answer,
    Call,
    Ended,
    Fleet,
    Helper,
    RunResult,
    Session,
    Take,
    Talk,
    connect_window,
    each,
    watching,
)
from tpurun.fleet.threads import Reach
from tpurun.fleet.tree import Tree
from tpurun.transport.runner import RUN_GRACE, LineSink, LineSplitter, Pipe, Worker
from tpurun.transport.ssh import leash_argv
from tpurun.worker import protocol, relay_wire

STOP_SECONDS = 5.0  # a follow's trees still being planted are waited for this long once it ends


def _records_to(w: int, take: Take) -> tuple[Callable[[bytes], None], list[bool]]:
    """What hears the bytes of W's agent `stream` (handing TAKE its records, whole lines only), and the list
    in which the end of W's part of the job is noted."""
    buf = bytearray()
    over: list[bool] = []

    def out(data: bytes) -> None:
        buf.extend(data)
        at = buf.rfind(b"\n")
        if at < 0:
            return
        lines = bytes(buf[:at]).split(b"\n")
        del buf[: at + 1]
        take(w, watching(w, protocol.decode_lines(lines), over))

    return out, over


class Relays(Fleet):
    """This machine, a few roots per slice, and relays below them (a `Tree`); see the module's docstring."""

    def __init__(self, reach: Reach, *, key: str, pins: Callable[[], Mapping[str, str]], python: str) -> None:
        self.tree = Tree(reach, key=key, pins=pins, python=python)
        self.python = python

    @property
    def workers(self) -> list[Worker]:
        return self.tree.workers

    @property
    def unreached(self) -> dict[int, str]:
        return dict(self.tree.unreached)

    def connect(self, *, helper: Helper | None = None) -> dict[int, str]:
        """The relay trees, planted once (a HELPER starts with the `chorus` that speaks to it)."""
        return dict(self.tree.connect())

    def start_helpers(self, helper: Helper) -> None:
        """Nothing: a helper starts with the `chorus` that speaks to it."""

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
        planting = not self.tree.connected
        if planting:
            self.tree.plant()  # the command follows each plan down its link: it starts as each tree stands
        workers = [] if stop.is_set() else self.tree.reached(only)  # nothing new once stopped (Ctrl-C, fail-fast)
        envs = {w.index: dict(env(w)) if env else {} for w in workers}
        leashed = {w.index: leash_argv(argv, grace, envs[w.index]) for w in workers}
        results: dict[int, RunResult] = {}
        started = time.monotonic()
        lock = threading.Lock()

        def make(w: int) -> Chan:
            out = LineSplitter(lambda line: sink(w, "out", line))
            err = LineSplitter(lambda line: sink(w, "err", line))

            def end(rc: int | None, why: str) -> None:
                out.flush()
                err.flush()
                if rc is None and w in self.tree.missed:  # never reached (said below): no command ran there
                    with lock:
                        results[w] = RunResult(w, None, error=why)
                    return
                res = RunResult(w, rc, error=why if rc is None else "", stopped=stop.is_set(),
                                duration=time.monotonic() - started)  # fmt: skip
                with lock:
                    results[w] = res
                if fail_fast and (rc not in (0, None) or why) and not stop.is_set():
                    stop.set()
                if on_exit is not None:
                    on_exit(res)

            return Chan(w, out.feed, err.feed, end)

        try:
            numbers = self.tree.open_chans(leashed, envs, make)
        finally:
            if planting:
                for _, why in sorted(self.tree.stand().items()):
                    if unreached is not None:
                        unreached(why)
        closed = False
        while len(results) < len(numbers):
            if stop.is_set() and not closed:
                self.tree.act(relay_wire.CLOSE, numbers.values())  # each leash stops its command's group
                closed = True
            if self.tree.raised:
                break
            time.sleep(0.05)
        self.tree.check()
        for w, why in list(self.tree.unreached.items()):
            if (only is None or w in only) and w not in results:
                results[w] = RunResult(w, None, error=why)
        return [results[w.index] for w in self.workers if w.index in results]

    def call(
        self, call: Call | Callable[[Worker], Call], *, timeout: float = 60, only: Collection[int] | None = None
    ) -> dict[int, Answer]:
        workers = self.tree.reached(only)
        calls = {w.index: call if isinstance(call, Call) else call(w) for w in workers}
        answers: dict[int, Answer] = {}
        lock = threading.Lock()
        sent = time.time()

        def make(w: int) -> Chan:
            out, err = bytearray(), bytearray()

            def end(rc: int | None, why: str) -> None:
                text = err.decode("utf-8", "replace")
                with lock:
                    answers.setdefault(w, Answer(w, rc, bytes(out), text, error=why if rc is None else "",
                                                 sent=sent, answered=time.time()))  # fmt: skip

            return Chan(w, out.extend, err.extend, end)

        numbers = self.tree.open_chans({w: bundle.call_argv(c) for w, c in calls.items()}, {}, make)
        by_input: dict[bytes, list[int]] = defaultdict(list)
        for w, c in calls.items():
            by_input[c.input].append(numbers[w])
        for data, group in by_input.items():
            if data:
                self.tree.act(relay_wire.INPUT, group, data)
        self.tree.act(relay_wire.CLOSE, numbers.values())
        deadline = time.monotonic() + timeout
        while len(answers) < len(numbers) and time.monotonic() < deadline and not self.tree.raised:
            time.sleep(0.02)
        self.tree.check()
        late = [n for w, n in numbers.items() if w not in answers]
        self.tree.drop(late)
        time.sleep(0.05 if late else 0)  # an answer being handed over as the time ran out lands first
        by_index = {w.index: w for w in workers}
        with lock:
            for w in numbers:
                why = f"worker {by_index[w].label()} did not answer within {timeout:.0f} s"
                answers.setdefault(w, Answer(w, None, error=why, sent=sent, answered=time.time()))
            return dict(answers)

    def open(self, call: Call) -> dict[int, Session | str]:
        workers = self.tree.reached()
        sessions: dict[int, RelaySession] = {}

        def make(w: int) -> Chan:
            s = sessions[w] = RelaySession(self.tree, w)
            return Chan(w, s.took, s.took_err, s.ended_with)

        numbers = self.tree.open_chans({w.index: bundle.call_argv(call) for w in workers}, {}, make)
        for w, n in numbers.items():
            sessions[w].number = n
        if call.input:
            self.tree.act(relay_wire.INPUT, numbers.values(), call.input)
        return {w: (s if s.error == "" else s.error) for w, s in sessions.items()}

    def answer(self, sessions: Mapping[int, Session], say: bytes | None, wait: float) -> dict[int, str | Exception]:
        mine = {w: s for w, s in sessions.items() if isinstance(s, RelaySession)}
        numbers = [s.number for s in mine.values()]
        if say is None:
            self.tree.act(relay_wire.CLOSE, numbers)
        else:
            self.tree.act(relay_wire.INPUT, numbers, say)
        got: dict[int, str | Exception] = {}
        deadline = time.monotonic() + wait
        for w, s in mine.items():
            try:
                line = s.wait_line(deadline)
                if line is None:
                    rc, err = s.ended()
                    raise UnreachableError((err.strip().splitlines() or [f"exit {rc}"])[-1])
                got[w] = line
            except TpurunError as exc:
                got[w] = exc
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
        held: Mapping[int, tuple[Session, bytes]] | None = None,
    ) -> None:
        f = _Following(self.tree, take, ended, lost, stop or threading.Event(), reconnects)
        for w, (session, say) in (held or {}).items():
            if w not in f.again:  # its relay was lost since the claim: reached again, if at all, by a new stream
                session.release()
                continue
            if isinstance(session, RelaySession) and self.tree.adopt(session.number, f.make(w)):
                if not session.alive():  # it ended as it was handed over: its worker's stream is opened anew
                    self.tree.drop([session.number])
                    continue
                with f.lock:  # its channel, heard by this follow from now on, is its stream once told
                    f.again.remove(w)
                    f.live[w] = session.number
                self.tree.act(relay_wire.INPUT, [session.number], say)
        closed = False
        self.tree.ticks.append(f.tick)
        try:
            while True:
                with f.lock:
                    ws, f.again[:] = list(f.again), []
                    far, f.moved[:] = list(f.moved), []
                if far:
                    f.growing.append(threading.Thread(target=f.regrow, args=(far,), daemon=True, name="regrow"))
                    f.growing[-1].start()
                if ws:
                    opened = self.tree.open_chans({w: bundle.call_argv(call(f.by_index[w])) for w in ws}, {}, f.make)
                    with f.lock:
                        f.live.update({w: n for w, n in opened.items() if n in self.tree.chans})
                    if closed:  # the lifeline was cut before: these streams hear it too
                        self.tree.act(relay_wire.CLOSE, list(opened.values()))
                if f.stop.is_set():
                    with f.lock:
                        numbers = list(f.live.values())
                    self.tree.drop(numbers)  # a viewer only ends its own streams: the job goes on
                    return
                if lifeline is not None and lifeline.is_set() and not closed:
                    with f.lock:
                        numbers = list(f.live.values())
                    self.tree.act(relay_wire.CLOSE, numbers)  # each agent stops its processes, streams to the end
                    closed = True
                self.tree.check()
                if f.over():
                    break
                time.sleep(0.05)
        finally:
            self.tree.ticks.remove(f.tick)
            f.halt.set()
            deadline = time.monotonic() + STOP_SECONDS
            for t in f.growing:
                t.join(max(0.0, deadline - time.monotonic()))
        self.tree.check()

    def converse(
        self,
        helper: Helper,
        talk: Talk,
        *,
        stop: threading.Event,
        only: Collection[int] | None = None,
    ) -> None:
        """Each worker's conversation over a pipe through the relays, `connect_window()` of them at once."""
        if not self.tree.connected:
            self.connect()
        argv = helper(self.python, bundled=True)
        pipes: dict[int, RelayPipe] = {}

        def one(w: Worker) -> None:
            def opened() -> Pipe:
                if w.index in self.tree.unreached:
                    raise UnreachableError(self.tree.unreached[w.index])
                pipe = pipes[w.index] = RelayPipe(self.tree, w.index, argv)
                if stop.is_set():  # (one opened as the stop came is closed too)
                    pipe.close()
                return pipe

            try:
                talk(w, opened)
            finally:
                pipe = pipes.pop(w.index, None)
                if pipe is not None:
                    pipe.close()

        def close_on_stop() -> None:
            if stop.is_set():  # a conversation waiting for a reply would not notice the stop: closing wakes it
                for pipe in list(pipes.values()):
                    pipe.close()

        chosen = [w for w in self.workers if only is None or w.index in only]
        each(chosen, one, name="converse", tick=close_on_stop, width=connect_window())

    def chorus(
        self, helper: Helper, *, only: Collection[int], stop: threading.Event
    ) -> RelayChorus:
        if not self.tree.connected:
            self.connect()
        return RelayChorus(self.tree, helper(self.python, bundled=True), [w.index for w in self.tree.reached(only)])

    def close(self) -> None:
        self.tree.close()


class _Following:
    """What one relayed `follow` keeps: each worker's stream (a channel), those to open (again), and those a lost
    relay took, reached again by `Tree.regrow` while RECONNECTS allows (each lost that many times at most)."""

    def __init__(
        self,
        tree: Tree,
        take: Take,
        ended: Ended,
        lost: Callable[[int, str], None],
        stop: threading.Event,
        reconnects: int,
    ) -> None:
        self.tree, self.take, self.ended, self.lost = tree, take, ended, lost
        self.stop, self.reconnects = stop, reconnects
        self.lock = threading.Lock()
        self.by_index = {w.index: w for w in tree.workers}
        self.live: dict[int, int] = {}  # worker -> its stream's channel
        self.again: list[int] = [w.index for w in tree.reached()]  # to open (again)
        self.broken: dict[int, int] = defaultdict(int)  # how often each worker's stream was lost
        self.moved: list[int] = []  # lost to the tree: to be reached again
        self.growing: list[threading.Thread] = []
        self.halt = threading.Event()  # the follow's end: no tree is planted for it any more

    def drop(self, w: int, why: str) -> None:
        """(Under LOCK) W's stream lost for WHY: to be reached again, or lost for good."""
        if self.stop.is_set():
            return  # stopped here: no one waits for this worker any more
        if self.broken[w] < self.reconnects:
            self.broken[w] += 1
            self.moved.append(w)
        else:
            self.lost(w, why)

    def make(self, w: int) -> Chan:
        err = bytearray()
        out, over = _records_to(w, self.take)

        def end(rc: int | None, why: str) -> None:
            reopen = rc is not None and self.ended(w, rc, err.decode("utf-8", "replace"), bool(over))
            with self.lock:  # the stream's end and its reopening are seen together
                self.live.pop(w, None)
                if rc is None:
                    self.drop(w, why)
                elif reopen:
                    self.again.append(w)

        return Chan(w, out, err.extend, end)

    def regrow(self, ws: list[int]) -> None:
        if self.halt.wait(1.0):  # (a second's pause, as `Threads` takes before reaching a worker again)
            return
        try:
            unreached = self.tree.regrow(ws)
        except BaseException as exc:  # said where the follow waits
            self.tree.raised.append(exc)
            return
        with self.lock:
            self.again.extend(w for w in ws if w not in unreached)
            for w, why in unreached.items():
                self.drop(w, why)

    def tick(self, source: int) -> None:
        self.take(source, [])

    def over(self) -> bool:
        with self.lock:
            return not (self.live or self.again or self.moved or any(t.is_alive() for t in self.growing))
