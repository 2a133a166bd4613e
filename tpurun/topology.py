"""The shape of every Cloud TPU accelerator type users can order.

A pure table: accelerator type name -> hosts, chips, cores, PJRT devices, device files and
bounds; and what a TPU VM's metadata tells its runtimes of their place in a slice of it (`vm_env`). Sources are listed in docs/topology.md (Cloud TPU documentation pages per generation,
and the topology tables of Google's own launchers).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from tpurun.errors import UsageError


@dataclass(frozen=True)
class Generation:
    name: str  # prefix of the accelerator type, e.g. "v5litepod"
    api_type: str  # AcceleratorConfig.Type enum name
    size_unit: str  # what N in "<gen>-N" counts: "cores" or "chips"
    cores_per_chip: int
    chips_per_host: int  # in multi-host slices
    device_kind: str  # "accel" (/dev/accelN) or "vfio" (/dev/vfio/N)
    process_per_chip_devices: int  # PJRT devices one chip contributes
    default_runtime: str
    # size -> physical topology (chips along each axis)
    shapes: dict[int, str] = field(default_factory=dict)
    # single-host shapes with more or fewer chips than chips_per_host
    single_host_max_chips: int = 4
    megacore: bool = False
    alias: str = ""  # other spelling users meet, e.g. "v5e"
    # the chip on PCI (vendor 0x1ae0), as the runtimes and tpu-info count chips: (device, subsystem device)
    pci_ids: tuple[str, str] = ("", "")
    # PCI functions (and VFIO devices) one chip shows: 2 on TPU7x, whose two chiplets (one TensorCore each)
    # the host sees as two devices (docs/emulator.md)
    pci_functions_per_chip: int = 1
    # Compute Engine: machine type -> chips per VM (empty: the generation is not offered there), and the
    # boot image family of its VMs (project ubuntu-os-accelerator-images)
    machine_types: dict[str, int] = field(default_factory=dict)
    image_family: str = ""

    @property
    def backends(self) -> tuple[str, ...]:
        """Who can make it: the Cloud TPU API ("tpu-api", when it has an AcceleratorConfig type for it)
        and Compute Engine ("compute", when it has machine types for it)."""
        return tuple(b for b, ok in (("tpu-api", bool(self.api_type)), ("compute", bool(self.machine_types))) if ok)


def _v5p_shapes() -> dict[int, str]:
    """v5p sizes: the four small shapes, then every AxBxC of multiples of 4 (A<=B<=C) that fits the
    16x20x28 pod and the documented 6144-chip single-slice limit; per size the most cube-like shape."""
    shapes = {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4"}
    best: dict[int, tuple[int, int, int]] = {}
    for a in range(4, 17, 4):
        for b in range(a, 21, 4):
            for c in range(b, 29, 4):
                chips = a * b * c
                if chips > 6144:
                    continue
                size = 2 * chips
                if size not in best or (c, b) < (best[size][2], best[size][1]):
                    best[size] = (a, b, c)
    shapes.update({size: "x".join(map(str, dims)) for size, dims in best.items()})
    return dict(sorted(shapes.items()))


# v5e and v6e slices: the same sizes (in chips) and shapes, up to a 16x16 pod (docs/topology.md)
_LITE_SHAPES = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}

GENERATIONS: dict[str, Generation] = {
    g.name: g
    for g in [
        Generation(
            name="v2",
            api_type="V2",
            size_unit="cores",
            cores_per_chip=2,
            chips_per_host=4,
            device_kind="accel",
            process_per_chip_devices=2,
            default_runtime="tpu-ubuntu2204-base",
            shapes={8: "2x2", 32: "4x4", 128: "8x8", 256: "8x16", 512: "16x16"},
            pci_ids=("0x0027", "0x004e"),
        ),
        Generation(
            name="v3",
            api_type="V3",
            size_unit="cores",
            cores_per_chip=2,
            chips_per_host=4,
            device_kind="accel",
            process_per_chip_devices=2,
            default_runtime="tpu-ubuntu2204-base",
            shapes={
                8: "2x2",
                32: "4x4",
                64: "4x8",
                128: "8x8",
                256: "8x16",
                512: "16x16",
                1024: "16x32",
                2048: "32x32",
            },
            pci_ids=("0x0027", "0x004f"),
        ),
        Generation(
            name="v4",
            api_type="V4",
            size_unit="cores",
            cores_per_chip=2,
            chips_per_host=4,
            device_kind="accel",
            process_per_chip_devices=1,
            default_runtime="tpu-ubuntu2204-base",
            megacore=True,
            shapes={
                8: "2x2x1",
                16: "2x2x2",
                32: "2x2x4",
                64: "2x4x4",
                128: "4x4x4",
                256: "4x4x8",
                384: "4x4x12",
                512: "4x8x8",
                1024: "8x8x8",
                1536: "8x8x12",
                2048: "8x8x16",
                4096: "8x16x16",
            },
            pci_ids=("0x005e", "0x005e"),
        ),
        Generation(
            name="v5litepod",
            api_type="V5LITE_POD",
            size_unit="chips",
            cores_per_chip=1,
            chips_per_host=4,
            device_kind="vfio",
            process_per_chip_devices=1,
            default_runtime="v2-alpha-tpuv5-lite",
            single_host_max_chips=8,
            alias="v5e",
            shapes=_LITE_SHAPES,
            pci_ids=("0x0063", "0x0063"),
        ),
        Generation(
            name="v5p",
            api_type="V5P",
            size_unit="cores",
            cores_per_chip=2,
            chips_per_host=4,
            device_kind="vfio",
            process_per_chip_devices=1,
            default_runtime="v2-alpha-tpuv5",
            megacore=True,
            shapes=_v5p_shapes(),
            pci_ids=("0x0062", "0x00ad"),
            machine_types={"ct5p-hightpu-4t": 4},
            image_family="ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e",
        ),
        Generation(
            name="v6e",
            api_type="V6E",
            size_unit="chips",
            cores_per_chip=1,
            chips_per_host=4,
            device_kind="vfio",
            process_per_chip_devices=1,
            default_runtime="v2-alpha-tpuv6e",
            single_host_max_chips=8,
            alias="trillium",
            shapes=_LITE_SHAPES,
            pci_ids=("0x006f", "0x00d1"),
            machine_types={"ct6e-standard-1t": 1, "ct6e-standard-4t": 4, "ct6e-standard-8t": 8},
            image_family="ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e",
        ),
        Generation(
            name="tpu7x",
            api_type="",  # the Cloud TPU API does not offer it: Compute Engine (or GKE) only
            size_unit="cores",
            cores_per_chip=2,
            chips_per_host=4,
            device_kind="vfio",
            process_per_chip_devices=2,  # its two TensorCores are two devices (no megacore)
            default_runtime="",
            alias="ironwood",
            shapes={
                2: "1x1x1",
                8: "2x2x1",
                16: "2x2x2",
                32: "2x2x4",
                64: "2x4x4",
                128: "4x4x4",
                256: "4x4x8",
                512: "4x8x8",
                1024: "8x8x8",
                2048: "8x8x16",
                4096: "8x16x16",
            },
            pci_ids=("0x0076", "0x00f2"),
            pci_functions_per_chip=2,
            machine_types={"tpu7x-standard-1t": 1, "tpu7x-standard-4t": 4},
            image_family="ubuntu-accel-2404-amd64-tpu-tpu7x",
        ),
    ]
}


# The port the multislice runtime's coordinator listens on (MEGASCALE_PORT), as launchers of several
# slices set it (see docs/multislice.md).
MEGASCALE_PORT = 8081


@dataclass(frozen=True)
class Topology:
    """What one accelerator type is, seen from a launcher."""

    name: str
    generation: str
    api_type: str
    topology: str  # chips along each axis, e.g. "2x2x4"
    chips: int
    cores: int
    hosts: int
    chips_per_host: int
    cores_per_chip: int
    cores_per_host: int
    pjrt_devices_per_host: int
    host_bounds: str  # TPU_HOST_BOUNDS / TPU_PROCESS_BOUNDS at one process per host, "x,y,z"
    chips_per_host_bounds: str  # TPU_CHIPS_PER_HOST_BOUNDS, "x,y,z"
    device_files: tuple[str, ...]
    default_runtime_version: str  # the Cloud TPU API's ("" where it does not make this type)
    machine_type: str = ""  # Compute Engine's machine type for its VMs ("" where it does not make it)
    backends: tuple[str, ...] = ()  # "tpu-api", "compute": who can make it
    pci_ids: tuple[str, str] = ("", "")  # each chip's PCI device and subsystem device ids (vendor 0x1ae0)
    pci_functions_per_chip: int = 1  # PCI functions (VFIO devices) per chip

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1

    @property
    def multislice(self) -> bool:
        """Whether Cloud TPU joins several slices of this type over the data-center network: v4 and newer."""
        return self.generation not in ("v2", "v3")

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["device_files"] = list(self.device_files)
        d["backends"] = list(self.backends)
        d["pci_ids"] = list(self.pci_ids)
        d["multi_host"] = self.multi_host
        return d


_NAME_RE = re.compile(r"^(?P<gen>[a-z0-9]+?)-(?P<size>[0-9]+)$")  # ASCII digits: \d takes '８' too


def axes(shape: str) -> list[int]:
    """Chips along x, y and z of a shape such as "2x4" ([2, 4, 1])."""
    dims = [int(x) for x in shape.split("x")]
    return dims + [1] * (3 - len(dims))


def _build(gen: Generation, size: int) -> Topology:
    shape = gen.shapes[size]
    chips = size if gen.size_unit == "chips" else size // gen.cores_per_chip
    if chips <= gen.single_host_max_chips and (chips <= gen.chips_per_host or gen.size_unit == "chips"):
        hosts, per_host = 1, chips
        per_host_bounds = axes(shape)
    else:
        per_host = gen.chips_per_host
        hosts = chips // per_host
        per_host_bounds = [2, 2, 1]
    dims = axes(shape)
    host_bounds = [d // b for d, b in zip(dims, per_host_bounds, strict=True)]
    if gen.device_kind == "accel":
        devices = tuple(f"/dev/accel{i}" for i in range(per_host))
    else:
        functions = per_host * gen.pci_functions_per_chip
        devices = tuple(f"/dev/vfio/{i}" for i in range(functions)) + ("/dev/vfio/vfio",)
    cores_per_host = per_host * gen.cores_per_chip
    return Topology(
        name=f"{gen.name}-{size}",
        generation=gen.name,
        api_type=gen.api_type,
        topology=shape,
        chips=chips,
        cores=chips * gen.cores_per_chip,
        hosts=hosts,
        chips_per_host=per_host,
        cores_per_chip=gen.cores_per_chip,
        cores_per_host=cores_per_host,
        pjrt_devices_per_host=per_host * gen.process_per_chip_devices,
        host_bounds=",".join(str(b) for b in host_bounds),
        chips_per_host_bounds=",".join(str(b) for b in per_host_bounds),
        device_files=devices,
        default_runtime_version=gen.default_runtime,
        machine_type=next((m for m, chips in gen.machine_types.items() if chips == per_host), ""),
        backends=gen.backends,
        pci_ids=gen.pci_ids,
        pci_functions_per_chip=gen.pci_functions_per_chip,
    )


def valid_sizes(generation: str) -> list[int]:
    return sorted(GENERATIONS[generation].shapes)


def all_accelerator_types(backend: str = "") -> list[str]:
    """Every accelerator type (that BACKEND, "tpu-api" or "compute", can make, when given)."""
    return [
        f"{g.name}-{s}" for g in GENERATIONS.values() if not backend or backend in g.backends for s in sorted(g.shapes)
    ]


def default_runtime_version(generation: str) -> str:
    return GENERATIONS[generation].default_runtime


def _generation_for(prefix: str) -> Generation | None:
    if prefix in GENERATIONS:
        return GENERATIONS[prefix]
    for g in GENERATIONS.values():
        if g.alias and g.alias == prefix:
            return g
    return None


def parse_accelerator_type(name: str) -> Topology:
    """Topology of NAME (e.g. "v4-32"), or UsageError naming what is valid."""
    text = name.strip().lower()
    m = _NAME_RE.match(text)
    gens = ", ".join(GENERATIONS)
    if not m:
        raise UsageError(
            f"'{name}' is not an accelerator type: expected GENERATION-SIZE such as v4-32 "
            f"(generations: {gens}; `tpurun topology --list` shows all)"
        )
    gen = _generation_for(m.group("gen"))
    if gen is None:
        raise UsageError(f"unknown TPU generation '{m.group('gen')}' in '{name}': known generations are {gens}")
    if gen.alias == m.group("gen"):
        raise UsageError(
            f"'{name}': accelerator types call this generation '{gen.name}'; use {gen.name}-{m.group('size')}"
        )
    size = int(m.group("size"))
    if size not in gen.shapes:
        unit = "TensorCores" if gen.size_unit == "cores" else "chips"
        sizes = ", ".join(str(s) for s in sorted(gen.shapes))
        raise UsageError(f"'{name}' is not a valid {gen.name} size: {gen.name}-N counts {unit}, N is one of {sizes}")
    return _build(gen, size)


def from_machine_type(machine_type: str, topology: str) -> Topology:
    """The accelerator type Compute Engine's spelling names: MACHINE_TYPE (e.g. tpu7x-standard-4t) in the
    physical TOPOLOGY (e.g. 2x2x4), or UsageError naming what is valid."""
    mt = machine_type.strip().lower()
    gen = next((g for g in GENERATIONS.values() if mt in g.machine_types), None)
    if gen is None:
        known = ", ".join(m for g in GENERATIONS.values() for m in g.machine_types)
        raise UsageError(f"unknown TPU machine type '{machine_type}': Compute Engine's are {known}")
    per_vm = gen.machine_types[mt]
    shape = topology.strip().lower()
    fits = [size for size, s in gen.shapes.items() if _build(gen, size).chips_per_host == per_vm]
    size = next((size for size in fits if axes(gen.shapes[size]) == axes(shape) if "x" in shape), None)
    if size is None:
        shapes = ", ".join(gen.shapes[s] for s in sorted(fits))
        raise UsageError(f"{mt} ({per_vm} chips per VM) cannot make the topology '{topology}': it makes {shapes}")
    return _build(gen, size)


def one_host(topology: Topology) -> Topology:
    """The single-host slice one host of TOPOLOGY is on its own: the same generation's one-host type with that
    host's chips (v4-16: v4-8; v5litepod-16, 4 chips a host: v5litepod-4; a single-host type: itself)."""
    if not topology.multi_host:
        return topology
    gen = GENERATIONS[topology.generation]
    built = (_build(gen, size) for size in sorted(gen.shapes))
    found = next((t for t in built if t.hosts == 1 and t.chips_per_host == topology.chips_per_host), None)
    if found is None:
        raise UsageError(
            f"{topology.name} has no single-host type of {topology.chips_per_host} chips to run one host as"
        )
    return found


