"""The second `Fleet`: relays inside the slice. This machine reaches a few workers of each slice (the roots,
`TPURUN_RELAY_ROOTS` per slice) over SSH and starts tpurun's relay there (worker/relay.py); each reaches up to
`TPURUN_RELAY_FANOUT` more at their addresses inside the slice, and so on down a balanced tree
(relay_wire.plan), every worker of it running one relay. A channel opened on a worker is that worker's
relay's child process; its bytes travel up the tree batched with its subtree's, so this machine keeps a few
SSH connections and a thread for each, whatever the pod's size (see relay_wire for the frames).

Trust: each relay checks each of its children's host keys against the one tpurun pinned for that TPU and
worker (the plan carries them; never trust on first use), as this machine checks the roots'. tpurun's key
goes to the roots that have children only, into an ssh-agent the relays below use forwarded while they
connect, ended once the tree stands.

`run`, `call`, `open`/`answer`, `follow` and `chorus` (sync) go through the relays; `converse` (download)
still goes from this machine to every worker (`Threads`). A worker not reached while the tree is built takes
none below it along (they are planned anew); a relay lost later takes its subtree with it for the rest of
the command (reported lost, with why and the workers it took named once, `lost_with`; a job stops; a `follow` asked to reconnect reaches them from this
machine instead, as `Threads` reaches a dropped worker again)."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from tpurun import config
from tpurun.errors import TpurunError, UnreachableError, UsageError
from tpurun.fleet import bundle
from tpurun.fleet.interface import (
    Answer,
    Call,
    Chorus,
    Ended,
    Fleet,
    RunResult,
    Session,
    Take,
    Talk,
    connect_all,
    connect_window,
    watching,
)
from tpurun.fleet.threads import Reach, Threads
from tpurun.naming import which
from tpurun.transport.runner import (
    INTERNAL_PORT,
    RUN_GRACE,
    LineSink,
    LineSplitter,
    Runner,
    Stream,
    Worker,
    open_stream,
)
from tpurun.transport.ssh import leash_argv
from tpurun.worker import bundle_name, protocol, relay_wire
from tpurun.worker.protocol import AgentExit

ROUNDS = 3  # how many workers of a group are tried in turn as its root
START_SECONDS = 60.0  # a root's relay says it started within this
READY_SECONDS = 180.0  # and its tree stands (or says which workers it could not reach) within this
STOP_SECONDS = 5.0  # a follow from this machine of workers the tree lost ends within this once told


def relay_silence() -> float:
    """Seconds of silence after which a relay is given up (TPURUN_RELAY_TIMEOUT)."""
    try:
        seconds = config.RELAY_TIMEOUT.number()
    except ValueError:
        raise UsageError("TPURUN_RELAY_TIMEOUT must be seconds") from None
    if seconds < 2:
        raise UsageError("TPURUN_RELAY_TIMEOUT must be 2 seconds or more (relays say something every second)")
    return seconds


def relay_shape() -> tuple[int, int]:
    """(roots per slice, fan-out): TPURUN_RELAY_ROOTS and TPURUN_RELAY_FANOUT."""
    try:
        roots, fanout = config.RELAY_ROOTS.integer(), config.RELAY_FANOUT.integer()
    except ValueError:
        raise UsageError("TPURUN_RELAY_ROOTS and TPURUN_RELAY_FANOUT must be whole numbers") from None
    if roots < 1 or fanout < 2:
        raise UsageError("TPURUN_RELAY_ROOTS must be 1 or more, TPURUN_RELAY_FANOUT 2 or more (1 makes a chain)")
    return roots, fanout


class Link:
    """This machine's link to one root: its relay on an SSH stream, and a thread reading what comes up."""

    def __init__(self, tree: Relays, root: relay_wire.Node, runner: Runner) -> None:
        self.tree, self.root, self.runner = tree, root, runner
        self.workers = set(root.indexes())
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.unreached: dict[int, str] = {}
        self.gone = ""
        self.stream: Stream | None = None

    def start(self, plan: dict[str, object]) -> None:
        """Start the relay on the root (installing the bundle where missing) and hand it PLAN."""
        argv = bundle.program_argv(self.tree.python, "relay.py")
        doc = relay_wire.json_frame(relay_wire.PLAN, plan)
        for installed in (False, True):
            stream = open_stream(self.runner, argv)
            try:
                stream.write(doc)
            except TpurunError:
                pass  # it ended at once (no bundle there), or the connection went: reading says which
            deadline = time.monotonic() + START_SECONDS
            first = stream.read(1)
            while first == b"" and time.monotonic() < deadline:
                first = stream.read(1)
            if first == b"":
                stream.kill()
                raise UnreachableError(
                    f"tpurun's relay on {self.root.label} did not start within {START_SECONDS:.0f} s"
                )
            if first is None and stream.wait() == AgentExit.MISSING and not installed:
                bundle.install(self.runner)
                continue
            self.stream = stream
            threading.Thread(
                target=self._read, args=(first or b"",), daemon=True, name=f"relay-{self.root.index}"
            ).start()
            return

    def _read(self, first: bytes) -> None:
        frames = relay_wire.Frames()
        assert self.stream is not None
        heard = beat = time.monotonic()
        data: bytes | None = first
        try:
            while data is not None:
                if data:
                    heard = time.monotonic()
                    for kind, number, payload in frames.feed(data):
                        self.tree.dispatch(self, kind, number, payload)
                else:
                    self.tree.idle(self)
                    if time.monotonic() - heard > self.tree.silence:
                        self.lose(f"relay {self.root.label} stopped answering for {self.tree.silence:.0f} s")
                        self.stream.kill()
                        return
                if time.monotonic() - beat > relay_wire.BEAT_SECONDS:
                    beat = time.monotonic()
                    self.send(relay_wire.frame(relay_wire.BEAT))  # this side's heartbeat, down the tree
                data = self.stream.read(0.1)
            why = (self.stream.stderr_text().strip().splitlines() or [""])[-1]
        except (TpurunError, ValueError) as exc:
            why = str(exc)
        except BaseException as exc:  # a bug, here or in a caller's callback: said where the operation waits
            self.tree.raised.append(exc)
            why = f"{type(exc).__name__}: {exc}"
            self.stream.kill()
        self.lose(f"relay {self.root.label} went away" + (f": {why}" if why else ""))

    def lose(self, why: str) -> None:
        if not self.gone:
            self.gone = why
            told = self.tree.lost_workers(self.workers, why)
            if not self.ready.is_set():
                self.unreached = told
                self.ready.set()

    def send(self, data: bytes) -> None:
        if self.gone or self.stream is None:
            return
        with self.lock:
            try:
                self.stream.write(data)
            except TpurunError as exc:
                self.lose(f"relay {self.root.label}: {exc}")

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close_stdin()


