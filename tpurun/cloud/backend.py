"""The one interface between tpurun and whichever Google API made a TPU.

Two APIs make TPU VMs: the Cloud TPU API (nodes and queued resources, `tpurun.cloud.tpu_api`) and
Compute Engine (instances, and managed instance groups with a workload policy, `tpurun.cloud.compute`).
Each is a `Backend`; both answer in the same views (`tpurun.cloud.views`), so nothing above the cloud
layer asks which one made a TPU. This module knows neither backend: which one made a TPU, and which one
makes a new one, is `tpurun.cloud.routing`'s to say.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tpurun.topology import Topology

if TYPE_CHECKING:
    from tpurun.cloud.client import Cloud
    from tpurun.cloud.prices import Price
    from tpurun.cloud.views import NodeView
    from tpurun.worker.watchdog_reports import WatchdogConfig

Progress = Callable[[str], None]
# per worker of a TPU, in worker order over its slices: {(namespace, key): value}
GuestAttributes = list[dict[tuple[str, str], str]]
# given a slice's (or VM's) metadata, the entries to set in it (None: leave it as it is)
MetadataChange = Callable[[dict[str, str]], dict[str, str] | None]


class Kind(str, enum.Enum):
    """Who makes a TPU; the words `create --backend`, `list` and `--json` use."""

    TPU_API = "tpu-api"
    COMPUTE = "compute"

    @property
    def api_name(self) -> str:
        return {"tpu-api": "Cloud TPU API", "compute": "Compute Engine"}[self.value]


@dataclass
class CreateSpec:
    """What `tpurun create` was asked for, as the user said it."""

    name: str
    accelerator_type: str | None = None  # or Compute Engine's spelling: machine_type and topology
    machine_type: str | None = None
    topology: str | None = None
    backend: str | None = None  # "tpu-api" or "compute"; None: the default for the type
    version: str | None = None
    spot: bool = False
    preemptible: bool = False
    queued: bool = False
    slices: int = 1  # several: one multislice TPU
    valid_until: str | None = None
    flex_start: bool = False  # Compute Engine's flex-start provisioning model
    max_run_duration: str | None = None  # with flex_start, e.g. 8h
    startup_script: Path | None = None
    setup: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    network: str | None = None
    subnetwork: str | None = None
    internal_ips: bool = False
    code: str | None = None  # DIR[:DEST]
    data: list[str] = field(default_factory=list)
    autostop: str | None = None  # e.g. 30m: the watchdog deletes (or stops) the TPU after that long idle
    autostop_action: str | None = None
    budget: float = 0.0  # USD: the watchdog deletes the TPU once its price has spent it (0: none)
    wait: bool = True
    timeout: float = 1800.0


@dataclass
class Request:
    """A `CreateSpec` checked and made ready for an API: its shape, the metadata every VM boots with
    (startup script, watchdog, tpurun's ssh key), its labels and how long it may wait for capacity."""

    topology: Topology
    backend: Kind
    metadata: dict[str, str]
    labels: dict[str, str]
    valid_until: int | None  # seconds
    max_run: int | None = None  # seconds a flex-start VM runs
    price: Price | None = None  # with `--budget`: the price per hour it is counted at (provision.make asks it)


@dataclass
class Deleted:
    """What went with a deleted TPU besides it, and what it used that was left, in the user's words (what the
    backend's `delete` says); `tpurun.cloud.provision.delete` adds what it changed on this machine."""

    also: list[str] = field(default_factory=list)  # "its queued resource"
    left: list[str] = field(default_factory=list)  # "the instance template T"
    why_left: str = ""  # why LEFT stayed: tpurun deletes only what it made, and how it knows
    default_in: Path | None = None  # the tpurun.toml that named it the default TPU and no longer does (`delete`)


class Backend(ABC):
    """A TPU's life through one API. Every method takes the name the user gave the TPU; a backend that
    has no TPU of that name answers None from `find` and nothing else is asked of it."""

    kind: Kind

    def __init__(self, cloud: Cloud) -> None:
        self.cloud = cloud

    @abstractmethod
    def find(self, name: str) -> NodeView | None:
        """The TPU NAME as it is now (a multislice TPU with every slice); None when this API has none."""

    @abstractmethod
    def all_tpus(self) -> list[NodeView]:
        """Every TPU of the zone this API made (slices of a multislice TPU listed on their own)."""

    @abstractmethod
    def read_maintenance(self, views: list[NodeView]) -> None:
        """Fill in the maintenance the API announces for VIEWS (its own TPUs) where `find` and `all_tpus` do not
        read it themselves."""

    @abstractmethod
    def start_maintenance(self, view: NodeView, progress: Progress) -> list[str]:
        """Start the maintenance announced for VIEW now, through the API's own method; what it was started on."""

    @abstractmethod
    def create(self, spec: CreateSpec, request: Request, progress: Progress) -> None:
        """Ask for the TPU; unless `spec.wait` is off, return once the API made every VM (or raise)."""

    @abstractmethod
    def asked_for(self, spec: CreateSpec, topology: Topology) -> str:
        """What `create` asks this API for to make SPEC, in the user's words ("the node demo")."""

    @abstractmethod
    def delete(self, view: NodeView, progress: Progress) -> Deleted:
        """Delete the TPU and everything tpurun made with it, waiting until it is gone (a part already being
        deleted is waited for): what else went, and what the TPU used that tpurun did not make and left."""

    def take_back(self, name: str, progress: Progress) -> Deleted | None:
        """Delete whatever of the TPU NAME this API holds, made whole or not (what an interrupted `create` or
        `delete` left), and wait until it is gone: what else went, as `delete` says it; None when it holds
        nothing of NAME."""
        view = self.find(name)
        return None if view is None else self.delete(view, progress)

    @abstractmethod
    def recreate(self, view: NodeView, progress: Progress) -> None:
        """Delete a preempted TPU and ask for it again with the same settings, waiting until its VMs exist."""

    @abstractmethod
    def stop(self, view: NodeView, progress: Progress) -> None: ...

    @abstractmethod
    def start(self, view: NodeView, progress: Progress) -> None: ...

    @abstractmethod
    def update_metadata(self, view: NodeView, change: MetadataChange) -> None:
        """Set what CHANGE gives in the metadata of every slice (or VM) of the TPU, keeping every other entry."""

    @abstractmethod
    def guest_attributes(self, view: NodeView, query_path: str) -> GuestAttributes:
        """What every worker published under QUERY_PATH ("hostkeys/", "tpurun/"), in worker order."""

    @abstractmethod
    def watchdog_resources(
        self, name: str, parts: list[str], multi_host: bool, view: NodeView | None
    ) -> WatchdogConfig:
        """What the TPU's watchdog calls and deletes (its resources: the API's root and the TPU's resources), as a
        `WatchdogConfig` with autostop off (tpurun/worker/watchdog.py reads it). VIEW: the TPU as it is;
        None: about to be made by tpurun, as the slices PARTS (multi-host ones if MULTI_HOST)."""

    @abstractmethod
    def cannot_stop(self, view: NodeView, verb: str) -> str:
        """Why the TPU cannot be stopped or started (VERB: which), "" when it can."""

    # what `create` checks before anything is made (and before the settings are read: no instance needed)

    @classmethod
    @abstractmethod
    def check_create(cls, spec: CreateSpec, topo: Topology) -> None:
        """Refuse what this API is not asked for by tpurun in SPEC (of shape TOPO)."""

    @classmethod
    @abstractmethod
    def run_limit(cls, spec: CreateSpec) -> int | None:
        """How long the VMs SPEC asks for may run, in seconds (flex-start capacity); None: until deleted.
        Refuses a flex-start this API does not give."""

    @classmethod
    @abstractmethod
    def cannot_stop_asked(cls, spec: CreateSpec, topo: Topology) -> str:
        """Why the TPU SPEC asks for could not be stopped, as `cannot_stop` would say of it once made; "" when
        it could (`--autostop-action stop` is refused for it)."""
