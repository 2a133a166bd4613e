"""Which workers a command acts on: a TPU's workers over SSH, or this machine as a one-host pod."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tpurun import config, settings
from tpurun.cloud import keys
from tpurun.errors import UnreachableError, UsageError
from tpurun.transport.fanout import connect_all
from tpurun.transport.runner import LocalRunner, Runner, SshRunner, Worker, parse_worker_spec

if TYPE_CHECKING:
    from google.cloud import tpu_v2  # not at run time: exec and train load the Cloud TPU client only when asked


@dataclass
class Target:
    """The selected workers of one TPU (or of this machine), with a runner each."""

    name: str  # TPU name, or "local"
    accelerator_type: str | None
    runners: list[Runner]
    all_workers: list[Worker]  # every worker of the node, selected or not (rank math needs them)
    local: bool
    nodes: list[str] = field(default_factory=list)  # the TPU's nodes: one, or one per slice
    cached: bool = False  # built from remembered endpoints, without an API call
    refresh: Callable[[], Target] | None = field(default=None, repr=False)

    @property
    def slices(self) -> int:
        """How many slices the TPU has (1 unless it is a multislice TPU)."""
        return len({w.slice for w in self.all_workers})

    def python(self, chosen: str | None = None) -> str:
        """CHOSEN, else the workers' Python when none is named (this machine: the one tpurun runs in)."""
        return chosen or self.runners[0].python

    def close(self) -> None:
        for r in self.runners:
            r.close()

    def connect(self, then: Callable[[SshRunner], None] | None = None) -> dict[int, str]:
        """Connect every runner at once; {worker: error} for those that failed.

        Remembered endpoints save the API call (and importing its client) on every command; they are
        checked against the API as soon as a worker cannot be reached, so a preempted, stopped or
        recreated node is reported as such.
        """
        errors = connect_all(self.runners, then)
        if not errors or not self.cached or self.refresh is None:
            return errors
        fresh = self.refresh()  # raises UnreachableError when the node is not READY any more
        if fresh.all_workers == self.all_workers:
            fresh.close()
            return errors
        self.close()
        self.runners, self.all_workers, self.nodes, self.cached = fresh.runners, fresh.all_workers, fresh.nodes, False
        self.accelerator_type = fresh.accelerator_type
        return connect_all(self.runners, then)


def _mapped(address: str) -> tuple[str, int]:
    """ADDRESS rewritten by TPURUN_ADDRESS_MAP (testing only: JSON {"real_ip": "other_ip[:port]"}), and its port.

    Lets tests and benchmarks put something between tpurun and a worker, e.g. the latency proxy of
    tpurun.testing.latency_proxy; host keys are then checked under the mapped address.
    """
    raw = config.ADDRESS_MAP.raw()
    if not raw:
        return address, 22
    try:
        mapping = json.loads(raw)
        to = str(mapping.get(address, address))
        host, _, port = to.partition(":")
        return host, int(port or 22)
    except (ValueError, AttributeError):
        raise UsageError('bad TPURUN_ADDRESS_MAP: give JSON like {"10.0.0.2": "127.0.0.1:2222"}') from None


def resolve(
    *,
    tpu: str | None,
    local: bool,
    worker_spec: str = "all",
    project: str | None = None,
    zone: str | None = None,
    announce: Callable[[str], None] | None = None,
) -> Target:
    """The workers a command acts on; ANNOUNCE is told when that is this machine (a one-host pod)."""
    s = settings.resolve({"tpu": tpu, "project": project, "zone": zone})
    if local and tpu:
        raise UsageError("choose one of --tpu and --local")
    name = None if local else s.tpu.value
    if not name:
        parse_worker_spec(worker_spec, 1)
        if announce is not None:
            why = "--local" if local else "no TPU configured (--tpu, TPURUN_TPU or tpu in tpurun.toml)"
            announce(f"running on this machine as a one-host pod ({why})")
        w = Worker(0, "127.0.0.1")
        return Target("local", None, [LocalRunner(w)], [w], True)

    from tpurun.naming import validate_name

    validate_name(name)
    try:
        project, zone = s.require_location()
    except UsageError as exc:
        raise UsageError(
            f"{exc.message}; or run on this machine with --local (the TPU {name!r} comes from {s.tpu.source})"
        ) from None
    cache = node_cache_path(s.home_path, project, zone, name)
    remembered = _read_cache(cache)

    def from_api() -> Target:
        endpoints = _fetch(s, name)
        _write_cache(cache, endpoints)
        return _build(s, name, endpoints, worker_spec, cached=False)

    if remembered is None:
        return from_api()
    target = _build(s, name, remembered, worker_spec, cached=True)
    target.refresh = from_api
    return target