def lost_with(why: str, names: Sequence[str]) -> str:
    """WHY a relay was lost, with the NAMES of the workers it took along (itself and those it reached), folded:
    said once for its whole subtree, not once per worker, and what each of their rows says (a relay of one worker
    is only itself)."""
    if len(names) < 2:
        return why
    return f"{why}; {which(names)} unreachable through it"


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
    """This machine, a few roots per slice, and relays below them; see the module's docstring."""

    def __init__(self, reach: Reach, *, key: str, pins: Callable[[], Mapping[str, str]], python: str) -> None:
        self.reach, self.key, self.pins, self.python = reach, key, pins, python
        self.pinned = pins()  # {host key alias: the key pinned for it}, read again for a TPU made anew
        self.direct = Threads(reach)  # for what does not go through relays yet (converse)
        self.connected = False
        self._unreached: dict[int, str] = {}
        self._links: list[Link] = []
        self._link_of: dict[int, Link] = {}
        self._chans: dict[int, Chan] = {}
        self._numbers = itertools.count(1)
        self._idle: list[Callable[[int], None]] = []
        self.gate = threading.BoundedSemaphore(connect_window())
        self.raised: list[BaseException] = []  # what a link's reader raised, raised again by the operation
        self.silence = relay_silence()

    def _raise(self) -> None:
        if self.raised:
            raise self.raised[0]

    @property
    def workers(self) -> list[Worker]:
        return [r.worker for r in self.reach.runners]

    @property
    def unreached(self) -> dict[int, str]:
        return dict(self._unreached)

    # ------------------------------------------------------------------ the tree

    def _node(self, w: Worker) -> relay_wire.Node:
        key = self.pinned.get(w.host_key, "")
        return relay_wire.Node(w.index, w.name, w.internal or w.address, INTERNAL_PORT, w.user, w.host_key, key)

    def connect(self, *, helper: Callable[[str], Sequence[str]] | None = None) -> dict[int, str]:
        """The relay trees, built once (a HELPER starts with the `chorus` that speaks to it)."""
        if self.connected:
            return dict(self._unreached)
        roots, fanout = relay_shape()
        groups = self._groups(roots)
        before = self.reach.runners
        # the first heads through the target's own connect: where one does not prove who it is, the API is asked
        # (a TPU gone is raised, one made anew under the name is used with its own workers)
        failed = self.reach.connect(only={g[0].index for g in groups})
        if self.reach.runners is not before:  # made anew: its workers, and the keys pinned for them now
            self.pinned = self.pins()
            groups = self._groups(roots)
        runners = {r.worker.index: r for r in self.reach.runners}
        unreached: dict[int, str] = {}
        for round in range(ROUNDS):
            if not groups:
                break
            if round or self.reach.runners is not before:  # (a head connected already is not connected again)
                failed = connect_all([runners[g[0].index] for g in groups], gate=self.gate)
            again = []
            for g in groups:
                if g[0].index in failed:
                    unreached[g[0].index] = failed[g[0].index]
                    if len(g) > 1:
                        again.append(g[1:])
                    continue
                (tree,) = relay_wire.plan(g, fanout, roots=1)
                self._links.append(Link(self, tree, runners[tree.index]))
            groups = again
        for g in groups:
            for n in g:
                unreached[n.index] = f"not reached: {ROUNDS} workers of its group could not be reached in turn"
        self._start_links(fanout)
        for link in self._links:
            unreached.update(link.unreached)
        self.connected = True
        self._unreached = unreached
        return dict(unreached)

    def _groups(self, roots: int) -> list[Sequence[relay_wire.Node]]:
        """Each slice's workers in ROOTS groups, each to be reached through its first worker."""
        by_slice: dict[int | None, list[Worker]] = defaultdict(list)
        for w in self.workers:
            by_slice[w.slice].append(w)
        return [g for ws in by_slice.values() for g in relay_wire.chunks([self._node(w) for w in ws], roots)]

    def _start_links(self, fanout: int) -> None:
        plan_common = {"python": self.python, "bundle": bundle_name(), "timeout": 15, "silence": self.silence,
                       "fanout": fanout}  # fmt: skip
        pending = [link for link in self._links if not link.ready.is_set()]

        def start(link: Link) -> None:
            for w in link.workers:
                self._link_of[w] = link
            try:
                key = {"key": self.key} if link.root.children else {}  # a root without children connects to none
                link.start({**plan_common, **key, "node": link.root.to_wire()})
            except TpurunError as exc:
                link.lose(str(exc))

        threads = [threading.Thread(target=start, args=(link,), daemon=True) for link in pending]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.1)
        deadline = time.monotonic() + READY_SECONDS
        for link in pending:
            while not link.ready.wait(0.1):
                if time.monotonic() > deadline:
                    link.lose(f"relay {link.root.label}'s tree did not stand within {READY_SECONDS:.0f} s")
                    if link.stream is not None:
                        link.stream.kill()
        self._raise()

    def dispatch(self, link: Link, kind: int, number: int, payload: bytes) -> None:
        """A frame from LINK's relay."""
        if kind == relay_wire.BEAT:
            return
        if kind == relay_wire.READY:
            link.unreached = {int(w): why for w, why in json.loads(payload)["unreached"].items()}
            link.ready.set()
            return
        if kind == relay_wire.LOST:
            doc = json.loads(payload)
            self.lost_workers(set(doc["workers"]) & link.workers, doc["why"])
            return
        chan = self._chans.get(number)
        if chan is None or chan.link is not link:  # a channel of another root's: never this one's to say
            return
        if kind == relay_wire.OUT:
            chan.out(payload)
        elif kind == relay_wire.ERR:
            chan.err(payload)
        elif kind == relay_wire.EXIT:
            self._chans.pop(number, None)
            doc = json.loads(payload)
            chan.end(doc.get("rc"), doc.get("error", ""))

    def idle(self, link: Link) -> None:
        for tick in list(self._idle):
            tick(link.root.index)

    def lost_workers(self, workers: Collection[int], why: str) -> dict[int, str]:
        """WORKERS, a relay's subtree, lost with it for WHY: each of those not lost before is told WHY with the
        subtree named once in it (`lost_with`), and its channels end so; what each was told."""
        fresh = [w for w in workers if w not in self._unreached]
        told = lost_with(why, [w.name for w in self.workers if w.index in fresh])
        for w in fresh:
            self._unreached.setdefault(w, told)
        for number, chan in list(self._chans.items()):
            if chan.worker in workers and self._chans.pop(number, None) is not None:
                chan.end(None, self._unreached.get(chan.worker, told))
        return {w: self._unreached.get(w, told) for w in workers}

    # ------------------------------------------------------------------ channels

    def open_chans(
        self, argvs: Mapping[int, Sequence[str]], envs: Mapping[int, Mapping[str, str]], make: Callable[[int], Chan]
    ) -> dict[int, int]:
        """ARGVS[w] on each worker w (with ENVS[w] added), a channel each, MAKE(w) hearing it: {worker: channel}."""
        numbers: dict[int, int] = {}
        by_link: dict[int, dict[tuple[str, ...], dict[int, tuple[int, dict[str, str]]]]] = defaultdict(dict)
        for w, argv in argvs.items():
            link = self._link_of.get(w)
            chan = make(w)
            number = numbers[w] = next(self._numbers)
            if link is None or link.gone or w in self._unreached:
                chan.end(None, self._unreached.get(w) or (link.gone if link else "not reached"))
                continue
            chan.link = link
            self._chans[number] = chan
            by_link[id(link)].setdefault(tuple(argv), {})[number] = (w, dict(envs.get(w, {})))
        for link in self._links:
            for argv, workers in by_link.get(id(link), {}).items():
                link.send(relay_wire.json_frame(relay_wire.OPEN, relay_wire.Opening(argv, workers).to_wire()))
        return numbers

    def act(self, kind: int, numbers: Collection[int], data: bytes = b"") -> None:
        """KIND (INPUT with DATA, CLOSE, DROP) on every channel of NUMBERS still open, one frame per link."""
        by_link: dict[int, list[int]] = defaultdict(list)
        for n in numbers:
            chan = self._chans.get(n)
            if chan is not None and chan.link is not None:
                by_link[id(chan.link)].append(n)
        for link in self._links:
            if id(link) in by_link:
                link.send(relay_wire.set_frame(kind, by_link[id(link)], data))

    def _reached(self, only: Collection[int] | None = None) -> list[Worker]:
        return [w for w in self.workers if w.index not in self._unreached and (only is None or w.index in only)]

    # ------------------------------------------------------------------ the operations

    def start_helpers(self, helper: Callable[[str], Sequence[str]]) -> None:
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
        if not self.connected:
            for _, why in sorted(self.connect().items()):
                if unreached is not None:
                    unreached(why)
        workers = [] if stop.is_set() else self._reached(only)  # nothing new once stopped (Ctrl-C, fail-fast)
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
                res = RunResult(w, rc, error=why if rc is None else "", stopped=stop.is_set(),
                                duration=time.monotonic() - started)  # fmt: skip
                with lock:
                    results[w] = res
                if fail_fast and (rc not in (0, None) or why) and not stop.is_set():
                    stop.set()
                if on_exit is not None:
                    on_exit(res)

            return Chan(w, out.feed, err.feed, end)

        numbers = self.open_chans(leashed, envs, make)
        closed = False
        while len(results) < len(numbers):
            if stop.is_set() and not closed:
                self.act(relay_wire.CLOSE, numbers.values())  # each leash stops its command's group
                closed = True
            if self.raised:
                break
            time.sleep(0.05)
        self._raise()
        for w, why in list(self._unreached.items()):
            if (only is None or w in only) and w not in results:
                results[w] = RunResult(w, None, error=why)
        return [results[w.index] for w in self.workers if w.index in results]

    def call(
        self, call: Call | Callable[[Worker], Call], *, timeout: float = 60, only: Collection[int] | None = None
    ) -> dict[int, Answer]:
        workers = self._reached(only)
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

        numbers = self.open_chans({w: bundle.call_argv(c) for w, c in calls.items()}, {}, make)
        by_input: dict[bytes, list[int]] = defaultdict(list)
        for w, c in calls.items():
            by_input[c.input].append(numbers[w])
        for data, group in by_input.items():
            if data:
                self.act(relay_wire.INPUT, group, data)
        self.act(relay_wire.CLOSE, numbers.values())
        deadline = time.monotonic() + timeout
        while len(answers) < len(numbers) and time.monotonic() < deadline and not self.raised:
            time.sleep(0.02)
        self._raise()
        late = [n for w, n in numbers.items() if w not in answers]
        self.act(relay_wire.DROP, late)
        for n in late:
            self._chans.pop(n, None)
        time.sleep(0.05 if late else 0)  # an answer being handed over as the time ran out lands first
        by_index = {w.index: w for w in workers}
        with lock:
            for w in numbers:
                why = f"worker {by_index[w].label()} did not answer within {timeout:.0f} s"
                answers.setdefault(w, Answer(w, None, error=why, sent=sent, answered=time.time()))
            return dict(answers)

    def open(self, call: Call) -> dict[int, Session | str]:
        workers = self._reached()
        sessions: dict[int, RelaySession] = {}

        def make(w: int) -> Chan:
            s = sessions[w] = RelaySession(self, w)
            return Chan(w, s.took, s.took_err, s.ended_with)

        numbers = self.open_chans({w.index: bundle.call_argv(call) for w in workers}, {}, make)
        for w, n in numbers.items():
            sessions[w].number = n
        if call.input:
            self.act(relay_wire.INPUT, numbers.values(), call.input)
        return {w: (s if s.error == "" else s.error) for w, s in sessions.items()}

    def answer(self, sessions: Mapping[int, Session], say: bytes | None, wait: float) -> dict[int, str | Exception]:
        mine = {w: s for w, s in sessions.items() if isinstance(s, RelaySession)}
        numbers = [s.number for s in mine.values()]
        if say is None:
            self.act(relay_wire.CLOSE, numbers)
        else:
            self.act(relay_wire.INPUT, numbers, say)
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
    ) -> None:
        live: dict[int, int] = {}  # worker -> its stream's channel
        lock = threading.Lock()
        by_index = {w.index: w for w in self.workers}
        moved: list[int] = []  # lost to the tree, where RECONNECTS asks for more: followed from this machine
        here: list[threading.Thread] = []
        halt = threading.Event()  # ends those (STOP, or this follow's end)

        def make(w: int) -> Chan:
            err = bytearray()
            out, over = _records_to(w, take)

            def end(rc: int | None, why: str) -> None:
                reopen = False
                if rc is None:
                    if reconnects and not (stop is not None and stop.is_set()):
                        with lock:
                            moved.append(w)
                    elif not (stop is not None and stop.is_set()):
                        lost(w, why)
                else:
                    reopen = ended(w, rc, err.decode("utf-8", "replace"), bool(over))
                with lock:  # the stream's end and its reopening are seen together
                    live.pop(w, None)
                    if reopen:
                        again.append(w)

            return Chan(w, out, err.extend, end)

        def tick(source: int) -> None:
            take(source, [])

        again: list[int] = [w.index for w in self._reached()]
        closed = False
        self._idle.append(tick)
        try:
            while True:
                with lock:
                    ws, again[:] = list(again), []
                    far, moved[:] = list(moved), []
                if far:  # reached again as `Threads` reaches a broken stream's worker, RECONNECTS times
                    here.append(self._follow_here(far, (call, take, ended, lost), lifeline, halt, reconnects))
                if ws:
                    opened = self.open_chans({w: bundle.call_argv(call(by_index[w])) for w in ws}, {}, make)
                    with lock:
                        live.update({w: n for w, n in opened.items() if n in self._chans})
                    if closed:  # the lifeline was cut before: these streams hear it too
                        self.act(relay_wire.CLOSE, list(opened.values()))
                if stop is not None and stop.is_set():
                    with lock:
                        numbers = list(live.values())
                    self.act(relay_wire.DROP, numbers)  # a viewer only ends its own streams: the job goes on
                    return  # (and those followed from here end too)
                if lifeline is not None and lifeline.is_set() and not closed:
                    with lock:
                        numbers = list(live.values())
                    self.act(relay_wire.CLOSE, numbers)  # each agent stops its processes, streams to the end
                    closed = True
                self._raise()  # (also what a follow from here raised before it ended)
                with lock:
                    if not live and not again and not moved and not any(t.is_alive() for t in here):
                        break
                time.sleep(0.05)
        finally:
            self._idle.remove(tick)
            halt.set()
            deadline = time.monotonic() + STOP_SECONDS
            for t in here:
                t.join(max(0.0, deadline - time.monotonic()))
        self._raise()

    def _follow_here(
        self,
        workers: list[int],
        args: tuple[Callable[[Worker], Call], Take, Ended, Callable[[int, str], None]],
        lifeline: threading.Event | None,
        halt: threading.Event,
        reconnects: int,
    ) -> threading.Thread:
        """`follow` (ARGS) of WORKERS, which the tree lost, from this machine on a thread of its own: each worker
        connected first (a failure is one of its RECONNECTS tries), ended by HALT; what it raises is raised
        where the operation waits."""

        def run() -> None:
            try:
                connect_all([r for r in self.reach.runners if r.worker.index in workers], gate=self.gate)
                self.direct.follow(*args, lifeline=lifeline, stop=halt, reconnects=reconnects, only=workers)
            except BaseException as exc:
                self.raised.append(exc)

        thread = threading.Thread(target=run, daemon=True, name="follow-here")
        thread.start()
        return thread

    def converse(
        self,
        helper: Callable[[str], Sequence[str]],
        talk: Talk,
        *,
        stop: threading.Event,
        only: Collection[int] | None = None,
    ) -> None:
        """From this machine to each worker (download): not through the relays (a root the tree reached keeps
        its one connection)."""
        self.direct.converse(helper, talk, stop=stop, only=only)

    def chorus(
        self, helper: Callable[[str], Sequence[str]], *, only: Collection[int], stop: threading.Event
    ) -> RelayChorus:
        if not self.connected:
            self.connect()
        return RelayChorus(self, helper(self.python), [w.index for w in self._reached(only)])

    def close(self) -> None:
        for link in self._links:
            link.close()
        self.direct.close()