def vm_topology(machine_type: str) -> Topology:
    """The single-host slice that one VM of MACHINE_TYPE is on its own (tpu7x-standard-4t: tpu7x-8, 2x2x1), or
    UsageError."""
    mt = machine_type.strip().lower()
    gen = next((g for g in GENERATIONS.values() if mt in g.machine_types), None)
    if gen is None:
        known = ", ".join(m for g in GENERATIONS.values() for m in g.machine_types)
        raise UsageError(f"unknown TPU machine type '{machine_type}': Compute Engine's are {known}")
    built = (_build(gen, size) for size in sorted(gen.shapes))
    return next(t for t in built if t.hosts == 1 and t.chips_per_host == gen.machine_types[mt])


def vm_env(
    topology: Topology, host: int, slice_addresses: list[str], *, slices: int = 1, slice_id: int = 0
) -> dict[str, str]:
    """What a Cloud TPU VM's metadata server tells every runtime of its place in the slice (`tpu-env`,
    `agent-worker-number`, `worker-network-endpoints`), under the names the runtimes read from the environment
    instead (the ones GKE gives a TPU container). Given to every process tpurun starts on a VM whose metadata
    does not say it (Compute Engine's: `import torch_xla` fails there without them) and to one host run alone.
    Host-level names only: a script's spawner still derives each chip process's own (xmp.spawn's
    configure_topology sets TPU_PROCESS_BOUNDS and the rest only where they are unset)."""
    return {
        # torch_xla reads the variables below instead of the metadata server (tpu.build_tpu_env_from_vars),
        # and jax's cluster detection skips its metadata cluster (GceTpuCluster) for the env one (GkeTpuCluster)
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": topology.name,
        "TPU_WORKER_ID": str(host),
        "TPU_WORKER_HOSTNAMES": ",".join(slice_addresses),
        "TPU_HOST_BOUNDS": topology.host_bounds,
        "TPU_CHIPS_PER_HOST_BOUNDS": topology.chips_per_host_bounds,
        "TPU_TOPOLOGY": topology.topology,
        # jax looks these up in the environment, then in `tpu-env` (six tries, 3 s, each)
        "MEGASCALE_NUM_SLICES": str(slices),
        "MEGASCALE_SLICE_ID": str(slice_id),
    }


def single_host_env(alone: Topology, address: str) -> dict[str, str]:
    """One host of a pod on its own, at ADDRESS: the variables of ALONE, the single-host slice it is
    (`Target.alone`), so neither torch_xla nor jax waits for the other hosts the VM's metadata lists
    (pytorch/xla #7714, jax #22436)."""
    return vm_env(alone, 0, [address])
