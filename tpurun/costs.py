"""`tpurun cost`: what every TPU and job tpurun made or ran has cost, from the spend ledger alone (no API call:
TPUs deleted long ago and jobs whose records were pruned included), within a window (`--since`): each one's
hours, price and cost, totals per TPU type and per day, and a plot of spend over time."""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpurun import ui
from tpurun.cloud import ledger
from tpurun.errors import UsageError

DAY = dt.timedelta(days=1)


@dataclass(frozen=True)
class TpuCost:
    """One TPU's part of the window."""

    name: str
    project: str
    zone: str
    accelerator_type: str
    provisioning: str
    start: dt.datetime | None
    end: dt.datetime | None
    ended: str  # "deleted", "gone" (found missing then: it went at the latest then), "" (still up, as far as known)
    hours: float  # up in the window
    chips: int
    per_hour: float | None
    source: str  # where the price came from: "catalog", "table", "" (none)
    by_day: dict[str, float]  # UTC day -> USD

    @property
    def cost(self) -> float | None:
        return None if self.per_hour is None else self.per_hour * self.hours

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "project": self.project,
            "zone": self.zone,
            "acceleratorType": self.accelerator_type,
            "provisioning": self.provisioning,
            "created": ledger.stamp(self.start) if self.start else None,
            "ended": ledger.stamp(self.end) if self.end else None,
            "how": self.ended or "up",
            "hours": round(self.hours, 6),
            "chipHours": round(self.hours * self.chips, 6),
            "pricePerHour": self.per_hour,
            "priceSource": self.source or None,
            "cost": round(self.cost, 6) if self.cost is not None else None,
        }


@dataclass(frozen=True)
class JobCost:
    """One job attempt's part of the window."""

    job: str
    attempt: int
    tpu: str
    start: dt.datetime
    end: dt.datetime | None
    how: str  # its end's word, "" while it runs (as far as the ledger knows)
    hours: float
    per_hour: float | None

    @property
    def cost(self) -> float | None:
        return None if self.per_hour is None else self.per_hour * self.hours

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "attempt": self.attempt,
            "tpu": self.tpu,
            "started": ledger.stamp(self.start),
            "ended": ledger.stamp(self.end) if self.end else None,
            "end": self.how or None,
            "hours": round(self.hours, 6),
            "pricePerHour": self.per_hour,
            "cost": round(self.cost, 6) if self.cost is not None else None,
        }


