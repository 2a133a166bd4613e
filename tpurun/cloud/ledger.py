"""The spend ledger: what tpurun made, adopted, stopped, started and deleted, and the jobs it ran, each with when
and at what price, kept after the TPUs and the jobs' records are gone (`tpurun cost`, and the stopped intervals
`list` and `describe` leave out of a TPU's cost).

`$TPURUN_HOME/ledger.jsonl` (0600): one JSON event per line, appended, never rewritten. A TPU is known by its
nodes' unique ids (a name is not an identity: one made again under a name is another TPU). Events:

- a TPU's: `created`, `attached` and `priced` (the first job on a TPU tpurun neither made nor adopted) with its
  accelerator type, chips, provisioning, the API's createTime and its price then; `stopped`, `started`, `deleted` (by tpurun) and `gone` (found missing by a command: deleted by
  its watchdog, the console, a preemption's clean-up; it was gone by then, maybe long before);
- a job's: `started` (its TPU, its price) and `ended` (its end's word, and when it ended as its workers said).
"""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpurun.cloud import prices

if TYPE_CHECKING:
    from tpurun.cloud.prices import Price
    from tpurun.cloud.views import NodeView

FILE = "ledger.jsonl"
TPU_EVENTS = ("created", "attached", "priced", "stopped", "started", "deleted", "gone")


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def stamp(when: dt.datetime | None = None) -> str:
    return (when or now()).astimezone(dt.timezone.utc).isoformat(timespec="milliseconds")


def read_time(text: Any) -> dt.datetime | None:
    if not text:
        return None
    value = dt.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)


def append(home: Path, event: dict[str, Any]) -> None:
    """Add EVENT (its time `at` added when missing) to HOME's ledger: one line, written with one `write` on a file
    opened for appending, so two commands at once never interleave their lines."""
    line = json.dumps({"at": stamp(), **event}, separators=(",", ":")) + "\n"
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(home / FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def events(home: Path) -> list[dict[str, Any]]:
    """HOME's ledger in the order written; a line a crash cut short is skipped."""
    try:
        text = (home / FILE).read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "at" in event:
            out.append(event)
    return out


def tpu_event(home: Path, project: str, event: str, view: NodeView, price: Price | None = None) -> None:
    """EVENT (one of TPU_EVENTS) of the TPU VIEW in PROJECT; `created` and `attached` carry what its cost is
    reckoned from."""
    record: dict[str, Any] = {
        "what": "tpu",
        "event": event,
        "project": project,
        "zone": view.zone,
        "name": view.name,
        "ids": identity_of(view),
    }
    if event in ("created", "attached", "priced"):
        record.update(
            acceleratorType=view.accelerator_type,
            slices=max(1, len(view.slices)),
            provisioning=prices.provisioning_of(view),
            createTime=stamp(view.created) if view.created else None,
            price=price.to_json() if price is not None else None,
        )
    append(home, record)


def identity_of(view: NodeView) -> list[str]:
    """The TPU's identity: its nodes' unique ids (every slice's), else its name where the API gives none."""
    ids = [v.id for v in view.parts if v.id]
    return ids or [f"name:{view.zone}/{view.name}"]


@dataclass
class Life:
    """A TPU's life as the ledger tells it: from its creation until it was deleted or found gone (open while
    neither), with the intervals tpurun stopped it."""

    key: tuple[str, ...]
    project: str
    zone: str
    name: str
    accelerator_type: str = ""
    provisioning: str = "on-demand"
    price: dict[str, Any] | None = None  # prices.Price.to_json() when it was made or adopted; None: no price
    start: dt.datetime | None = None
    end: dt.datetime | None = None
    ended: str = ""  # "deleted" (by tpurun), "gone" (found missing: it went at the latest then), "" (open)
    stopped: list[list[dt.datetime | None]] = field(default_factory=list)  # [from, until (None: still)]

    def up(self, until: dt.datetime | None = None) -> list[tuple[dt.datetime, dt.datetime]]:
        """The intervals it was up (billed for its chips): from its creation until its end (else UNTIL, else now),
        less the stops tpurun made."""
        if self.start is None:
            return []
        last = self.end or until or now()
        out, begin = [], self.start
        for stop, restart in self.stopped:
            if stop is None or stop >= last:
                break
            if stop > begin:
                out.append((begin, stop))
            if restart is None:
                return out
            begin = max(begin, restart)
        if last > begin:
            out.append((begin, last))
        return out

    def up_hours(self, until: dt.datetime | None = None) -> float:
        return sum((b - a).total_seconds() for a, b in self.up(until)) / 3600

    def per_hour(self) -> float | None:
        return rate(self.price)

    def cost(self, until: dt.datetime | None = None) -> float | None:
        rate = self.per_hour()
        return None if rate is None else rate * self.up_hours(until)


def rate(price: dict[str, Any] | None) -> float | None:
    """USD per hour of a price as the ledger keeps it (`prices.Price.to_json`), None for none."""
    if not price:
        return None
    return float(price["per_chip_hour"]) * int(price["chips"])


def lives(home: Path) -> list[Life]:
    """Every TPU the ledger names, in the order it first appears."""
    found: dict[tuple[str, ...], Life] = {}
    for e in events(home):
        if e.get("what") != "tpu":
            continue
        key = tuple(e.get("ids") or ())
        life = found.get(key)
        at = read_time(e["at"])
        if life is None:
            life = found[key] = Life(key, e.get("project", ""), e.get("zone", ""), e.get("name", ""))
        fold(life, e["event"], at, e)
    return list(found.values())


def fold(life: Life, event: str, at: dt.datetime | None, e: dict[str, Any]) -> None:
    """One event of LIFE's, at AT."""
    if event in ("created", "attached", "priced"):
        life.accelerator_type = e.get("acceleratorType", life.accelerator_type)
        life.provisioning = e.get("provisioning", life.provisioning)
        life.price = e.get("price", life.price)
        life.start = life.start or read_time(e.get("createTime")) or at
    elif event == "stopped" and not (life.stopped and life.stopped[-1][1] is None):
        life.stopped.append([at, None])
    elif event == "started" and life.stopped and life.stopped[-1][1] is None:
        life.stopped[-1][1] = at
    elif event in ("deleted", "gone") and life.end is None:
        life.end, life.ended = at, event


def life_of(home: Path, view: NodeView) -> Life | None:
    """What the ledger knows of the TPU VIEW (by its identity), or None."""
    key = tuple(identity_of(view))
    return next((life for life in lives(home) if life.key == key), None)


def job_started(
    home: Path, job: str, attempt: int, where: tuple[str, str, str, list[str]], at: float, price: dict[str, Any] | None
) -> None:
    """A job's attempt started AT (time.time()) on the TPU WHERE (name, project, zone, its nodes' ids) at PRICE
    (`prices.Price.to_json`; None: no price)."""
    name, project, zone, ids = where
    append(
        home,
        {"what": "job", "event": "started", "job": job, "attempt": attempt, "tpu": name, "project": project,
         "zone": zone, "ids": ids, "startedAt": stamp(epoch(at)), "price": price},
    )  # fmt: skip


def job_ended(home: Path, job: str, attempt: int, end: str, at: float) -> None:
    """A job's attempt ended as END, AT (time.time()) as its workers said."""
    append(
        home,
        {"what": "job", "event": "ended", "job": job, "attempt": attempt, "end": end, "endedAt": stamp(epoch(at))},
    )


def epoch(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc)
