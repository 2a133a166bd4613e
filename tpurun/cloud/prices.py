"""What a TPU costs an hour at list price: the one place prices come from.

From Google's Cloud Billing Catalog (`services.skus.list` of the Cloud TPU service, which bills v2, v3 and v4,
and of Compute Engine's, whose SKUs bill v5e and newer), read through google-cloud-billing's
`CloudCatalogClient` at the endpoint beside the Cloud TPU API's (Google's own, or the emulator's), and kept in
`$TPURUN_HOME/prices/` with the day it was read, one file per endpoint, read again after `MAX_AGE_DAYS`. When the
catalogue cannot be read (unreachable, refused, no such service), the bundled table (`tpurun/price_table.py`)
answers with its own date, and the `Price` says which (`source`). The catalogue is read with a short timeout and
retried at most once: a command never waits long for a price. google-cloud-billing is loaded only here, when a
price is asked for.

A TPU costs its chips (every slice's) times its generation's price per chip-hour in its zone's region. A Compute
Engine TPU VM (tpu7x, and v5p and v6e through their machine types) is priced the same way: the catalogue bills its
chips with the same TPU SKUs (Compute Engine's `TpuV6e ...`, `TPU7x ...`). Spot and preemptible TPUs bill alike:
the catalogue has one SKU for both ("... attached to Spot Preemptible VMs"). Flex-start is priced by its own SKU
where the catalogue has one, else as on-demand (an upper bound; the `Price` then says "on-demand"). Left out:
taxes, discounts, committed use, the boot disks, network egress.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpurun import price_table
from tpurun.errors import UsageError
from tpurun.topology import parse_accelerator_type

if TYPE_CHECKING:
    from tpurun.cloud.views import NodeView

MAX_AGE_DAYS = 7  # a catalogue read older than this is read again
TIMEOUT = 10.0  # seconds for one call to the catalogue
PAGE_SIZE = 5000  # the most SKUs the API answers in one page
PROVISIONING = ("on-demand", "spot", "flex-start")
_SPOT_WORDS = ("preemptible", "spot")
# SKUs that are not a plain hourly price of a running TPU: reservations, commitments
_SKIP_WORDS = ("reserved", "reservation", "commitment", "calendar")
_FLEX_WORDS = ("flex", "dws", "dynamic workload")


@dataclass(frozen=True)
class Price:
    """A TPU's list price."""

    per_chip_hour: float  # USD
    chips: int  # chips of the whole TPU (every slice of a multislice TPU)
    provisioning: str  # "on-demand", "spot" (spot and preemptible bill alike), "flex-start" where it has its own SKU
    source: str  # "catalog" (read from the Billing Catalog) or "table" (the bundled table)
    as_of: str  # YYYY-MM-DD: when the catalogue was read, or the bundled table's date
    sku: str  # the SKU's id (catalog) or a name for the table row

    @property
    def per_hour(self) -> float:
        return self.per_chip_hour * self.chips

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Price:
        return cls(
            per_chip_hour=float(data["per_chip_hour"]),
            chips=int(data["chips"]),
            provisioning=str(data["provisioning"]),
            source=str(data["source"]),
            as_of=str(data["as_of"]),
            sku=str(data["sku"]),
        )


@dataclass(frozen=True)
class Offer:
    """One TPU SKU of the catalogue, as far as pricing reads it."""

    sku: str  # its id
    key: str  # its generation as descriptions spell it, lowercased: "v5e", "v6e", "7x", "v4"
    pod: bool  # a pod slice SKU (v2, v3), not a single device's
    provisioning: str  # "on-demand", "spot" or "flex-start"
    regions: tuple[str, ...]
    per_unit_hour: float  # USD per usage unit-hour (a chip, or for v2-v4 a 4-chip device)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "regions": list(self.regions)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Offer:
        return cls(
            str(d["sku"]),
            str(d["key"]),
            bool(d["pod"]),
            str(d["provisioning"]),
            tuple(d["regions"]),
            float(d["per_unit_hour"]),
        )


_KEY_RE = re.compile(r"\btpu[\s-]*(v?\d+[a-z]*)", re.IGNORECASE)


def sku_key(description: str) -> str:
    """The generation a SKU's DESCRIPTION names, lowercased ("TpuV5e running in Iowa": "v5e"; "TPU7x ...": "7x";
    "Tpu-v3 Pod ...": "v3"), or ""."""
    m = _KEY_RE.search(description)
    return m.group(1).lower() if m else ""


def generation_key(generation: str) -> str:
    """How SKU descriptions name topology's GENERATION ("v5litepod": "v5e")."""
    naming = price_table.NAMING.get(generation)
    return sku_key(naming.word) if naming else ""


