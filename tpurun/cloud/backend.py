"""The one interface between tpurun and whichever Google API made a TPU.

Two APIs make TPU VMs: the Cloud TPU API (nodes and queued resources, `tpurun.cloud.tpu_api`) and
Compute Engine (instances, and managed instance groups with a workload policy, `tpurun.cloud.compute`).
Each is a `Backend`; both answer in the same views (`tpurun.cloud.views`), so nothing above the cloud
layer asks which one made a TPU. `locate` finds the TPU a name stands for in either.
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tpurun.errors import ApiError
from tpurun.topology import Topology

if TYPE_CHECKING:
    from tpurun.cloud.client import Cloud
    from tpurun.cloud.views import NodeView
    from tpurun.worker.protocol_calls import WatchdogConfig

log = logging.getLogger(__name__)

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
    def create(self, spec: CreateSpec, request: Request, progress: Progress) -> None:
        """Ask for the TPU; unless `spec.wait` is off, return once the API made every VM (or raise)."""

    @abstractmethod
    def asked_for(self, spec: CreateSpec, topology: Topology) -> str:
        """What `create` asks this API for to make SPEC, in the user's words ("the node demo")."""

    @abstractmethod
    def delete(self, view: NodeView, progress: Progress) -> list[str]:
        """Delete the TPU and everything made with it, waiting until it is gone (a part already being deleted
        is waited for); what else went, for the user ("its queued resource")."""

    def take_back(self, name: str, progress: Progress) -> list[str] | None:
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


def backends(cloud: Cloud) -> Iterator[Backend]:
    """Both backends, the Cloud TPU API's first; each made (and its client imported, Compute Engine's
    taking a second or two) only when the caller goes on to it, and once per Cloud."""
    for kind in Kind:
        if kind not in cloud.backends:
            cloud.backends[kind] = _make(kind, cloud)
        yield cloud.backends[kind]


def _make(kind: Kind, cloud: Cloud) -> Backend:
    if kind is Kind.TPU_API:
        from tpurun.cloud.tpu_api import TpuApi

        return TpuApi(cloud)
    from tpurun.cloud.compute import Compute

    return Compute(cloud)


def of_kind(cloud: Cloud, kind: Kind) -> Backend:
    return next(b for b in backends(cloud) if b.kind is kind)


def locate(cloud: Cloud, name: str) -> tuple[Backend, NodeView] | None:
    """The TPU NAME and the API that made it; None when neither has one. An API that cannot be asked (not
    enabled in the project, no permission) is passed over with a warning when the other says it has no
    such TPU; its failure is raised only when no API could answer. Compute Engine's client is imported (a
    second) only when Compute Engine has something NAME could be: a name it does not know is answered fast."""
    failures: list[ApiError] = []
    answered = False
    for kind in Kind:
        try:
            if kind is Kind.COMPUTE and kind not in cloud.backends and not _compute_may_have(cloud, name):
                answered = True
                continue
            backend = of_kind(cloud, kind)
            view = backend.find(name)
        except ApiError as exc:
            failures.append(exc)
            continue
        if view is not None:
            return backend, view
        answered = True
    if failures and not answered:
        raise failures[0]
    for failure in failures:
        log.warning("%s (looking for %s there too)", failure.message, name)
    return None


def _compute_may_have(cloud: Cloud, name: str) -> bool:
    """Whether Compute Engine has what `Compute.find` would take for the TPU NAME: the instance group NAME, the
    VM NAME or the group of a first slice, NAME-0; asked by plain REST, without its client."""
    from tpurun.cloud.client import EVERY_ZONE

    if cloud.zone == EVERY_ZONE:
        return False  # Compute.find finds none there either
    where = f"zones/{cloud.zone}"
    looks = (f"instanceGroupManagers/{name}", f"instances/{name}", f"instanceGroupManagers/{name}-0")
    return any(cloud.compute_has(f"{where}/{look}") for look in looks)


def list_all(cloud: Cloud) -> list[NodeView]:
    """Every TPU of the zone, both APIs asked at once (Compute Engine's client takes a second to import,
    while the Cloud TPU API answers). An API that cannot be asked is passed over with a warning, unless
    neither can."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(kind: Kind) -> list[NodeView] | ApiError:
        try:
            return of_kind(cloud, kind).all_tpus()
        except ApiError as exc:
            return exc

    of_kind(cloud, Kind.TPU_API)  # made here: the threads then share the cached backends
    with ThreadPoolExecutor(max_workers=len(Kind)) as pool:
        answers = list(pool.map(ask, Kind))
    failures = [a for a in answers if isinstance(a, ApiError)]
    if len(failures) == len(answers):
        raise failures[0]
    for failure in failures:
        log.warning("%s; listing the other API's TPUs only", failure.message)
    return [v for a in answers if not isinstance(a, ApiError) for v in a]
