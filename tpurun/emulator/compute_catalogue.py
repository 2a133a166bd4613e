"""The catalogue Compute Engine clients read before anything else: regions, zones, machine types and
accelerator types (list and get), in Compute Engine's shapes (a `kind`, a numeric `id`, full `selfLink`s).

The zones are the emulator's (model.ZONES); the machine types are the TPU VM types the emulator boots
(topology's machine types), each in every zone. Their vCPU and memory figures are the emulator's stand-ins
(docs/emulator.md), not a promise about any real machine.
"""

from __future__ import annotations

from typing import Any

from tpurun.emulator.compute import ListQuery, listing, region_of
from tpurun.emulator.compute_model import link, not_found
from tpurun.emulator.model import ZONES
from tpurun.emulator.tpu_vm import stable_int
from tpurun.topology import GENERATIONS

_CREATED = "2020-01-01T00:00:00.000-08:00"
# the accelerator each TPU generation's machine types carry (`accelerators[].guestAcceleratorType`)
_ACCELERATOR = {"v5p": "tpu-v5p", "v6e": "tpu-v6e", "tpu7x": "tpu7x"}
_CPUS_PER_CHIP = 52  # a stand-in: tpurun reads chips, never vCPUs or memory
_MIB_PER_CHIP = 112 * 1024


def _regions() -> list[str]:
    return sorted({region_of(z) for z in ZONES})


def _known_zone(project: str, zone: str) -> None:
    if zone not in ZONES:
        raise not_found(f"projects/{project}/zones/{zone}")


def _accelerator(gen: str) -> str:
    """The accelerator type Compute Engine names a TPU generation's chips by."""
    return _ACCELERATOR.get(gen, f"tpu-{gen}")


def _entry(kind: str, name: str, path: str, id_digits: int, **fields: Any) -> dict[str, Any]:
    """One entry of the catalogue as Compute Engine writes it: its kind, an id of its own that stays the same,
    when it was made, its name, FIELDS and its own link."""
    return {
        "kind": f"compute#{kind}",
        "id": str(stable_int(f"{kind}:{name}", id_digits)),
        "creationTimestamp": _CREATED,
        "name": name,
        **fields,
        "selfLink": link(path),
    }


def zone_json(project: str, zone: str) -> dict[str, Any]:
    _known_zone(project, zone)
    return _entry(
        "zone",
        zone,
        f"projects/{project}/zones/{zone}",
        4,
        description=zone,
        status="UP",
        region=link(f"projects/{project}/regions/{region_of(zone)}"),
        availableCpuPlatforms=["AMD Genoa", "Intel Sapphire Rapids"],
        supportsPzs=False,
    )


def region_json(project: str, region: str) -> dict[str, Any]:
    if region not in _regions():
        raise not_found(f"projects/{project}/regions/{region}")
    return _entry(
        "region",
        region,
        f"projects/{project}/regions/{region}",
        4,
        description=region,
        status="UP",
        zones=[link(f"projects/{project}/zones/{z}") for z in ZONES if region_of(z) == region],
        quotas=[],
        supportsPzs=False,
    )


def _machine_types() -> dict[str, tuple[str, int]]:
    """Every TPU machine type: (its generation, chips per VM)."""
    return {mt: (gen, chips) for gen, g in GENERATIONS.items() for mt, chips in g.machine_types.items()}


def machine_type_json(project: str, zone: str, name: str) -> dict[str, Any]:
    _known_zone(project, zone)
    known = _machine_types()
    if name not in known:
        raise not_found(f"projects/{project}/zones/{zone}/machineTypes/{name}")
    gen, chips = known[name]
    return _entry(
        "machineType",
        name,
        f"projects/{project}/zones/{zone}/machineTypes/{name}",
        9,
        description=f"{chips} TPU {gen} chip{'s' if chips > 1 else ''}",
        guestCpus=_CPUS_PER_CHIP * chips,
        memoryMb=_MIB_PER_CHIP * chips,
        maximumPersistentDisks=128,
        maximumPersistentDisksSizeGb="263168",
        zone=zone,
        isSharedCpu=False,
        accelerators=[{"guestAcceleratorType": _accelerator(gen), "guestAcceleratorCount": chips}],
        architecture="X86_64",
    )


def accelerator_type_json(project: str, zone: str, name: str) -> dict[str, Any]:
    _known_zone(project, zone)
    most: dict[str, int] = {}  # each accelerator's chips on its largest machine type
    for gen, chips in _machine_types().values():
        most[_accelerator(gen)] = max(most.get(_accelerator(gen), 0), chips)
    if name not in most:
        raise not_found(f"projects/{project}/zones/{zone}/acceleratorTypes/{name}")
    return _entry(
        "acceleratorType",
        name,
        f"projects/{project}/zones/{zone}/acceleratorTypes/{name}",
        9,
        description=name,
        zone=link(f"projects/{project}/zones/{zone}"),
        maximumCardsPerInstance=most[name],
    )


def list_zones(project: str, query: ListQuery) -> dict[str, Any]:
    return listing("compute#zoneList", f"projects/{project}/zones", [zone_json(project, z) for z in ZONES], query)


def list_regions(project: str, query: ListQuery) -> dict[str, Any]:
    items = [region_json(project, r) for r in _regions()]
    return listing("compute#regionList", f"projects/{project}/regions", items, query)


def list_machine_types(project: str, zone: str, query: ListQuery) -> dict[str, Any]:
    items = [machine_type_json(project, zone, mt) for mt in sorted(_machine_types())]
    return listing("compute#machineTypeList", f"projects/{project}/zones/{zone}/machineTypes", items, query)


def list_accelerator_types(project: str, zone: str, query: ListQuery) -> dict[str, Any]:
    names = sorted({_accelerator(gen) for gen, _ in _machine_types().values()})
    items = [accelerator_type_json(project, zone, n) for n in names]
    return listing("compute#acceleratorTypeList", f"projects/{project}/zones/{zone}/acceleratorTypes", items, query)
