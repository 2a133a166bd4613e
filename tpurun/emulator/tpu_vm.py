"""What one emulated worker of an accelerator type looks like to the software on it.

A pure table, so it is unit-tested for every accelerator type: the PCI functions torch_xla (and
tpu-info) count chips from, the TPU device files, and the `tpu-env` metadata a real TPU VM carries.
hosts.py puts these on each worker (a tmpfs over /sys/bus/pci/devices, files under /dev, the metadata
server). Sources of every value are in docs/emulator.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Any

from tpurun import config
from tpurun.emulator._metadata import JsonText
from tpurun.errors import UsageError
from tpurun.topology import Topology, axes, parse_accelerator_type

GOOGLE_PCI_VENDOR = "0x1ae0"
# libtpu's runtime metrics ports: one per chip from this one (tpu-env TPU_RUNTIME_METRICS_PORTS).
METRICS_BASE_PORT = 8431
# A v5e/v6e slice's axis of this many chips is a ring (wraps around); see wrap().
_LITE_POD_FULL_AXIS = 16


@dataclass(frozen=True)
class PciFunction:
    """One PCI function as sysfs shows it: /sys/bus/pci/devices/<address>/{vendor,device,...,iommu_group}."""

    address: str  # e.g. "0000:00:04.0"
    files: dict[str, str]
    links: dict[str, str]  # symlinks in its directory, e.g. iommu_group -> ../../../kernel/iommu_groups/0


@dataclass(frozen=True)
class WorkerImage:
    """The TPU-facing parts of one worker: chips on PCI, device files, `tpu-env` metadata."""

    pci: tuple[PciFunction, ...]
    device_files: tuple[str, ...]
    tpu_env: dict[str, str]

    def tpu_env_text(self) -> str:
        """`tpu-env` as the metadata server serves it: one YAML `KEY: 'value'` line per key."""
        return "".join(f"{k}: '{v}'\n" for k, v in sorted(self.tpu_env.items()))


def wrap(topology: Topology) -> str:
    """Which axes of the slice are tori: v2-v5p only from a full 4x4x4 cube up; v5e/v6e per axis of 16."""
    dims = axes(topology.topology)
    if topology.generation in ("v5litepod", "v6e"):
        return ",".join("true" if d == _LITE_POD_FULL_AXIS else "false" for d in dims)
    return ",".join(["true" if all(d >= 4 for d in dims) else "false"] * 3)


def worker_image(
    accelerator_type: str,
    *,
    worker: int,
    node_id: str,
    zone: str,
    project: str,
    preemptible: bool = False,
    extra: dict[str, str] | None = None,
) -> WorkerImage:
    """The image of worker WORKER of a node of ACCELERATOR_TYPE (a type `tpurun topology` knows); EXTRA
    joins its `tpu-env` (a multislice node's MEGASCALE values)."""
    try:
        topo = parse_accelerator_type(accelerator_type)
    except UsageError as exc:
        raise ValueError(str(exc)) from exc
    device, subsystem = topo.pci_ids
    ids = {
        "vendor": GOOGLE_PCI_VENDOR,
        "device": device,
        "subsystem_vendor": GOOGLE_PCI_VENDOR,
        "subsystem_device": subsystem,
        "class": "0x120000",  # processing accelerator
    }
    vfio = any(f.startswith("/dev/vfio/") for f in topo.device_files)
    per_chip = topo.pci_functions_per_chip
    pci = tuple(
        PciFunction(
            f"0000:00:{4 + chip:02x}.{fn}",
            dict(ids),
            # a function the VFIO driver holds: its IOMMU group, whose device file is /dev/vfio/<group>
            {"iommu_group": f"../../../kernel/iommu_groups/{chip * per_chip + fn}"} if vfio else {},
        )
        for chip in range(topo.chips_per_host)
        for fn in range(per_chip)
    )
    # A TPU VM runs one process per host unless told otherwise: process bounds = host bounds.
    env = {
        "ACCELERATOR_TYPE": topo.name,
        "TYPE": topo.api_type,
        "WORKER_ID": str(worker),
        "NODE_ID": node_id,
        "ZONE": zone,
        "CONSUMER_PROJECT_ID": project,
        "PREEMPTIBLE": "true" if preemptible else "false",
        "SERVICE_NAME": "tpu.googleapis.com",
        "TOPOLOGY": topo.topology,
        "TPU_TOPOLOGY": topo.topology,
        "HOST_BOUNDS": topo.host_bounds,
        "TPU_HOST_BOUNDS": topo.host_bounds,
        "CHIPS_PER_HOST_BOUNDS": topo.chips_per_host_bounds,
        "TPU_CHIPS_PER_HOST_BOUNDS": topo.chips_per_host_bounds,
        "TPU_PROCESS_BOUNDS": topo.host_bounds,
        "TPU_CHIPS_PER_PROCESS_BOUNDS": topo.chips_per_host_bounds,
        "WRAP": wrap(topo),
        "TPU_TOPOLOGY_WRAP": wrap(topo),
        "ALT": "false",
        "TPU_TOPOLOGY_ALT": "false",
        "TPU_RUNTIME_METRICS_PORTS": ",".join(str(METRICS_BASE_PORT + c) for c in range(topo.chips_per_host)),
        **(extra or {}),
    }
    return WorkerImage(pci=pci, device_files=topo.device_files, tpu_env=env)


# ---------------------------------------------------------------- the metadata server's tree

CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"


def stable_int(text: str, digits: int) -> int:
    """A number of DIGITS digits that TEXT always gives (ids and project numbers that survive a restart)."""
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % (10**digits)


@dataclass(frozen=True)
class VmIdentity:
    """A Compute Engine instance's own name, id and machine type (a Cloud TPU API worker has none of these)."""

    name: str
    id: str
    machine_type: str


# What a VM's metadata server says of host events, each key's value while nothing is known. `upcoming-maintenance`
# is JSON (snake_case fields) once a maintenance is announced; before, an error object.
HOST_EVENTS = {
    "preempted": "FALSE",
    "maintenance-event": "NONE",
    "upcoming-maintenance": json.dumps({"error": "no notifications have been received yet, try again later"}),
}


def metadata_tree(
    attributes: dict[str, str],
    *,
    project: str,
    project_attributes: dict[str, str] | None = None,
    zone: str,
    hostname: str,
    instance_id: str,
    address: str,
    token: str,
    vm: VmIdentity | None = None,
    events: dict[str, str] | None = None,
) -> dict[str, Any]:
    """What one worker's metadata server serves under /computeMetadata/v1/: its ATTRIBUTES, its PROJECT's (its
    common metadata, PROJECT_ATTRIBUTES), who it is, its network and its service account (whose TOKEN the
    emulated API accepts). A Compute Engine instance (VM) is
    named by its instance name, with the internal DNS name as its hostname; a Cloud TPU API worker's name is
    its hostname and its machine type the generic TPU VM's. EVENTS: what differs from HOST_EVENTS' quiet values."""
    project_number = str(stable_int("project:" + project, 12))
    email = f"{project_number}-compute@developer.gserviceaccount.com"
    account = {
        "aliases": "default\n",
        "email": email,
        "scopes": f"{CLOUD_PLATFORM_SCOPE}\n",
        "token": JsonText(json.dumps({"access_token": token, "expires_in": 3599, "token_type": "Bearer"})),
    }
    instance: dict[str, Any] = {
        "attributes": attributes,
        "hostname": hostname,
        "name": hostname,
        "id": instance_id,
        "zone": f"projects/{project_number}/zones/{zone}",
        "machine-type": f"projects/{project_number}/machineTypes/tpu-vm",
        "network-interfaces": {"0": {"ip": address, "network": f"projects/{project_number}/networks/default"}},
        **{k: (JsonText(v) if k == "upcoming-maintenance" else v) for k, v in (HOST_EVENTS | (events or {})).items()},
        # the VM's service account: what google-auth's Compute Engine credentials ask for
        "service-accounts": {"default": account, email: account},
    }
    if vm is not None:
        instance.update(
            hostname=f"{vm.name}.{zone}.c.{project}.internal",
            name=vm.name,
            id=vm.id,
            **{"machine-type": f"projects/{project_number}/machineTypes/{vm.machine_type}"},
        )
    return {
        "instance": instance,
        "project": {
            "attributes": dict(project_attributes or {}),
            "project-id": project,
            "numeric-project-id": project_number,
        },
    }


# ---------------------------------------------------------------- the runtime image's Python


def image_python() -> str:
    """The `python3` of the emulated runtime image: the interpreter the emulator itself runs in (tpurun's own,
    so a script that runs here also runs on every emulated worker without installing anything there)."""
    return sys.executable


def image_paths() -> list[str]:
    """Host directories of the image's Python installation (its venv and the interpreter under it).

    A real TPU VM image ships its Python stack on the VM's own disk. An emulated worker shares this
    machine's filesystem, except /root and /tmp, which are the worker's own; these directories it sees at
    the same path through a copy-on-write layer of its own, so `pip install` on one worker changes that
    worker only, never this machine or the other workers. System directories (/usr) are left alone.
    """
    found = set()
    # and the other environments it was asked to carry (TPURUN_EMULATOR_IMAGE_VENVS: TorchTPU's, whose torch
    # cannot share an environment with torch_xla's), so their Pythons run on every worker as they do here
    more = [p for p in config.IMAGE_VENVS.raw().split(":") if p]
    for p in {sys.prefix, sys.base_prefix, *more}:
        real = os.path.realpath(p)
        if os.path.isdir(real) and real not in ("/", "/usr", "/usr/local"):
            found.add(real)
    # keep only the outermost of nested paths
    return sorted(p for p in found if not any(p != q and p.startswith(q + "/") for q in found))


# The image's sudo, as a TPU VM's is set up: passwordless for root's aliases (metadata users, and OS Login accounts
# with the adminLogin grant, whom the guest puts in its sudoers), a password asked of anyone else, which `-n`
# refuses with sudo's own words. Its options are taken and ignored: what it runs, it runs as root.
SUDO = """#!/bin/sh
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; break;;
    -[CDghpRrTtUu]) shift 2;;
    -*) shift;;
    *) break;;
  esac
done
if [ "$(id -u)" != 0 ]; then
  echo "sudo: a password is required" >&2
  exit 1
fi
[ $# -gt 0 ] || exit 0
exec "$@"
"""


def image_bin() -> dict[str, str]:
    """The image's commands that `/usr/local/bin` of every worker holds: python3, python, pip3 and pip
    of the image Python, and its sudo."""
    py = shlex.quote(image_python())
    run = f'#!/bin/sh\nexec {py} "$@"\n'
    pip = f'#!/bin/sh\nexec {py} -m pip "$@"\n'
    return {"python3": run, "python": run, "pip3": pip, "pip": pip, "sudo": SUDO}
