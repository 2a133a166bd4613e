"""Table tests: every orderable accelerator type has a consistent shape, and the documented ones are exact."""

from __future__ import annotations

import math

import pytest

from tpurun.errors import UsageError
from tpurun.topology import GENERATIONS, all_accelerator_types, from_machine_type, one_host, parse_accelerator_type

# type, hosts, chips/host, cores/host, pjrt devices/host, host bounds, device file prefix
GOLDEN = [
    ("v2-8", 1, 4, 8, 8, "1,1,1", "/dev/accel"),
    ("v2-32", 4, 4, 8, 8, "2,2,1", "/dev/accel"),
    ("v2-512", 64, 4, 8, 8, "8,8,1", "/dev/accel"),
    ("v3-8", 1, 4, 8, 8, "1,1,1", "/dev/accel"),
    ("v3-32", 4, 4, 8, 8, "2,2,1", "/dev/accel"),
    ("v3-64", 8, 4, 8, 8, "2,4,1", "/dev/accel"),
    ("v3-2048", 256, 4, 8, 8, "16,16,1", "/dev/accel"),
    ("v4-8", 1, 4, 8, 4, "1,1,1", "/dev/accel"),
    ("v4-16", 2, 4, 8, 4, "1,1,2", "/dev/accel"),
    ("v4-32", 4, 4, 8, 4, "1,1,4", "/dev/accel"),
    ("v4-128", 16, 4, 8, 4, "2,2,4", "/dev/accel"),
    ("v4-4096", 512, 4, 8, 4, "4,8,16", "/dev/accel"),
    ("v5litepod-1", 1, 1, 1, 1, "1,1,1", "/dev/vfio/"),
    ("v5litepod-4", 1, 4, 4, 4, "1,1,1", "/dev/vfio/"),
    ("v5litepod-8", 1, 8, 8, 8, "1,1,1", "/dev/vfio/"),
    ("v5litepod-16", 4, 4, 4, 4, "2,2,1", "/dev/vfio/"),
    ("v5litepod-256", 64, 4, 4, 4, "8,8,1", "/dev/vfio/"),
    ("v5p-8", 1, 4, 8, 4, "1,1,1", "/dev/vfio/"),
    ("v5p-32", 4, 4, 8, 4, "1,1,4", "/dev/vfio/"),
    ("v5p-12288", 1536, 4, 8, 4, "8,8,24", "/dev/vfio/"),
    ("v6e-1", 1, 1, 1, 1, "1,1,1", "/dev/vfio/"),
    ("v6e-8", 1, 8, 8, 8, "1,1,1", "/dev/vfio/"),
    ("v6e-16", 4, 4, 4, 4, "2,2,1", "/dev/vfio/"),
    ("v6e-256", 64, 4, 4, 4, "8,8,1", "/dev/vfio/"),
    # tpu7x-N counts TensorCores, 2 per chip and each a device of its own; 4 chips per VM
    ("tpu7x-2", 1, 1, 2, 2, "1,1,1", "/dev/vfio/"),
    ("tpu7x-8", 1, 4, 8, 8, "1,1,1", "/dev/vfio/"),
    ("tpu7x-32", 4, 4, 8, 8, "1,1,4", "/dev/vfio/"),
    ("tpu7x-4096", 512, 4, 8, 8, "4,8,16", "/dev/vfio/"),
]


@pytest.mark.parametrize("name,hosts,chips_per_host,cores_per_host,pjrt,host_bounds,dev", GOLDEN)
def test_golden_shapes(name, hosts, chips_per_host, cores_per_host, pjrt, host_bounds, dev):
    t = parse_accelerator_type(name)
    assert (t.hosts, t.chips_per_host, t.cores_per_host, t.pjrt_devices_per_host, t.host_bounds) == (
        hosts,
        chips_per_host,
        cores_per_host,
        pjrt,
        host_bounds,
    )
    assert all(f.startswith(dev) for f in t.device_files)


EXPECTED_SIZES = {
    "v2": [8, 32, 128, 256, 512],
    "v3": [8, 32, 64, 128, 256, 512, 1024, 2048],
    "v4": [8, 16, 32, 64, 128, 256, 384, 512, 1024, 1536, 2048, 4096],
    "v5litepod": [1, 4, 8, 16, 32, 64, 128, 256],
    "v6e": [1, 4, 8, 16, 32, 64, 128, 256],
}


@pytest.mark.parametrize("gen,sizes", sorted(EXPECTED_SIZES.items()))
def test_sizes_per_generation(gen, sizes):
    assert sorted(GENERATIONS[gen].shapes) == sizes


def test_v5p_range():
    sizes = sorted(GENERATIONS["v5p"].shapes)
    assert sizes[0] == 8 and sizes[-1] == 12288
    assert {16, 32, 64, 128, 256, 384, 896, 1152, 8192} <= set(sizes)


@pytest.mark.parametrize("name", all_accelerator_types())
def test_every_type_is_consistent(name):
    t = parse_accelerator_type(name)
    dims = [int(x) for x in t.topology.split("x")]
    assert math.prod(dims) == t.chips, "topology must multiply out to the chip count"
    assert t.hosts * t.chips_per_host == t.chips
    assert t.cores == t.chips * t.cores_per_chip
    assert t.cores_per_host == t.chips_per_host * t.cores_per_chip
    size = int(name.rsplit("-", 1)[1])
    assert size == (t.chips if t.generation in ("v5litepod", "v6e") else t.cores)
    hb = [int(x) for x in t.host_bounds.split(",")]
    cb = [int(x) for x in t.chips_per_host_bounds.split(",")]
    assert math.prod(hb) == t.hosts and math.prod(cb) == t.chips_per_host
    chip_files = [f for f in t.device_files if f != "/dev/vfio/vfio"]
    assert len(chip_files) == t.chips_per_host * t.pci_functions_per_chip  # TPU7x: one per chiplet
    assert t.pjrt_devices_per_host in (t.chips_per_host, t.cores_per_host)


