"""Table tests: every orderable accelerator type has a consistent shape, and the documented ones are exact."""

from __future__ import annotations

import math

import pytest

from tpurun.errors import UsageError
from tpurun.topology import GENERATIONS, all_accelerator_types, parse_accelerator_type

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
    assert len(chip_files) == t.chips_per_host
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
        ("tpu7x-8", "not offered through the Cloud TPU API"),
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