@dataclass(frozen=True)
class Report:
    since: dt.datetime
    until: dt.datetime
    tpus: list[TpuCost]
    jobs: list[JobCost]
    unpriced: list[str] = field(default_factory=list)  # TPUs with no price: their hours are counted, not their cost

    @property
    def total(self) -> float:
        return sum(t.cost or 0.0 for t in self.tpus)

    def by_type(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for t in self.tpus:
            out[t.accelerator_type] += t.cost or 0.0
        return dict(sorted(out.items()))

    def by_day(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for t in self.tpus:
            for day, usd in t.by_day.items():
                out[day] += usd
        return dict(sorted(out.items()))

    def to_dict(self) -> dict[str, Any]:
        return {
            "since": ledger.stamp(self.since),
            "until": ledger.stamp(self.until),
            "currency": "USD",
            "total": round(self.total, 6),
            "byType": {k: round(v, 6) for k, v in self.by_type().items()},
            "byDay": {k: round(v, 6) for k, v in self.by_day().items()},
            "tpus": [t.to_dict() for t in self.tpus],
            "jobs": [j.to_dict() for j in self.jobs],
            "unpriced": self.unpriced,
        }


def parse_since(text: str) -> dt.timedelta:
    """`30d`, `12h`, `90m`, `2w`: how far back the report looks."""
    units = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    number, unit = text[:-1], text[-1:]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or not number or value <= 0:
        raise UsageError(f"--since {text!r}: give a positive number and a unit: 90m, 12h, 30d or 2w")
    return dt.timedelta(seconds=value * units[unit])


def clip(spans: list[tuple[dt.datetime, dt.datetime]], since: dt.datetime, until: dt.datetime) -> list[tuple]:
    return [(max(a, since), min(b, until)) for a, b in spans if b > since and a < until]


def split_days(spans: list[tuple[dt.datetime, dt.datetime]]) -> dict[str, float]:
    """Hours of SPANS in each UTC day."""
    out: dict[str, float] = defaultdict(float)
    for a, b in spans:
        while a < b:
            midnight = dt.datetime.combine(a.date(), dt.time(), dt.timezone.utc) + DAY
            part = min(b, midnight)
            out[a.date().isoformat()] += (part - a).total_seconds() / 3600
            a = part
    return dict(out)


def report(home: Path, since: dt.timedelta, until: dt.datetime | None = None) -> Report:
    """What HOME's ledger says was spent from SINCE before UNTIL (now) until then."""
    until = until or ledger.now()
    begin = until - since
    tpus, unpriced = [], []
    lives = ledger.lives(home)
    for life in lives:
        spans = clip(life.up(until), begin, until)
        if not spans:
            continue
        rate = life.per_hour()
        hours = sum((b - a).total_seconds() for a, b in spans) / 3600
        price = life.price or {}
        if rate is None:
            unpriced.append(life.name)
        tpus.append(
            TpuCost(
                life.name,
                life.project,
                life.zone,
                life.accelerator_type,
                life.provisioning,
                life.start,
                life.end,
                life.ended,
                hours,
                int(price.get("chips", 0)),
                rate,
                str(price.get("source", "")),
                {day: h * (rate or 0.0) for day, h in split_days(spans).items()},
            )
        )
    ends = {life.key: life.end for life in lives if life.end is not None}
    return Report(begin, until, tpus, _jobs(home, begin, until, ends), unpriced)


def _jobs(
    home: Path, begin: dt.datetime, until: dt.datetime, tpu_ends: dict[tuple[str, ...], dt.datetime]
) -> list[JobCost]:
    """Every job attempt of HOME's ledger within the window; one whose end was never seen ended at the latest with
    its TPU (TPU_ENDS: when each TPU the ledger saw end went)."""
    started: dict[tuple[str, int], dict[str, Any]] = {}
    ended: dict[tuple[str, int], dict[str, Any]] = {}
    for e in ledger.events(home):
        if e.get("what") == "job":
            key = (str(e.get("job")), int(e.get("attempt", 0)))
            (started if e.get("event") == "started" else ended).setdefault(key, e)
    out = []
    for key, s in started.items():
        start = ledger.read_time(s.get("startedAt") or s["at"])
        e = ended.get(key, {})
        end = ledger.read_time(e.get("endedAt") or e.get("at")) if e else tpu_ends.get(tuple(s.get("ids") or ()))
        spans = clip([(start, end or until)], begin, until) if start else []
        if not spans or start is None:
            continue
        rate = ledger.rate(s.get("price"))
        hours = sum((b - a).total_seconds() for a, b in spans) / 3600
        out.append(JobCost(key[0], key[1], str(s.get("tpu", "")), start, end, str(e.get("end", "")), hours, rate))
    return out


def plot(rep: Report, path: Path) -> None:
    """A bar chart of REP's spend per day, in USD, written to PATH (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(
            "--plot needs matplotlib", hint="`pip install 'tpurun[plot]'` (or matplotlib) and run it again"
        ) from None
    days = rep.by_day()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(list(days), list(days.values()), color="#4285f4")
    ax.set_ylabel("USD per day")
    ax.set_title(f"TPU spend, {ledger.stamp(rep.since)[:10]} to {ledger.stamp(rep.until)[:10]}: {ui.usd(rep.total)}")
    ax.tick_params(axis="x", labelrotation=45)
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")
    except OSError as exc:
        raise UsageError(f"--plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
