"""The emulated TPU VM image of every accelerator type: chips on PCI, device files, `tpu-env` metadata."""

from __future__ import annotations

import pytest
import yaml

from tpurun.emulator.tpu_vm import GOOGLE_PCI_VENDOR, worker_image, wrap
from tpurun.topology import all_accelerator_types, parse_accelerator_type


@pytest.mark.parametrize("accel", all_accelerator_types())
def test_every_type_has_its_pci_functions_and_device_files_per_chip(accel):
    topo = parse_accelerator_type(accel)
    image = worker_image(accel, worker=topo.hosts - 1, node_id="n", zone="z", project="p")
    functions = topo.chips_per_host * (2 if topo.generation == "tpu7x" else 1)  # a TPU7x chip: two chiplets
    assert len(image.pci) == functions
    assert len({f.address for f in image.pci}) == functions
    assert len({f.address.rsplit(".", 1)[0] for f in image.pci}) == topo.chips_per_host  # a chip: one PCI slot
    assert all(f.files["vendor"] == GOOGLE_PCI_VENDOR for f in image.pci)
    assert image.device_files == topo.device_files
    # VFIO generations: each function's IOMMU group has its device file, as the runtimes look them up
    groups = [f.links["iommu_group"].rsplit("/", 1)[1] for f in image.pci if "iommu_group" in f.links]
    vfio = sorted(d for d in topo.device_files if d != "/dev/vfio/vfio" and d.startswith("/dev/vfio/"))
    assert sorted(f"/dev/vfio/{g}" for g in groups) == vfio
    assert len(vfio) in (0, functions)
    env = yaml.safe_load(image.tpu_env_text())  # torch_xla parses it with yaml too
    assert env["ACCELERATOR_TYPE"] == accel
    assert env["WORKER_ID"] == str(topo.hosts - 1)
    # one process per host: process bounds x chips per process = the whole slice, in chips
    process = [int(x) for x in env["TPU_PROCESS_BOUNDS"].split(",")]
    per_process = [int(x) for x in env["TPU_CHIPS_PER_PROCESS_BOUNDS"].split(",")]
    assert process[0] * process[1] * process[2] == topo.hosts
    assert per_process[0] * per_process[1] * per_process[2] == topo.chips_per_host
    assert len(env["TPU_RUNTIME_METRICS_PORTS"].split(",")) == topo.chips_per_host


def test_single_host_v5e_and_v6e_have_eight_chips():
    for accel in ("v5litepod-8", "v6e-8"):
        image = worker_image(accel, worker=0, node_id="n", zone="z", project="p")
        assert len(image.pci) == 8 and image.tpu_env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,4,1"


@pytest.mark.parametrize(
    ("accel", "want"),
    [
        ("v4-8", "false,false,false"),
        ("v4-128", "true,true,true"),  # 4x4x4: a full cube is a torus
        ("v4-256", "true,true,true"),
        ("v5litepod-16", "false,false,false"),
        ("v5litepod-256", "true,true,false"),  # 16x16
        ("v5litepod-128", "false,true,false"),  # 8x16
    ],
)
def test_wrap(accel, want):
    assert wrap(parse_accelerator_type(accel)) == want


def test_unknown_type_is_a_value_error():
    with pytest.raises(ValueError):
        worker_image("v9-8", worker=0, node_id="n", zone="z", project="p")
