"""`sync`'s conversation with every worker at once, through the fleet's `chorus` (each worker's helper over its
own pipe in `Threads`, a channel through the relays in `Relays`). The manifest is said once to all; each worker
answers what it needs; the workers that need the same files form a group, and each segment of the group's data
is read once and said once to the whole group (through relays it crosses each relay's link once, not once per
worker below it); then each worker's end (its deletions, where there are any), and each worker's result.

Each group's data goes from a thread of its own while this one listens, so a worker whose needs come late
(after GROUP_WAIT) gets a group and a reader of its own at once, not after the others' data; within a group,
one read serves every member, and the group moves at the pace of its slowest member still there."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from tpurun import ignore
from tpurun.fleet.interface import Chorus
from tpurun.sync.stream import (
    GROUP_WAIT,
    Counters,
    Interrupted,
    Manifest,
    Needs,
    WorkerStats,
    data_segments,
    deletions,
    frame,
    why_ended,
)
from tpurun.worker import sync_helper


def _frames(buf: bytearray) -> list[tuple[bytes, bytes]]:
    """The whole frames at the start of BUF, taken out of it."""
    out = []
    size = sync_helper.HEADER.size
    while len(buf) >= size:
        kind, length = sync_helper.HEADER.unpack_from(buf)
        if len(buf) < size + length:
            break
        out.append((kind, bytes(buf[size : size + length])))
        del buf[: size + length]
    return out


class _Talk:
    """Where each worker stands: waiting for its needs, for its data, for its result, or done."""

    def __init__(
        self,
        chorus: Chorus,
        stats: dict[int, WorkerStats],
        manifest: Manifest,
        src: Path,
        progress: Counters,
        halt: threading.Event,
    ) -> None:
        self.chorus, self.stats, self.manifest, self.src = chorus, stats, manifest, src
        self.progress = progress
        self.halt = halt  # the groups' readers stop: the user stopped the sync, or it is over
        self.bufs: dict[int, bytearray] = {w: bytearray() for w in chorus.workers}
        self.asking = set(chorus.workers)  # its needs not heard yet
        self.needs: dict[int, tuple[int, ...]] = {}  # heard, its data not sent yet
        self.extra: dict[int, list[str]] = {}
        self.finishing: set[int] = set()  # its data going, or gone; its result not heard yet
        self.first = 0.0
        self.started = time.monotonic()

    def listen(self, wait: float) -> None:
        for w, data in self.chorus.heard(wait).items():
            self.bufs[w] += data
            for kind, payload in _frames(self.bufs[w]):
                try:
                    self._take(w, kind, payload)
                except Exception as exc:  # an answer this side cannot take: this worker fails, not the others
                    self._fail(w, f"{type(exc).__name__}: {exc}" if str(exc).strip() else type(exc).__name__)
        for w in list(self.asking | self.finishing):
            ended = self.chorus.ended(w)  # (None until what it wrote before its end was heard)
            if ended is not None:
                why = why_ended(*ended)
                st = self.stats[w]
                unreachable = ended[0] is None  # exit 4, not "your program failed"
                self._fail(w, f"{st.name} ({st.address}): {why}" if unreachable else why, unreachable)

    def _fail(self, w: int, why: str, unreachable: bool = True) -> None:
        st = self.stats[w]
        st.error, st.unreachable = why, unreachable
        st.seconds = round(time.monotonic() - self.started, 3)
        self.asking.discard(w)
        self.finishing.discard(w)
        self.needs.pop(w, None)

    def _take(self, w: int, kind: bytes, payload: bytes) -> None:
        st = self.stats[w]
        reply = sync_helper.unpack_json(payload)
        if w in self.asking:
            self.asking.discard(w)
            if kind == sync_helper.Frame.REFUSED:
                st.error = str(reply.get("error"))
                st.seconds = round(time.monotonic() - self.started, 3)
                return
            if kind != sync_helper.Frame.NEED:
                raise ValueError(f"the sync helper answered {kind!r} to the manifest")
            st.dest = reply.get("dest", "")
            need = tuple(reply["need"])
            st.files_needed = len(need)
            st.bytes_needed = sum(self.manifest.files[i].size for i in need)
            self.needs[w] = need
            self.extra[w] = reply.get("extra", [])
            self.first = self.first or time.monotonic()
        elif w in self.finishing and kind == sync_helper.Frame.RESULT:
            self.finishing.discard(w)
            st.files_sent, st.deleted, st.errors = reply["written"], reply["deleted"], reply["errors"]
            st.seconds = round(time.monotonic() - self.started, 3)


def sync_together(
    chorus: Chorus,
    stats: dict[int, WorkerStats],
    manifest: Manifest,
    src: Path,
    dest: str,
    *,
    delete: bool,
    rules: ignore.Rules,
    progress: Counters,
    stop: threading.Event,
    on_needs: Needs | None = None,
) -> None:
    """MANIFEST of SRC to DEST on every worker of CHORUS; fills STATS. ON_NEEDS hears what the workers that
    answered need, once, before any data goes. Raises Interrupted once STOP is set."""
    for w, why in chorus.failed.items():
        stats[w].error, stats[w].unreachable = why, True
    halt = threading.Event()
    talk = _Talk(chorus, stats, manifest, src, progress, halt)
    for w in chorus.workers:
        stats[w].files_total = len(manifest.files) + len(manifest.links)
    groups: list[_Group] = []
    said_needs = False
    try:
        chorus.say(
            chorus.workers, frame(sync_helper.Frame.MANIFEST, sync_helper.pack_json(manifest.to_wire(dest, delete)))
        )
        while talk.asking or talk.needs or talk.finishing:
            if stop.is_set():
                raise Interrupted()
            for g in groups:
                g.check()
            talk.listen(0.1)
            if not talk.needs or (talk.asking and time.monotonic() - talk.first < GROUP_WAIT):
                continue
            if not said_needs and on_needs is not None:
                on_needs(manifest, list(talk.needs.values()))
            said_needs = True
            groups += _start(talk, delete=delete, rules=rules)
        for g in groups:
            g.check()
    finally:
        halt.set()
        chorus.close()
        for g in groups:
            g.thread.join(5)  # (each stops at its next segment, or its next say)


class _Group:
    """The workers that need the same files, and the thread that reads the files once and says each segment to
    all of them, then each one's end."""

    def __init__(self, talk: _Talk, members: list[int], need: Sequence[int], tails: dict[int, bytes]) -> None:
        self.talk, self.members, self.need, self.tails = talk, members, need, tails
        self.raised: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"sync-group-w{members[0]}")

    def _run(self) -> None:
        talk = self.talk
        chorus, stats, progress = talk.chorus, talk.stats, talk.progress
        members = self.members
        try:
            for seg in data_segments(talk.manifest, talk.src, self.need, talk.halt):
                chorus.say(members, seg.data)
                for w in members:
                    stats[w].bytes_sent += seg.nbytes
                progress.sent(seg.files * len(members), seg.nbytes * len(members))
                members = [w for w in members if chorus.ended(w) is None]  # those gone hold no read
                if not members:
                    return
            ends: dict[bytes, list[int]] = defaultdict(list)
            for w in members:
                ends[self.tails[w]].append(w)
            for tail, ws in ends.items():
                chorus.say(ws, tail)
        except Interrupted:
            return  # the sync is over or stopped: the caller says which
        except BaseException as exc:  # a bug: raised where the sync waits
            self.raised.append(exc)

    def check(self) -> None:
        if self.raised:
            raise self.raised[0]


def _start(talk: _Talk, *, delete: bool, rules: ignore.Rules) -> list[_Group]:
    """A group (its own reader) for the workers whose needs were heard, by what they need."""
    ready, talk.needs = talk.needs, {}
    by_need: dict[tuple[int, ...], list[int]] = defaultdict(list)
    tails: dict[int, bytes] = {}
    for w, need in ready.items():
        by_need[need].append(w)
        talk.progress.plan(len(need), talk.stats[w].bytes_needed)
        doomed = deletions(talk.extra.get(w, []), rules) if delete else []
        tail = frame(sync_helper.Frame.DELETE, sync_helper.pack_json(doomed)) if doomed else b""
        tails[w] = tail + frame(sync_helper.Frame.END)
    talk.finishing.update(ready)
    groups = [_Group(talk, members, need, tails) for need, members in by_need.items()]
    for g in groups:
        g.thread.start()
    return groups