def offer_of(sku: dict[str, Any]) -> Offer | None:
    """SKU (the catalogue's JSON of one SKU) as an `Offer`, or None when it is not a TPU's plain hourly price in
    USD (another resource, a commitment or reservation, another unit or currency)."""
    category = sku.get("category") or {}
    description = str(sku.get("description", ""))
    words = description.lower()
    key = sku_key(description)
    if category.get("resourceGroup") != "TPU" or not key or any(w in words for w in _SKIP_WORDS):
        return None
    usage = str(category.get("usageType", ""))
    if usage not in ("OnDemand", "Preemptible"):  # Commit1Yr, Commit3Yr, ...
        return None
    infos = sku.get("pricingInfo") or []
    if not infos:
        return None
    expression = infos[-1].get("pricingExpression") or {}  # the newest pricing, when several are given
    rates = expression.get("tieredRates") or []
    if expression.get("usageUnit") != "h" or not rates:
        return None
    first = min(rates, key=lambda r: float(r.get("startUsageAmount") or 0))  # the price from the first hour
    unit = first.get("unitPrice") or {}
    if unit.get("currencyCode", "USD") != "USD":
        return None
    price = int(unit.get("units") or 0) + int(unit.get("nanos") or 0) / 1e9
    # older preemptible TPU SKUs carry the usage type OnDemand and say it in their description
    spot = usage == "Preemptible" or any(w in words for w in _SPOT_WORDS)
    flex = any(w in words for w in _FLEX_WORDS)
    provisioning = "spot" if spot else "flex-start" if flex else "on-demand"
    regions = tuple(sku.get("serviceRegions") or [])
    return Offer(str(sku.get("skuId", "")), key, "pod" in words.split(), provisioning, regions, price)


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def pick(offers: list[Offer], generation: str, region: str, provisioning: str, pod: bool) -> Offer | None:
    """The offer that prices GENERATION in REGION for PROVISIONING (a pod slice's where the generation prices pods
    apart)."""
    key = generation_key(generation)
    pods_apart = price_table.NAMING[generation].pods if generation in price_table.NAMING else False
    return next(
        (
            o
            for o in offers
            if o.key == key
            and region in o.regions
            and o.provisioning == provisioning
            and (not pods_apart or o.pod == pod)
        ),
        None,
    )


def normal_provisioning(provisioning: str) -> str:
    p = provisioning.strip().lower()
    if p == "preemptible":
        return "spot"
    if p not in PROVISIONING:
        raise UsageError(f"unknown provisioning '{provisioning}': one of {', '.join(PROVISIONING)}, preemptible")
    return p


def quote(
    accelerator_type: str, zone: str, provisioning: str, *, endpoint: str, home: Path, slices: int = 1
) -> Price | None:
    """What ACCELERATOR_TYPE (SLICES of it) in ZONE costs an hour as PROVISIONING ("on-demand", "spot",
    "preemptible", "flex-start"), from the catalogue at ENDPOINT (the Cloud TPU API's; as kept under HOME,
    tpurun's home), else the bundled table.
    None: no published price for this type in that region. A type or provisioning tpurun does not know is a
    UsageError."""
    topo = parse_accelerator_type(accelerator_type)
    wanted = normal_provisioning(provisioning)
    chips = topo.chips * max(1, slices)
    region = region_of(zone)
    pod = price_table.is_pod(topo.generation, topo.chips)
    per_unit = price_table.NAMING[topo.generation].chips_per_unit if topo.generation in price_table.NAMING else 1
    read = catalogue(endpoint, home)
    if read is not None:
        offers, as_of = read
        found = pick(offers, topo.generation, region, wanted, pod)
        if found is None and wanted == "flex-start":
            wanted = "on-demand"
            found = pick(offers, topo.generation, region, wanted, pod)
        if found is None:
            return None
        return Price(found.per_unit_hour / per_unit, chips, wanted, "catalog", as_of, found.sku)
    row = price_table.lookup(topo.generation, region, pod)
    if wanted == "flex-start":  # the table has no flex-start prices
        wanted = "on-demand"
    if row is None:
        return None
    per_chip = row.spot if wanted == "spot" else row.on_demand
    if per_chip is None:
        return None
    name = f"{topo.generation}{'-pod' if row.pod else ''} {region} {wanted}"
    return Price(per_chip, chips, wanted, "table", price_table.AS_OF, name)


def provisioning_of(view: NodeView) -> str:
    """How the TPU VIEW's capacity is bought, as prices name it: spot and preemptible TPUs bill alike."""
    return "spot" if view.spot or view.preemptible else "on-demand"


