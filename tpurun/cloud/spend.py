"""What a TPU costs, for `list` and `describe`: its price per hour (`prices`) and what it has cost so far, the
hours since the API's createTime less the intervals the ledger saw it stopped; what the number cannot see is said
beside it. Loads the Billing Catalog's client only through `prices`, when a price is asked."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpurun import ui
from tpurun.cloud import ledger, prices

if TYPE_CHECKING:
    from tpurun.cloud.prices import Price
    from tpurun.cloud.views import NodeView

log = logging.getLogger(__name__)

STOPPED_UNSEEN = "stopped at a time tpurun did not see: counted as up until now, so at most this"
NO_CREATE_TIME = "the API gives no creation time: nothing counted"


@dataclass(frozen=True)
class Spend:
    """A TPU's price (None: no published price for it) and the hours it has been billed for so far."""

    price: Price | None
    hours: float
    note: str = ""  # what the number leaves out or cannot see, "" when nothing

    @property
    def cost(self) -> float | None:
        return None if self.price is None else self.price.per_hour * self.hours

    def to_dict(self) -> dict[str, Any]:
        """`list`/`describe --json`: `pricePerHour` and `costSoFar` in USD (null without a price), the price's
        source, and what the cost cannot see."""
        price = self.price
        return {
            "pricePerHour": round(price.per_hour, 6) if price else None,
            "costSoFar": round(self.cost, 6) if self.cost is not None else None,
            "price": {
                "perChipHour": price.per_chip_hour,
                "chips": price.chips,
                "provisioning": price.provisioning,
                "source": price.source,
                "asOf": price.as_of,
                "sku": price.sku,
            }
            if price
            else None,
            "costNote": self.note or None,
        }

    def label(self) -> str:
        """`$19.20/h` for a table; `-` without a price."""
        return f"{ui.usd(self.price.per_hour)}/h" if self.price else "-"

    def cost_label(self) -> str:
        return (
            ui.usd(self.cost) + (" (at most)" if self.cost is not None and self.note == STOPPED_UNSEEN else "")
        )


def spend_of(view: NodeView, price: Price | None, life: ledger.Life | None, at: dt.datetime | None = None) -> Spend:
    """What VIEW has cost by AT (now) at PRICE, LIFE being what the ledger knows of it (its stops)."""
    if view.created is None:
        return Spend(price, 0.0, NO_CREATE_TIME)
    stops = life.stopped if life else []
    seen = ledger.Life((), "", view.zone, view.name, start=view.created, stopped=stops)  # the API's creation
    unseen = view.state == "STOPPED" and not (stops and stops[-1][1] is None)
    return Spend(price, seen.up_hours(at), STOPPED_UNSEEN if unseen else "")


def spends(views: list[NodeView], endpoint: str, home: Path) -> list[Spend]:
    """Each of VIEWS' spend (the ledger read once, each price asked once)."""
    known = {life.key: life for life in ledger.lives(home)}
    asked: dict[tuple[str, str, str, int, str], Price | None] = {}
    out = []
    for v in views:
        key = (v.accelerator_type, v.zone, prices.provisioning_of(v), max(1, len(v.slices)), v.backend)
        if key not in asked:
            asked[key] = prices.price_of(v, endpoint, home)
        out.append(spend_of(v, asked[key], known.get(tuple(ledger.identity_of(v)))))
    return out


def price_listing(
    home: Path, project: str, zones: set[str] | None, endpoint: str, views: list[NodeView], *, complete: bool
) -> None:
    """Give each of VIEWS, the TPUs a command listed in PROJECT's ZONES (None: every zone), its spend; a COMPLETE
    listing (every API answered) also tells the ledger which of its TPUs are gone."""
    if complete:  # an API passed over shows none of its TPUs: none is gone for that
        notice_gone(home, project, zones, views)
    for v, cost in zip(views, spends(views, endpoint, home), strict=True):
        v.spend = cost


def notice_gone(home: Path, project: str, zones: set[str] | None, listed: list[NodeView]) -> None:
    """The TPUs the ledger holds as alive in PROJECT (in ZONES; None: every zone) that a listing did not show:
    gone by now (deleted by their watchdog, the console, a preemption's clean-up), written so once."""
    shown = {i for v in listed for i in ledger.identity_of(v)}  # a multislice TPU's slices may be listed alone
    for life in ledger.lives(home):
        if life.end is None and life.project == project and (zones is None or life.zone in zones):
            if shown.isdisjoint(life.key) and life.start is not None:
                ledger.append(
                    home,
                    {
                        "what": "tpu",
                        "event": "gone",
                        "project": project,
                        "zone": life.zone,
                        "name": life.name,
                        "ids": list(life.key),
                    },
                )


def price_for(home: Path, project: str, endpoint: str, ids: list[str], view_of: Callable[[], NodeView]) -> Price | None:
    """The price of the TPU whose nodes have IDS, for a job on it: as the ledger keeps it since tpurun made,
    adopted or first priced it (no API call); else asked now (VIEW_OF: the API's view of it) and kept as `priced`.
    None: no published price."""
    life = next((life for life in ledger.lives(home) if life.key == tuple(ids)), None)
    if life is not None:
        return prices.Price.from_json(life.price) if life.price else None
    view = view_of()
    price = prices.price_of(view, endpoint, home)
    remember(home, project, endpoint, "priced", view, price)
    return price


def remember(home: Path, project: str, endpoint: str, event: str, view: NodeView, price: Price | None = None) -> None:
    """EVENT of the TPU VIEW written in the ledger (`created`, `attached` and `priced` with its PRICE, else its price
    now); a ledger that cannot be written is warned of and the command goes on (the TPU exists whatever the ledger
    says)."""
    if price is None and event in ("created", "attached"):
        price = prices.price_of(view, endpoint, home)
    try:
        ledger.tpu_event(home, project, event, view, price)
    except OSError as exc:
        log.warning("the spend ledger could not be written (%s): `tpurun cost` will not know this", exc)
