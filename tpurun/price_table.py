"""The one table of Cloud TPU list prices per chip-hour, with its source and date, and how Google's Billing Catalog
names each TPU generation in its SKUs.

A pure table, as topology.py is: `cloud/prices.py` answers from it when the catalogue cannot be read, and the
emulator serves it as its Billing Catalog's SKUs, so both speak of the same numbers. Source and date are in
docs/cost.md ("Where prices come from") and docs/emulator.md.

The numbers are Google's published list prices in USD per chip-hour, on demand and spot (spot and preemptible
TPUs bill alike: the catalogue has one SKU for both), as SkyPilot's catalogue (skypilot-org/skypilot-catalog,
`catalogs/v8/gcp/vms.csv`) records them from the Billing Catalog, for the regions the emulator has zones in.
A generation, region or provisioning missing here has no published price tpurun found: TPU7x has none.
"""

from __future__ import annotations

from dataclasses import dataclass

AS_OF = "2026-11-28"  # when these numbers were read from their source
SOURCE = (
    "Google's Cloud TPU list prices (cloud.google.com/tpu/pricing), as SkyPilot's catalogue "
    "(github.com/skypilot-org/skypilot-catalog, catalogs/v8/gcp/vms.csv) records them from the Billing Catalog"
)

# Billing Catalog services (their ids, as `services.list` names them): the Cloud TPU service bills v2, v3 and v4;
# TPUs from v5e on are Compute Engine's SKUs (SkyPilot's and gpuhunt's catalogue fetchers read both)
TPU_SERVICE = "E000-3F24-B8AA"
COMPUTE_SERVICE = "6F81-5844-456A"


@dataclass(frozen=True)
class Naming:
    """How the catalogue names one generation's SKUs."""

    word: str  # in each SKU's description: "TpuV5e running in Iowa", "Tpu-v3 Pod running in Netherlands"
    service: str  # the catalogue service whose SKUs they are
    chips_per_unit: int = 1  # chips one usage unit of its SKUs bills: v2-v4 are priced per 8 TensorCores (4 chips)
    pods: bool = False  # single devices (v2-8, v3-8) and pod slices have SKUs of their own


# topology's generation name -> its SKUs' naming; the generation's key the matching reads is `sku_key(word)`
NAMING: dict[str, Naming] = {
    "v2": Naming("Tpu-v2", TPU_SERVICE, chips_per_unit=4, pods=True),
    "v3": Naming("Tpu-v3", TPU_SERVICE, chips_per_unit=4, pods=True),
    "v4": Naming("Tpu-v4 Pod", TPU_SERVICE, chips_per_unit=4),
    "v5litepod": Naming("TpuV5e", COMPUTE_SERVICE),
    "v5p": Naming("TpuV5p", COMPUTE_SERVICE),
    "v6e": Naming("TpuV6e", COMPUTE_SERVICE),
    "tpu7x": Naming("TPU7x", COMPUTE_SERVICE),
}


@dataclass(frozen=True)
class ListPrice:
    """One generation's list price in one region, USD per chip-hour."""

    generation: str  # topology's name: "v5litepod", not "v5e"
    region: str
    on_demand: float
    spot: float | None  # None: no published spot price there
    pod: bool = False  # v2, v3: the price of pod slices (more than 8 TensorCores); else of a single device
    commit_1yr: float | None = None  # a one-year commitment's price, where published (the catalogue has its SKU)


def _rows(generation: str, prices: dict[str, tuple[float, float | None]], pod: bool = False) -> list[ListPrice]:
    return [ListPrice(generation, region, od, spot, pod) for region, (od, spot) in prices.items()]


TABLE: list[ListPrice] = [
    *_rows("v2", {"us-central1": (1.125, 0.3375), "europe-west4": (1.2375, 0.3155625), "asia-east1": (1.305, 0.3915)}),
    *_rows("v2", {"us-central1": (1.5, 0.3825), "europe-west4": (1.5, 0.3825)}, pod=True),
    *_rows("v3", {"us-central1": (2.0, 0.51), "europe-west4": (2.2, 0.561), "us-east1": (2.0, None)}),
    *_rows("v3", {"europe-west4": (2.0, 0.66)}, pod=True),
    *_rows("v4", {"us-central2": (3.22, 0.9215)}),
    ListPrice("v5litepod", "us-central1", 1.2, 0.24493, commit_1yr=0.84),
    *_rows(
        "v5litepod",
        {
            "us-east1": (1.2, 0.24493),
            "us-east5": (1.2, 0.6),
            "us-south1": (1.416, 0.5664),
            "us-west4": (1.2, 0.48),
            "europe-west4": (1.56, 0.44498),
            "asia-east1": (1.38948, 0.55579),
            "asia-northeast1": (1.54104, 0.4244),
        },
    ),
    *_rows(
        "v5p",
        {
            "us-central1": (4.2, 0.835701),
            "us-east1": (4.2, 0.835701),
            "us-east5": (4.2, 1.68),
            "us-south1": (4.779, 1.316137),
            "europe-west4": (4.2525, 1.34849),
        },
    ),
    *_rows(
        "v6e",
        {
            "us-central1": (2.7, 0.54421),
            "us-east5": (2.7, 1.215),
            "us-south1": (2.7, 1.35),
            "europe-west4": (2.97, 1.03748),
            "asia-northeast1": (3.24, 0.94352),
        },
    ),
    ListPrice("v6e", "us-east1", 2.7, 0.54421, commit_1yr=1.89),
]


def is_pod(generation: str, chips: int) -> bool:
    """Whether a TPU of CHIPS chips of GENERATION is billed as a pod slice (v2 and v3 above one 4-chip device)."""
    naming = NAMING.get(generation)
    return bool(naming and naming.pods and chips > 4)


def lookup(generation: str, region: str, pod: bool = False) -> ListPrice | None:
    """The table's row for GENERATION in REGION (its pod slices' where the generation prices them apart)."""
    wanted_pod = pod and NAMING[generation].pods if generation in NAMING else False
    return next((p for p in TABLE if (p.generation, p.region, p.pod) == (generation, region, wanted_pod)), None)