def price_of(view: NodeView, endpoint: str, home: Path) -> Price | None:
    """What the TPU VIEW (as the API describes it: spot or preemptible, its slices, either backend) costs an hour;
    None where no price is published."""
    provisioning = provisioning_of(view)
    slices = len(view.slices) if view.slices else 1
    try:
        return quote(view.accelerator_type, view.zone, provisioning, endpoint=endpoint, home=home, slices=slices)
    except UsageError:  # a type tpurun's topology does not know: no price rather than a failed listing
        return None


# ---------------------------------------------------------------- the catalogue, read and kept

_memo: dict[Path, tuple[list[Offer], str] | None] = {}  # its kept file -> this process's answer (None: unreadable)
_lock = threading.Lock()


def catalogue(endpoint: str, home: Path) -> tuple[list[Offer], str] | None:
    """The TPU offers of the catalogue at ENDPOINT and the day they were read: kept ones (under HOME) while younger than
    `MAX_AGE_DAYS`, else read now (and kept); an older kept one when it cannot be read again (its day says how
    old), else None. Asked once per process."""
    with _lock:
        path = cache_path(endpoint, home)
        if path in _memo:
            return _memo[path]
        kept = _load(path)
        if kept is None or _age_days(kept[1]) >= MAX_AGE_DAYS:
            fresh = _read(endpoint)
            if fresh is not None:
                _keep(path, endpoint, fresh)
                kept = (fresh, _today())
        _memo[path] = kept
        return kept


def forget() -> None:
    """Drop this process's answers (the kept files stay): the next question reads the files again."""
    with _lock:
        _memo.clear()


def cache_path(endpoint: str, home: Path) -> Path:
    """Where the catalogue read at ENDPOINT is kept under HOME, tpurun's home."""
    digest = hashlib.sha256(endpoint.encode()).hexdigest()[:16]
    host = re.sub(r"[^A-Za-z0-9.-]+", "_", endpoint.split("://")[-1]).strip("_")[:60]
    return home / "prices" / f"{host}--{digest}.json"


def _today() -> str:
    return dt.datetime.now(dt.timezone.utc).date().isoformat()


def _age_days(day: str) -> float:
    try:
        then = dt.date.fromisoformat(day)
    except ValueError:
        return float("inf")
    return (dt.datetime.now(dt.timezone.utc).date() - then).days


def _load(path: Path) -> tuple[list[Offer], str] | None:
    try:
        data = json.loads(path.read_text())
        return [Offer.from_json(o) for o in data["offers"]], str(data["read"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _keep(path: Path, endpoint: str, offers: list[Offer]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two commands at once each write their own
        tmp.write_text(json.dumps({"endpoint": endpoint, "read": _today(), "offers": [o.to_json() for o in offers]}))
        tmp.replace(path)
    except OSError:
        pass  # unkept, it is read again next time


def _read(endpoint: str) -> list[Offer] | None:
    """Every TPU offer of the Cloud TPU and Compute Engine services at ENDPOINT, or None when they cannot be
    read. Each call has `TIMEOUT`; a transient failure is tried once more."""
    try:
        client = _client(endpoint)
    except Exception:  # no credentials, a refused endpoint: the table answers
        return None
    offers: list[Offer] = []
    for service in (price_table.TPU_SERVICE, price_table.COMPUTE_SERVICE):
        skus = _skus(client, service)
        if skus is None:
            return None
        offers += [o for o in (offer_of(s) for s in skus) if o is not None]
    return offers


def _client(endpoint: str) -> Any:
    from google.cloud import billing_v1

    from tpurun.cloud.services import BILLING_API, credentials, endpoint_of

    return billing_v1.CloudCatalogClient(
        transport="rest",
        client_options={"api_endpoint": endpoint_of(BILLING_API, endpoint)},
        credentials=credentials(endpoint),
    )


def _skus(client: Any, service: str) -> list[dict[str, Any]] | None:
    """SERVICE's SKUs as JSON dicts (the catalogue's own field names), or None."""
    from google.api_core import exceptions as gexc
    from google.cloud import billing_v1

    transient = (gexc.ServiceUnavailable, gexc.DeadlineExceeded, gexc.InternalServerError, gexc.TooManyRequests)
    for attempt in (1, 2):
        try:
            pager = client.list_skus(
                request={"parent": f"services/{service}", "page_size": PAGE_SIZE, "currency_code": "USD"},
                retry=None,
                timeout=TIMEOUT,
            )
            return [billing_v1.Sku.to_dict(s, preserving_proto_field_name=False) for s in pager]
        except gexc.GoogleAPICallError as e:
            if attempt == 2 or not isinstance(e, transient):
                return None
        except Exception:  # a dropped or refused connection, a timeout
            if attempt == 2:
                return None
        time.sleep(0.2)
    return None
