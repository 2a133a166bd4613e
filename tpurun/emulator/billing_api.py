"""The emulator's Cloud Billing Catalog API v1 (cloudbilling.googleapis.com's `services.list` and
`services.skus.list`), as google-cloud-billing's `CloudCatalogClient` calls it over REST (its
`services/cloud_catalog/transports/rest_base.py`): the Cloud TPU and Compute Engine services, and a SKU for each
TPU generation's list price in each region the emulator has zones in, from the one price table
(`tpurun/price_table.py`), shaped as Google's TPU SKUs are (descriptions such as "TpuV5e running in Iowa", the
usage unit `h`, a unit price in units and nanos). Prices are in USD only (another `currencyCode` is refused), and
`startTime`/`endTime` are accepted and ignored: the emulator keeps no price history.
"""

from __future__ import annotations

import base64
import hashlib
from typing import TYPE_CHECKING, Any

from tpurun import price_table
from tpurun.emulator.model import ZONES, invalid, not_found
from tpurun.emulator.routing import Request, Router

if TYPE_CHECKING:
    from tpurun.emulator.state import Emulator

SERVICES = {
    price_table.TPU_SERVICE: "Cloud TPU",
    price_table.COMPUTE_SERVICE: "Compute Engine",
}
MAX_PAGE = 5000  # the API's largest page, and its page when none is asked
EFFECTIVE = f"{price_table.AS_OF}T00:00:00Z"

# how SKU descriptions name each region the emulator has zones in ("TpuV6e running in Iowa")
LOCATIONS = {
    "us-central1": "Iowa",
    "us-central2": "Oklahoma",
    "us-east1": "South Carolina",
    "us-east5": "Columbus",
    "us-south1": "Dallas",
    "us-west4": "Las Vegas",
    "europe-west4": "Netherlands",
    "asia-east1": "Taiwan",
    "asia-northeast1": "Tokyo",
}


def _regions() -> set[str]:
    return {z.rsplit("-", 1)[0] for z in ZONES}


def _sku_id(text: str) -> str:
    """A SKU id of the catalogue's shape (XXXX-XXXX-XXXX, hex), the same for the same SKU every time."""
    h = hashlib.sha256(text.encode()).hexdigest().upper()
    return f"{h[0:4]}-{h[4:8]}-{h[8:12]}"


def _money(usd: float) -> dict[str, Any]:
    units = int(usd)
    return {"currencyCode": "USD", "units": str(units), "nanos": int(round((usd - units) * 1e9))}


def _sku(service: str, description: str, usage: str, region: str, per_unit: float) -> dict[str, Any]:
    sku_id = _sku_id(f"{service}/{description}/{usage}")
    return {
        "name": f"services/{service}/skus/{sku_id}",
        "skuId": sku_id,
        "description": description,
        "category": {
            "serviceDisplayName": SERVICES[service],
            "resourceFamily": "Compute",
            "resourceGroup": "TPU",
            "usageType": usage,
        },
        "serviceRegions": [region],
        "pricingInfo": [
            {
                "summary": "",
                "pricingExpression": {
                    "usageUnit": "h",
                    "displayQuantity": 1,
                    "tieredRates": [{"startUsageAmount": 0, "unitPrice": _money(per_unit)}],
                    "usageUnitDescription": "hour",
                    "baseUnit": "s",
                    "baseUnitDescription": "second",
                    "baseUnitConversionFactor": 3600,
                },
                "aggregationInfo": {"aggregationLevel": "ACCOUNT", "aggregationInterval": "DAILY", "aggregationCount": 1},
                "currencyConversionRate": 1,
                "effectiveTime": EFFECTIVE,
            }
        ],
        "serviceProviderName": "Google",
        "geoTaxonomy": {"type": "REGIONAL", "regions": [region]},
    }


def _skus_of(row: price_table.ListPrice) -> list[dict[str, Any]]:
    """ROW's SKUs: on demand, spot, a one-year commitment where the table has them, as Google words them (the
    older generations' preemptible SKUs carry the usage type OnDemand and say it in their description)."""
    naming = price_table.NAMING[row.generation]
    where = LOCATIONS[row.region]
    word = f"{naming.word} Pod" if row.pod else naming.word
    unit = naming.chips_per_unit
    out = [_sku(naming.service, f"{word} running in {where}", "OnDemand", row.region, row.on_demand * unit)]
    if row.spot is not None:
        if naming.service == price_table.TPU_SERVICE:
            spot = _sku(naming.service, f"Preemptible {word} running in {where}", "OnDemand", row.region, row.spot * unit)
        else:
            spot = _sku(
                naming.service,
                f"{word} attached to Spot Preemptible VMs running in {where}",
                "Preemptible",
                row.region,
                row.spot * unit,
            )
        out.append(spot)
    if row.commit_1yr is not None:
        text = f"Commitment v1: {word} running in {where} for 1 Year"
        out.append(_sku(naming.service, text, "Commit1Yr", row.region, row.commit_1yr * unit))
    return out


def catalogue() -> dict[str, list[dict[str, Any]]]:
    """Each service's SKUs: every row of the price table in a region the emulator has zones in."""
    out: dict[str, list[dict[str, Any]]] = {s: [] for s in SERVICES}
    for row in price_table.TABLE:
        if row.region in _regions():
            for sku in _skus_of(row):
                out[price_table.NAMING[row.generation].service].append(sku)
    return out


def _page(items: list[dict[str, Any]], q: Request, key: str) -> dict[str, Any]:
    size = q.q_int("pageSize")
    if size < 0:
        raise invalid("page_size must be non-negative")
    size = min(size or MAX_PAGE, MAX_PAGE)
    token = q.q("pageToken")
    start = 0
    if token:
        try:
            start = int(base64.urlsafe_b64decode(token.encode()).decode())
        except ValueError as e:
            raise invalid("Invalid page token.") from e
        if not 0 <= start <= len(items):
            raise invalid("Invalid page token.")
    end = start + size
    nxt = base64.urlsafe_b64encode(str(end).encode()).decode() if end < len(items) else ""
    return {key: items[start:end], "nextPageToken": nxt}


def add_billing_routes(r: Router, emu: Emulator) -> None:
    """GET /v1/services and GET /v1/services/{id}/skus."""
    del emu  # the catalogue is the price table's, the same for every project and every reset

    def services(q: Request) -> Any:
        items = [
            {
                "name": f"services/{sid}",
                "serviceId": sid,
                "displayName": title,
                "businessEntityName": "businessEntities/GCP",
            }
            for sid, title in SERVICES.items()
        ]
        return _page(items, q, "services")

    def skus(q: Request) -> Any:
        sid = q.groups["service"]
        if sid not in SERVICES:
            raise not_found(f"services/{sid}")
        currency = q.q("currencyCode", "USD") or "USD"
        if currency != "USD":
            raise invalid(f"The tpurun emulator's catalogue is in USD only, not {currency}.")
        return _page(catalogue()[sid], q, "skus")

    r.add("GET", "/v1/services", services, ("pageSize", "pageToken"))
    r.add(
        "GET",
        "/v1/services/(?P<service>[^/:]+)/skus",
        skus,
        ("pageSize", "pageToken", "currencyCode", "startTime", "endTime"),
    )