@pytest.mark.parametrize(
    "bad,needle",
    [
        ("v3-33", "8, 32, 64, 128, 256, 512, 1024, 2048"),
        ("v9-8", "known generations are v2, v3, v4"),
        ("tpu", "not an accelerator type"),
        ("v4-12", "v4-N counts TensorCores"),
        ("v5litepod-2", "counts chips"),
        ("v5e-8", "v5litepod-8"),
        ("tpu7x-12", "tpu7x-N counts TensorCores"),
        ("ironwood-8", "use tpu7x-8"),
        ("", "not an accelerator type"),
        ("v4-", "not an accelerator type"),
    ],
)
def test_invalid_types_name_valid_sizes(bad, needle):
    with pytest.raises(UsageError) as exc:
        parse_accelerator_type(bad)
    assert needle in str(exc.value)


def test_case_and_space_tolerated():
    assert parse_accelerator_type(" V4-32 ").name == "v4-32"


# Compute Engine's spelling: (machine type, topology) -> the accelerator type, and the VMs it takes
MACHINE_TYPES = [
    ("tpu7x-standard-4t", "2x2x4", "tpu7x-32", 4),
    ("tpu7x-standard-4t", "2x2x1", "tpu7x-8", 1),
    ("tpu7x-standard-1t", "1x1x1", "tpu7x-2", 1),
    ("ct6e-standard-4t", "4x4", "v6e-16", 4),
    ("ct6e-standard-4t", "2x2", "v6e-4", 1),
    ("ct6e-standard-8t", "2x4", "v6e-8", 1),
    ("ct6e-standard-1t", "1x1", "v6e-1", 1),
    ("ct5p-hightpu-4t", "2x2x4", "v5p-32", 4),
    ("CT5P-HIGHTPU-4T", "4x4x4", "v5p-128", 16),
]


@pytest.mark.parametrize("machine_type,shape,name,vms", MACHINE_TYPES)
def test_compute_engine_spelling_names_the_same_type(machine_type, shape, name, vms):
    t = from_machine_type(machine_type, shape)
    assert (t.name, t.hosts, t.machine_type) == (name, vms, machine_type.lower())
    assert parse_accelerator_type(name).machine_type == machine_type.lower()


@pytest.mark.parametrize(
    "machine_type,shape,needle",
    [
        ("tpu7x-standard-4t", "1x1x1", "cannot make the topology '1x1x1'"),  # 1 chip: the 1t machine type
        ("ct6e-standard-8t", "4x4", "it makes 2x4"),
        ("ct4p-hightpu-4t", "2x2x1", "unknown TPU machine type"),  # v4: GKE only, not Compute Engine
        ("tpu7x-standard-4t", "2x2x3", "cannot make"),
    ],
)
def test_machine_types_refuse_what_they_cannot_make(machine_type, shape, needle):
    with pytest.raises(UsageError) as exc:
        from_machine_type(machine_type, shape)
    assert needle in str(exc.value)


def test_who_makes_what():
    backends = {name: g.backends for name, g in GENERATIONS.items()}
    assert backends == {
        "v2": ("tpu-api",),
        "v3": ("tpu-api",),
        "v4": ("tpu-api",),
        "v5litepod": ("tpu-api",),
        "v5p": ("tpu-api", "compute"),
        "v6e": ("tpu-api", "compute"),
        "tpu7x": ("compute",),
    }
    assert not any(n.startswith("tpu7x") for n in all_accelerator_types("tpu-api"))
    assert all(parse_accelerator_type(n).machine_type for n in all_accelerator_types("compute"))
    # each generation's chip on PCI, as jax's and torch_xla's chip detection know them
    assert {n: g.pci_ids[0] for n, g in GENERATIONS.items()} == {
        "v2": "0x0027", "v3": "0x0027", "v4": "0x005e", "v5litepod": "0x0063", "v5p": "0x0062", "v6e": "0x006f",
        "tpu7x": "0x0076",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("pod", "alone"),
    [
        ("v2-32", "v2-8"),
        ("v3-32", "v3-8"),
        ("v4-16", "v4-8"),
        ("v4-32", "v4-8"),
        ("v5litepod-16", "v5litepod-4"),  # 4 chips a host in a multi-host slice, though v5litepod-8 is one host
        ("v5p-16", "v5p-8"),
        ("v6e-16", "v6e-4"),
        ("tpu7x-16", "tpu7x-8"),
        ("v4-8", "v4-8"),  # a single-host type is itself
    ],
)
def test_one_host_of_a_slice_is_its_generations_single_host_type_with_its_chips(pod: str, alone: str) -> None:
    whole, one = parse_accelerator_type(pod), one_host(parse_accelerator_type(pod))
    assert one.name == alone
    assert (one.hosts, one.chips_per_host, one.chips_per_host_bounds) == (
        1,
        whole.chips_per_host,
        whole.chips_per_host_bounds,
    )
