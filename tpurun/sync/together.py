"""`sync` with every worker at once, from one thread, through a fleet that speaks to many workers together
(`Fleet.chorus`: relays). The conversation is sender.sync_stream's, held with all of them at once: the
manifest is said once to all; each worker answers what it needs; the workers that need the same files form a
group, and each segment of the group's data is read once and said once to the whole group (so it crosses
each relay's link once, not once per worker below it); then each worker's end (its deletions, where there
are any), and each worker's result."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
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

    def __init__(self, chorus: Chorus, stats: dict[int, WorkerStats], manifest: Manifest) -> None:
        self.chorus, self.stats, self.manifest = chorus, stats, manifest
        self.bufs: dict[int, bytearray] = {w: bytearray() for w in chorus.workers}
        self.asking = set(chorus.workers)  # its needs not heard yet
        self.needs: dict[int, tuple[int, ...]] = {}  # heard, its data not sent yet
        self.extra: dict[int, list[str]] = {}
        self.finishing: set[int] = set()  # its end sent, its result not heard yet
        self.first = 0.0
        self.started = time.monotonic()

    def listen(self, wait: float) -> None:
        for w, data in self.chorus.heard(wait).items():
            self.bufs[w] += data
            for kind, payload in _frames(self.bufs[w]):
                self._take(w, kind, payload)
        for w in list(self.asking | self.finishing):
            ended = self.chorus.ended(w)  # (None until what it wrote before its end was heard)
            if ended is not None:
                why = why_ended(*ended)
                st = self.stats[w]
                st.unreachable = ended[0] is None
                st.error = f"{st.name} ({st.address}): {why}" if st.unreachable else why
                st.seconds = round(time.monotonic() - self.started, 3)
                self.asking.discard(w)
                self.finishing.discard(w)

    def _take(self, w: int, kind: bytes, payload: bytes) -> None:
        st = self.stats[w]
        reply = sync_helper.unpack_json(payload)
        if w in self.asking:
            self.asking.discard(w)
            if kind == sync_helper.Frame.REFUSED:
                st.error = str(reply.get("error"))
                st.seconds = round(time.monotonic() - self.started, 3)
                return
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
    """MANIFEST of SRC to DEST on every worker of CHORUS; fills STATS."""
    for w, why in chorus.failed.items():
        stats[w].error, stats[w].unreachable = why, True
    talk = _Talk(chorus, stats, manifest)
    for w in chorus.workers:
        stats[w].files_total = len(manifest.files) + len(manifest.links)
    said_needs = False
    try:
        chorus.say(
            chorus.workers, frame(sync_helper.Frame.MANIFEST, sync_helper.pack_json(manifest.to_wire(dest, delete)))
        )
        while talk.asking or talk.needs or talk.finishing:
            if stop.is_set():
                raise Interrupted()
            talk.listen(0.1)
            if not talk.needs or (talk.asking and time.monotonic() - talk.first < GROUP_WAIT):
                continue
            if not said_needs and on_needs is not None:
                on_needs(manifest, list(talk.needs.values()))
            said_needs = True
            _send(talk, manifest, src, delete=delete, rules=rules, progress=progress, stop=stop)
    finally:
        chorus.close()


def _send(
    talk: _Talk,
    manifest: Manifest,
    src: Path,
    *,
    delete: bool,
    rules: ignore.Rules,
    progress: Counters,
    stop: threading.Event,
) -> None:
    """The data of every worker whose needs were heard, a group's once for the group; then each one's end."""
    ready, talk.needs = talk.needs, {}
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for w, need in ready.items():
        groups[need].append(w)
        progress.plan(len(need), talk.stats[w].bytes_needed)
    for need, members in groups.items():
        for seg in data_segments(manifest, src, need, stop):
            talk.chorus.say(members, seg.data)
            for w in members:
                talk.stats[w].bytes_sent += seg.nbytes
            progress.sent(seg.files * len(members), seg.nbytes * len(members))
    tails: dict[bytes, list[int]] = defaultdict(list)
    for w in ready:
        doomed = deletions(talk.extra.get(w, []), rules) if delete else []
        tail = frame(sync_helper.Frame.DELETE, sync_helper.pack_json(doomed)) if doomed else b""
        tails[tail + frame(sync_helper.Frame.END)].append(w)
    for tail, members in tails.items():
        talk.chorus.say(members, tail)
    talk.finishing.update(ready)
