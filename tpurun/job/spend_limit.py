"""`train --budget USD`: the money a job may spend, turned into time by its TPU's price per hour (every slice), its
clock started at the job's first start and shared by its restarts (the money is spent across attempts). Each
worker's supervisor stops its part when the time is up (`JobSpec.spend_for`), so the limit holds with no client
left (a detached job, a laptop asleep); the job's end is then `budget` (job/ends.py). Called a spend limit here:
`Budgets` are the restart budgets."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tpurun import ui
from tpurun.errors import UsageError

if TYPE_CHECKING:
    from tpurun.cloud.prices import Price
    from tpurun.settings import Settings


@dataclass
class SpendLimit:
    """A job's `--budget`: USD at PRICE; UNTIL (time.monotonic()) when it is spent, from the job's first start."""

    usd: float
    price: Price
    tpu: str
    until: float | None = None

    @property
    def seconds(self) -> float:
        """How long the TPU runs for the budget."""
        return self.usd / self.price.per_hour * 3600.0

    def left(self) -> float:
        """Seconds of the budget left; the first call (the job's first start) starts its clock. Never 0 (a spec's
        "no limit"): a restart after the budget was spent stops at once."""
        if self.until is None:
            self.until = time.monotonic() + self.seconds
        return max(0.001, self.until - time.monotonic())

    def line(self) -> str:
        """`--budget $0.05: 9 s of t1 at $19.20/h (catalog price as of 2026-11-01)`: said once, before the start."""
        p = self.price
        return (
            f"--budget {ui.usd(self.usd)}: {ui.age(self.seconds)} of {self.tpu} at {ui.usd(p.per_hour)}/h "
            f"({p.source} price as of {p.as_of}); the job is stopped when it is spent"
        )

    def spent_line(self, job: str) -> str:
        return f"job {job} was stopped: its --budget of {ui.usd(self.usd)} was spent ({ui.age(self.seconds)} at " + (
            f"{ui.usd(self.price.per_hour)}/h)"
        )


def limit(s: Settings, usd: float, *, local: bool) -> SpendLimit:
    """USD's spend limit on the TPU S names, at its price per hour (every slice); refused (UsageError) on this
    machine, and for a TPU with no published price."""
    from tpurun.cloud import prices, provision
    from tpurun.cloud.client import Cloud

    if local or not s.tpu.value:
        raise UsageError("--budget counts a TPU's price: give one with --tpu (not with --local)")
    cloud = Cloud(s)
    view = provision.tpu(cloud, str(s.tpu.value))
    price = prices.price_of(view, cloud.endpoint, s.home_path)
    if price is None:
        raise UsageError(f"--budget: {view.accelerator_type} has no published price, so a budget cannot be counted")
    return SpendLimit(usd, price, view.name)
