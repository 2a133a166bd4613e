"""What a running job's processes are doing, as its records tell: each process's last line and when, and its
passages through the runtimes' rendezvous points (the hook reports them, `protocol.Passage`). From these,
who the others wait for (`Waiting`): the attached view and `logs --follow` show it live, `jobs` with the
job's state. No I/O; `reporting` asks it each second while a job is followed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tpurun.job.env_contract import process_name
from tpurun.transport.runner import Worker
from tpurun.worker import protocol
from tpurun.worker.protocol import HOST

WAIT_SHOWN_AFTER = 10.0  # seconds the first process has waited at a point before the missing ones are named
SHOWN_MISSING = 4  # missing processes named in the line; the rest are counted


@dataclass
class Missing:
    """A process (or a whole worker, named as the worker) that has not reached the point the others wait at."""

    name: str  # w17, w17/c2 (sS/wN on a multislice TPU)
    address: str
    last_line: str | None  # its last line (of any of its processes, for a whole worker), None: none yet
    quiet_for: float | None  # seconds since that line

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "address": self.address,
            "last_line": self.last_line,
            "quiet_for": None if self.quiet_for is None else round(self.quiet_for, 1),
        }


@dataclass
class Waiting:
    """Processes wait at rendezvous point AT, some for WAITED seconds; ARRIVED of EXPECTED are in, MISSING not."""

    at: str
    waited: float
    arrived: int
    expected: int
    missing: list[Missing] = field(default_factory=list)

    def text(self) -> str:
        """The one line a user sees."""
        names = []
        for m in self.missing[:SHOWN_MISSING]:
            said = f"{m.name} ({m.address})"
            if m.last_line is None:
                said += ", nothing printed yet"
            else:
                line = m.last_line if len(m.last_line) <= 60 else m.last_line[:57] + "..."
                said += f", last line {_ago(m.quiet_for)}: {line!r}"
            names.append(said)
        more = len(self.missing) - SHOWN_MISSING
        if more > 0:
            names.append(f"and {more} more")
        return (
            f"waiting at {self.at} for {_ago(self.waited, ago=False)}: {self.arrived} of {self.expected} "
            f"processes in; not there: {'; '.join(names)}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "waited": round(self.waited, 1),
            "arrived": self.arrived,
            "expected": self.expected,
            "missing": [m.to_dict() for m in self.missing],
        }


def _ago(seconds: float | None, ago: bool = True) -> str:
    if seconds is None:
        return "at an unknown time"
    s = max(0, int(seconds))
    text = f"{s} s" if s < 120 else f"{s // 60} min {s % 60} s"
    return text + " ago" if ago else text


class Watch:
    """A job's processes as its records come in, from any number of threads (one per worker)."""

    def __init__(self, workers: Sequence[Worker]) -> None:
        self.workers = {w.index: w for w in workers}
        self.last: dict[tuple[int, int], tuple[str, float]] = {}  # (worker, slot) -> (last line, its time)
        self.passages: dict[tuple[int, int], list[protocol.Passage]] = {}
        self.lock = threading.Lock()

    def lines(self, worker: int, slot: int, text: str, t: float) -> None:
        """SLOT of WORKER printed TEXT at T (its last line of a batch is enough)."""
        self.last[worker, slot] = (text, t)

    def take(self, rec: protocol.Passages) -> None:
        with self.lock:
            self.passages[rec.worker, rec.slot] = list(rec.passages)

    def take_state(self, worker: int, state: protocol.JobState) -> None:
        """What a worker's job state (state.json) says: passages and last lines (`jobs`, no stream)."""
        with self.lock:
            for s in state.slots:
                self.passages[worker, s.slot] = list(s.passages)
                if s.last_line_at is not None:
                    self.last[worker, s.slot] = (s.last_line, s.last_line_at)

    def waiting(self, now: float) -> Waiting | None:
        """The rendezvous point where processes have waited longest (at least WAIT_SHOWN_AFTER seconds) while
        others of the job have not reached it, or None. The job's shape is taken from its processes that
        reached any point: their slots are expected on every worker (so a host launch's host process is not,
        where its chip processes do the meeting)."""
        with self.lock:
            passages = {k: list(v) for k, v in self.passages.items()}
            last = dict(self.last)
        slots = sorted({slot for (_, slot), ps in passages.items() if ps})  # the job's shape (see above)
        best: Waiting | None = None
        for at in {p.at for ps in passages.values() for p in ps if p.left is None}:
            here = {k: next(p for p in ps if p.at == at) for k, ps in passages.items() if any(p.at == at for p in ps)}
            open_since = min(p.entered for p in here.values() if p.left is None)
            waited = now - open_since
            if waited < WAIT_SHOWN_AFTER or (best is not None and waited <= best.waited):
                continue
            # in: inside now, or through it since this round began (an earlier round's passage does not count)
            arrived = {k for k, p in here.items() if p.left is None or p.left >= open_since}
            expected = [(w, slot) for w in sorted(self.workers) for slot in slots]
            absent = [k for k in expected if k not in arrived]
            if absent:
                best = Waiting(at, waited, len(arrived), len(expected), self._missing(absent, slots, last, now))
        return best

    def _missing(
        self,
        absent: list[tuple[int, int]],
        slots: list[int],
        last: dict[tuple[int, int], tuple[str, float]],
        now: float,
    ) -> list[Missing]:
        """ABSENT processes, a worker none of whose SLOTS arrived named once as the worker."""
        out: list[Missing] = []
        for w in sorted({w for w, _ in absent}):
            worker = self.workers[w]
            mine = [slot for ww, slot in absent if ww == w]
            if len(mine) == len(slots) and (len(slots) > 1 or slots == [HOST]):
                latest = max((v for (ww, _), v in last.items() if ww == w), key=lambda v: v[1], default=None)
                out.append(_missing(worker, worker.name, latest, now))
                continue
            for slot in mine:
                name = process_name(w, slot, worker.name)
                out.append(_missing(worker, name, last.get((w, slot)), now))
        return out


def _missing(worker: Worker, name: str, last: tuple[str, float] | None, now: float) -> Missing:
    """NAME (on WORKER) missing, with its LAST line and its time, if any."""
    if last is None:
        return Missing(name, worker.address, None, None)
    return Missing(name, worker.address, last[0], now - last[1])


@contextmanager
def reporting(watch: Watch, report: Callable[[Waiting | None], None], period: float = 1.0) -> Iterator[None]:
    """While the block runs, REPORT who WATCH's processes wait for each PERIOD seconds; None at its end."""
    done = threading.Event()

    def tick() -> None:
        while not done.wait(period):
            report(watch.waiting(time.time()))

    ticker = threading.Thread(target=tick, name="waiting", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        report(None)