def node_cache_path(home: Path, project: str, zone: str, name: str) -> Path:
    return home / "nodes" / f"{project}--{zone}--{name}.json"


def forget_node(home: Path, project: str, zone: str, name: str) -> None:
    node_cache_path(home, project, zone, name).unlink(missing_ok=True)


@dataclass(frozen=True)
class Endpoints:
    """What reaching a TPU's workers takes: its accelerator type and, per slice, each worker's (internal,
    external) address. One slice unless the TPU is a multislice one."""

    accelerator_type: str
    slices: list[list[tuple[str, str]]]
    nodes: list[str]  # the node of each slice
    multislice: bool = False

    def to_json(self) -> dict:
        return {
            "acceleratorType": self.accelerator_type,
            "slices": self.slices,
            "nodes": self.nodes,
            "multislice": self.multislice,
        }

    @classmethod
    def from_json(cls, data: dict) -> Endpoints:
        slices = [[(str(a), str(b)) for a, b in eps] for eps in data["slices"]]
        nodes = [str(n) for n in data["nodes"]]
        return cls(str(data["acceleratorType"]), slices, nodes, bool(data.get("multislice")))


def _read_cache(path: Path) -> Endpoints | None:
    if config.NODE_CACHE.raw() == "0":
        return None
    try:
        return Endpoints.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cache(path: Path, endpoints: Endpoints) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**endpoints.to_json(), "saved": time.time()}))
    os.replace(tmp, path)


def _fetch(s: settings.Settings, name: str) -> Endpoints:
    """Where NAME's workers are (every slice's, for a multislice TPU), if each of its nodes is READY."""
    from tpurun.cloud import multislice
    from tpurun.cloud.client import Cloud
    from tpurun.cloud.multislice import qr_state

    cloud = Cloud(s)
    node, found = multislice.find(cloud, name)
    if found is None:
        node = node or cloud.get_node(name)  # NotFound, with similar names
        return Endpoints(node.accelerator_type, [_ready_endpoints(name, node)], [name])
    qr, nodes = found
    ready = []
    for i, n in enumerate(nodes):
        if n is None:
            raise UnreachableError(
                f"{name}: slice {i} does not exist (its queued resource is {qr_state(qr)}), so its workers "
                "cannot be reached",
                hint=f"`tpurun describe {name}`",
            )
        ready.append(_ready_endpoints(name, n, f" (slice {i})"))
    names = [n.name.rsplit("/", 1)[-1] for n in nodes if n is not None]
    return Endpoints(nodes[0].accelerator_type if nodes[0] else "", ready, names, multislice=True)


def _ready_endpoints(name: str, node: tpu_v2.Node, what: str = "") -> list[tuple[str, str]]:
    """(internal, external) address of each worker of NODE (of the TPU NAME; WHAT says which part of it)."""
    from tpurun.cloud.provision import STATE

    state = STATE(node.state).name
    if state != "READY":
        raise UnreachableError(
            f"{name}{what} is {state}, so its workers cannot be reached",
            hint=f"`tpurun describe {name}`" + (f"; `tpurun start {name}`" if state == "STOPPED" else ""),
        )
    return [
        (ep.ip_address, ep.access_config.external_ip if ep.access_config else "") for ep in node.network_endpoints
    ]


def _build(s: settings.Settings, name: str, endpoints: Endpoints, worker_spec: str, *, cached: bool) -> Target:
    user = keys.ssh_user()
    workers: list[Worker] = []
    for slice_id, slice_endpoints in enumerate(endpoints.slices):
        for host, (internal, external) in enumerate(slice_endpoints):
            address, port = _mapped(external or internal)
            where = slice_id if endpoints.multislice else None
            workers.append(Worker(len(workers), address, port, user, slice=where, host=host, internal=internal))
    chosen = parse_worker_spec(worker_spec, len(workers), [w.name for w in workers] if endpoints.multislice else None)
    home = s.home_path
    runners: list[Runner] = [
        SshRunner(workers[i], key_path=keys.key_path(home), known_hosts=keys.known_hosts_path(home), node_name=name)
        for i in chosen
    ]
    return Target(name, endpoints.accelerator_type, runners, workers, False, nodes=endpoints.nodes, cached=cached)