# ---------------------------------------------------------------------------- what a relayed operation is made of
# on this machine: a channel (`Chan`: one program on one worker, what hears its bytes and its end), a program left
# running with its stdin open (`RelaySession`, for `open`) and a helper on many workers spoken to at once
# (`RelayChorus`, for `chorus`)


@dataclass
class Chan:
    """One channel: the worker it runs on and what hears its bytes and its end."""

    worker: int
    out: Callable[[bytes], None]
    err: Callable[[bytes], None]
    end: Callable[[int | None, str], None]  # (exit code, or None and why it never ran or was lost)
    link: Link | None = None


class RelaySession(Session):
    """A program left running on one worker through the relays, its stdin open."""

    def __init__(self, tree: Relays, worker: int) -> None:
        self.tree, self.worker = tree, worker
        self.number = 0
        self.buf = bytearray()
        self.err = bytearray()
        self.rc: int | None = None
        self.error = ""
        self.done = threading.Event()
        self.changed = threading.Condition()
        self.waited = 0.0

    def took(self, data: bytes) -> None:
        with self.changed:
            self.buf.extend(data)
            self.changed.notify_all()

    def took_err(self, data: bytes) -> None:
        self.err.extend(data)

    def ended_with(self, rc: int | None, why: str) -> None:
        with self.changed:
            self.rc, self.error = rc, why
            self.done.set()
            self.changed.notify_all()

    def wait_line(self, deadline: float) -> str | None:
        self.waited = max(0.0, deadline - time.monotonic())
        with self.changed:
            while b"\n" not in self.buf:
                if self.done.is_set():
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    self.tree.act(relay_wire.DROP, [self.number])
                    why = f"its agent did not answer within {self.waited:.0f} s"
                    self.rc, self.error = None, why
                    self.done.set()
                    raise UnreachableError(why)
                self.changed.wait(min(left, 0.2))
            line, _, rest = bytes(self.buf).partition(b"\n")
            self.buf[:] = rest
            return line.decode()

    def line(self, say: bytes | None, wait: float) -> str | None:
        if say is None:
            self.tree.act(relay_wire.CLOSE, [self.number])
        else:
            self.tree.act(relay_wire.INPUT, [self.number], say)
        return self.wait_line(time.monotonic() + wait)

    def alive(self) -> bool:
        return not self.done.is_set()

    def ended(self) -> tuple[int, str]:
        self.done.wait()
        if self.rc is None:
            return -1, self.error
        return self.rc, self.err.decode("utf-8", "replace")

    def release(self) -> None:
        self.tree.act(relay_wire.CLOSE, [self.number])

    def wait_end(self, deadline: float) -> None:
        self.done.wait(max(0.0, deadline - time.monotonic()))


