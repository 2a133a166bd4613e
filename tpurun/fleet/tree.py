"""The relay trees a relayed fleet (relays.py) stands on. This machine reaches a few workers of each slice (the
roots, `TPURUN_RELAY_ROOTS` per slice) over SSH and starts tpurun's relay there (worker/relay.py); each reaches
up to `TPURUN_RELAY_FANOUT` more at their addresses inside the slice, and so on down a balanced tree
(relay_wire.plan), every worker of it running one relay. A channel opened on a worker is that worker's relay's
child process; its bytes travel up the tree batched with its subtree's, so this machine keeps a few SSH
connections and a thread for each (a `Link`), whatever the pod's size (see relay_wire for the frames).

Trust: each relay checks each of its children's host keys against the one tpurun pinned for that TPU and
worker (the plan carries them; never trust on first use), as this machine checks the roots'. tpurun's key
goes to the roots that have children only, into an ssh-agent the relays below use forwarded while they
connect, ended once the tree stands.

A worker not reached while a tree is planted takes none below it along (they are planned anew); a relay lost
later takes its subtree with it (each told why, with the workers it took named once: `lost_with`), until
`regrow` plants a tree of their own for them."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence

from tpurun import config
from tpurun.errors import TpurunError, UnreachableError, UsageError
from tpurun.fleet import bundle
from tpurun.fleet.channels import Chan
from tpurun.fleet.interface import connect_all, connect_window
from tpurun.fleet.threads import Reach
from tpurun.naming import which
from tpurun.transport.runner import BEHIND_TIMEOUTS, INTERNAL_PORT, Runner, Stream, Worker, open_stream
from tpurun.worker import bundle_name, relay_wire
from tpurun.worker.protocol import AgentExit

ROUNDS = 3  # how many workers of a group are tried in turn as its root
START_SECONDS = 60.0  # a root's relay says it started within this
READY_SECONDS = 180.0  # and its tree stands (or says which workers it could not reach) within this


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

    def __init__(self, tree: Tree, root: relay_wire.Node, runner: Runner) -> None:
        self.tree, self.root, self.runner = tree, root, runner
        self.workers = set(root.indexes())
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.unreached: dict[int, str] = {}
        self.gone = ""
        self.stream: Stream | None = None
        # what was said to the relay before it said it started (its plan, and what was pipelined behind it): said
        # again to the relay started anew once its bundle is installed; None once it said HELLO
        self.early: list[bytes] | None = []

    def start(self, plan: dict[str, object]) -> None:
        """Start the relay on the root (installing the bundle where missing) and hand it PLAN, with whatever was
        sent before the relay answered (`send`) behind it: its exec, the plan and the frames after it leave
        together, and the relay takes each frame once its tree stands (a command's OPEN waits there, not here)."""
        argv = bundle.program_argv(self.tree.python, "relay.py")
        with self.lock:
            assert self.early is not None
            self.early.insert(0, relay_wire.json_frame(relay_wire.PLAN, plan))
        for installed in (False, True):
            stream = open_stream(self.runner, argv)
            with self.lock:
                self.stream = stream
                try:
                    stream.write(b"".join(self.early or ()))
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
            with self.lock:
                self.early = None
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
                    silent = time.monotonic() - heard
                    # silent: not where what it sent waits unread here (this process behind), up to a bound
                    if silent > self.tree.silence * (BEHIND_TIMEOUTS if self.stream.behind() else 1):
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
            told = self.tree.lost_workers(self, self.workers, why)
            if not self.ready.is_set():
                self.unreached = told
                self.ready.set()

    def send(self, data: bytes) -> None:
        """DATA down the link; before the relay said it started, kept to be said again to a relay started anew."""
        if self.gone:
            return
        with self.lock:
            if self.early is not None:
                self.early.append(data)
            if self.stream is None:
                return  # the plan is not sent yet: DATA follows it
            try:
                self.stream.write(data)
            except TpurunError as exc:
                if self.early is None:  # before, the start's reading says why it ended
                    self.lose(f"relay {self.root.label} went away: {exc}")

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


class Tree:
    """This machine's links to the roots of every slice, the channels open through them, and which workers they
    cannot reach now; see the module's docstring. It is what the channels of relayed operations are opened on
    and acted on through (`channels.Channels`)."""

    def __init__(self, reach: Reach, *, key: str, pins: Callable[[], Mapping[str, str]], python: str) -> None:
        self.reach, self.key, self.pins, self.python = reach, key, pins, python
        self.pinned = pins()  # {host key alias: the key pinned for it}, read again for a TPU made anew
        self.connected = False
        self.unreached: dict[int, str] = {}  # {worker: why} for those not reached now
        self.missed: dict[int, str] = {}  # {worker: why} for those a tree's planting did not reach (never reached)
        self._planting: tuple[list[Link], list[threading.Thread], dict[int, str]] | None = None  # `plant`'s, for `stand`
        self._links: list[Link] = []
        self._link_of: dict[int, Link] = {}
        self.chans: dict[int, tuple[Chan, Link]] = {}  # the open channels, and the link each is on
        self._growing = threading.Lock()  # one tree planted at a time
        self._numbers = itertools.count(1)
        self.ticks: list[Callable[[int], None]] = []  # each told of a link that had nothing to say
        self.gate = threading.BoundedSemaphore(connect_window())
        self.raised: list[BaseException] = []  # what a link's reader raised, raised again by the operation
        self.silence = relay_silence()

    def check(self) -> None:
        """Raise what a link's reader raised (a bug, here or in a channel's callback), where an operation waits."""
        if self.raised:
            raise self.raised[0]

    @property
    def workers(self) -> list[Worker]:
        return [r.worker for r in self.reach.runners]

    def _node(self, w: Worker) -> relay_wire.Node:
        key = self.pinned.get(w.host_key, "")
        return relay_wire.Node(w.index, w.name, w.internal or w.address, INTERNAL_PORT, w.user, w.host_key, key)

    def connect(self) -> dict[int, str]:
        """The relay trees, planted once: {worker: why not} for the workers they could not reach."""
        if not self.connected:
            self.plant()
            self.stand()
        return self.unreached

    def plant(self) -> None:
        """The first half of `connect`: the roots reached and each relay started with its plan, its tree not
        standing yet. What is opened now (`open_chans`) follows each plan down its link, and each relay acts on it
        once its tree stands: a command's OPEN costs no round trip of its own. `stand` waits for the trees."""
        if self.connected or self._planting is not None:
            return
        roots, fanout = relay_shape()
        groups = self._groups(roots)
        before = self.reach.runners
        # the first heads through the target's own connect: where one does not prove who it is, the API is asked
        # (a TPU gone is raised, one made anew under the name is used with its own workers)
        failed: dict[int, str] | None = self.reach.connect(only={g[0].index for g in groups})
        if self.reach.runners is not before:  # made anew: its workers, and the keys pinned for them now
            self.pinned = self.pins()
            groups = self._groups(roots)
            failed = None  # (a head connected already is not connected again)
        self._growing.acquire()
        try:
            self._planting = self._plant(groups, fanout, failed)
        except BaseException:
            self._growing.release()
            raise

    def stand(self) -> dict[int, str]:
        """The second half of `connect`: every tree `plant` planted stands (or said which workers it could not
        reach); {worker: why not} for the workers not reached."""
        if self._planting is None:
            return self.unreached
        try:
            self._stand(*self._planting)
        finally:
            self._planting = None
            self.connected = True
            self._growing.release()
        return self.unreached

    def regrow(self, workers: Collection[int]) -> dict[int, str]:
        """WORKERS, which a lost relay took along, reached again through trees of their own planted as `connect`
        plants them (each group's first worker reached from this machine afresh): {worker: why not} for those
        it could not reach, which stay lost."""
        roots, fanout = relay_shape()
        with self._growing:
            ws = set(workers)
            for link in self._links:
                link.workers -= ws  # what a link that took them says of them later is not theirs any more
            for w in ws:
                self.unreached.pop(w, None)
                self.missed.pop(w, None)
            groups = self._groups(roots, only=ws)
            heads = {g[0].index for g in groups}
            for r in self.reach.runners:
                if r.worker.index in heads:
                    r.close()  # a connection to a worker that went may look alive yet: made anew
            return self._stand(*self._plant(groups, fanout, None))

    def _plant(
        self, groups: list[Sequence[relay_wire.Node]], fanout: int, failed: dict[int, str] | None
    ) -> tuple[list[Link], list[threading.Thread], dict[int, str]]:
        """A tree for each of GROUPS through its first worker this machine reaches (FAILED: the heads' connects
        tried already), ROUNDS of them in turn, each root's relay being started: the links, the threads starting
        them, and {worker: why not} for the workers not reached (by `_stand`, the trees' too)."""
        runners = {r.worker.index: r for r in self.reach.runners}
        unreached: dict[int, str] = {}
        links: list[Link] = []
        for round in range(ROUNDS):
            if not groups:
                break
            if failed is None or round:
                failed = connect_all([runners[g[0].index] for g in groups], gate=self.gate)
            again = []
            for g in groups:
                if g[0].index in failed:
                    unreached[g[0].index] = failed[g[0].index]
                    if len(g) > 1:
                        again.append(g[1:])
                    continue
                (tree,) = relay_wire.plan(g, fanout, roots=1)
                links.append(Link(self, tree, runners[tree.index]))
            groups = again
        for g in groups:
            for n in g:
                unreached[n.index] = f"not reached: {ROUNDS} workers of its group could not be reached in turn"
        self.missed.update(unreached)
        self.unreached.update(unreached)
        self._links.extend(links)
        return links, self._start_links(links, fanout), unreached

    def _groups(self, roots: int, only: Collection[int] | None = None) -> list[Sequence[relay_wire.Node]]:
        """Each slice's workers (of ONLY) in ROOTS groups, each to be reached through its first worker."""
        by_slice: dict[int | None, list[Worker]] = defaultdict(list)
        for w in self.workers:
            if only is None or w.index in only:
                by_slice[w.slice].append(w)
        return [g for ws in by_slice.values() for g in relay_wire.chunks([self._node(w) for w in ws], roots)]

    def _start_links(self, pending: list[Link], fanout: int) -> list[threading.Thread]:
        plan_common = {"python": self.python, "bundle": bundle_name(), "timeout": self.silence, "silence": self.silence,
                       "fanout": fanout, "run": bundle.RUN}  # fmt: skip

        def start(link: Link) -> None:
            try:
                key = {"key": self.key} if link.root.children else {}  # a root without children connects to none
                link.start({**plan_common, **key, "node": link.root.to_wire()})
            except TpurunError as exc:
                link.lose(str(exc))

        for link in pending:
            for w in link.workers:
                self._link_of[w] = link
        threads = [threading.Thread(target=start, args=(link,), daemon=True) for link in pending]
        for t in threads:
            t.start()
        return threads

    def _stand(self, pending: list[Link], threads: list[threading.Thread], unreached: dict[int, str]) -> dict[int, str]:
        """Wait for PENDING's relays (started by THREADS) to stand: UNREACHED with the workers their trees could
        not reach."""
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
        self.check()
        for link in pending:
            unreached.update(link.unreached)
        self.unreached.update(unreached)
        return unreached

    def dispatch(self, link: Link, kind: int, number: int, payload: bytes) -> None:
        """A frame from LINK's relay."""
        if kind == relay_wire.BEAT:
            return
        if kind == relay_wire.READY:
            link.unreached = {int(w): why for w, why in json.loads(payload)["unreached"].items()}
            self.missed.update(link.unreached)  # before the EXITs of what was opened on them, which follow
            link.ready.set()
            return
        if kind == relay_wire.LOST:
            doc = json.loads(payload)
            self.lost_workers(link, set(doc["workers"]) & link.workers, doc["why"])
            return
        on = self.chans.get(number)
        if on is None or on[1] is not link:  # a channel of another root's: never this one's to say
            return
        chan = on[0]
        if kind == relay_wire.OUT:
            chan.out(payload)
        elif kind == relay_wire.ERR:
            chan.err(payload)
        elif kind == relay_wire.EXIT:
            self.chans.pop(number, None)
            doc = json.loads(payload)
            chan.end(doc.get("rc"), doc.get("error", ""))

    def idle(self, link: Link) -> None:
        for tick in list(self.ticks):
            tick(link.root.index)

    def lost_workers(self, link: Link, workers: Collection[int], why: str) -> dict[int, str]:
        """WORKERS, a relay's subtree below LINK, lost with it for WHY: each of those not lost before is told WHY
        with the subtree named once in it (`lost_with`), and its channels on LINK end so; what each was told."""
        fresh = [w for w in workers if w not in self.unreached]
        told = lost_with(why, [w.name for w in self.workers if w.index in fresh])
        for w in fresh:
            self.unreached.setdefault(w, told)
            if not link.ready.is_set():  # lost while its tree was planted: never reached
                self.missed.setdefault(w, told)
        for number, (chan, on) in list(self.chans.items()):
            if on is link and chan.worker in workers and self.chans.pop(number, None) is not None:
                chan.end(None, self.unreached.get(chan.worker, told))
        return {w: self.unreached.get(w, told) for w in workers}

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
            if link is None or link.gone or w in self.unreached:
                chan.end(None, self.unreached.get(w) or (link.gone if link else "not reached"))
                continue
            self.chans[number] = (chan, link)
            by_link[id(link)].setdefault(tuple(argv), {})[number] = (w, dict(envs.get(w, {})))
        for link in self._links:
            for argv, workers in by_link.get(id(link), {}).items():
                link.send(relay_wire.json_frame(relay_wire.OPEN, relay_wire.Opening(argv, workers).to_wire()))
        return numbers

    def adopt(self, number: int, chan: Chan) -> bool:
        """CHAN hears the open channel NUMBER from now on (in place of what heard it); False where it has ended."""
        on = self.chans.get(number)
        if on is None:
            return False
        self.chans[number] = (chan, on[1])
        return True

    def act(self, kind: int, numbers: Collection[int], data: bytes = b"") -> None:
        """KIND (INPUT with DATA, CLOSE, DROP) on every channel of NUMBERS still open, one frame per link."""
        by_link: dict[int, list[int]] = defaultdict(list)
        for n in numbers:
            on = self.chans.get(n)
            if on is not None:
                by_link[id(on[1])].append(n)
        for link in self._links:
            if id(link) in by_link:
                link.send(relay_wire.set_frame(kind, by_link[id(link)], data))

    def drop(self, numbers: Collection[int]) -> None:
        """DROP the channels of NUMBERS and forget them: nothing of theirs is heard any more."""
        self.act(relay_wire.DROP, numbers)
        for n in numbers:
            self.chans.pop(n, None)

    def reached(self, only: Collection[int] | None = None) -> list[Worker]:
        return [w for w in self.workers if w.index not in self.unreached and (only is None or w.index in only)]

    def close(self) -> None:
        for link in self._links:
            link.close()