class RelayChorus(Chorus):
    """A helper on many workers through the relays: `say` is one frame per root's link for all it reaches."""

    def __init__(self, tree: Relays, argv: Sequence[str], workers: list[int]) -> None:
        super().__init__()
        self.tree = tree
        self.err: dict[int, bytearray] = {}
        self.failed: dict[int, str] = {}
        self.why: dict[int, str] = {}  # why the connection to a worker's helper was lost

        def make(w: int) -> Chan:
            out, err = self.out.setdefault(w, bytearray()), self.err.setdefault(w, bytearray())

            def took(data: bytes) -> None:
                with self.changed:
                    out.extend(data)
                    self.changed.notify_all()

            def end(rc: int | None, why: str) -> None:
                with self.changed:  # a connection lost: why, in place of the helper's stderr
                    self.ends[w] = (rc, bytes(err) if rc is not None else why.encode())
                    self.why[w] = why
                    self.changed.notify_all()

            return Chan(w, took, err.extend, end)

        self.numbers = tree.open_chans({w: argv for w in workers}, {}, make)
        self.workers = [w for w in workers if w not in self.ends]
        self.failed = {w: self.why.get(w, "") for w, (rc, _) in self.ends.items() if rc is None}

    def say(self, workers: Collection[int], data: bytes) -> None:
        self.tree.act(relay_wire.INPUT, [self.numbers[w] for w in workers if w not in self.ends], data)

    def close(self) -> None:
        self.tree.act(relay_wire.CLOSE, list(self.numbers.values()))
