"""What `list`, `describe` and `create` show of a TPU: a node's view (its workers, their startup reports,
its autostop setting and what its watchdogs report), and a multislice TPU's view over its slices."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from google.cloud import tpu_v2

from tpurun import ui
from tpurun.cloud import autostop, multislice, startup
from tpurun.cloud.multislice import qr_state
from tpurun.naming import worker_name

STATE = tpu_v2.Node.State


@dataclass
class WorkerView:
    index: int
    internal_ip: str
    external_ip: str
    report: startup.StartupReport | None = None
    slice: int | None = None  # its slice, in a multislice TPU

    @property
    def name(self) -> str:
        return worker_name(self.index, self.slice)


@dataclass
class NodeView:
    """What `list` and `describe` show: one node, with the fields users ask about."""

    name: str
    accelerator_type: str
    state: str
    health: str
    runtime_version: str
    workers: list[WorkerView]
    spot: bool
    preemptible: bool
    created: dt.datetime | None
    labels: dict[str, str]
    metadata: dict[str, str]
    queued_resource: str
    id: str = ""  # the node's unique id in the API (a multislice TPU has one per slice)
    zone: str = ""
    slices: list[NodeView] = field(default_factory=list)  # a multislice TPU: one view per slice
    slice_of: tuple[str, int] | None = None  # a slice's node: (its multislice TPU, its slice index)
    activity: autostop.Activity = field(default_factory=autostop.Activity)  # what its watchdogs report

    @property
    def autostop_setting(self) -> autostop.Setting | None:
        return autostop.read(self.metadata)

    def age(self) -> str:
        if not self.created:
            return "-"
        return ui.age((dt.datetime.now(dt.timezone.utc) - self.created).total_seconds())

    def to_dict(self, *, full: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "id": self.id or None,
            "zone": self.zone or None,
            "acceleratorType": self.accelerator_type,
            "state": self.state,
            "health": self.health,
            "workers": len(self.workers),
            "spot": self.spot,
            "preemptible": self.preemptible,
            "age": self.age(),
            "createTime": self.created.isoformat() if self.created else None,
        }
        setting = self.autostop_setting  # "off" as the command says it; null: tpurun set nothing
        d["autostop"] = None
        if setting is not None:
            d["autostop"] = {"idleSeconds": setting.idle, "action": setting.action} if setting.idle else "off"
        d.update(self.activity.to_dict())
        if not full:
            d.pop("watchdog")
        if self.slice_of:
            d["multislice"] = {"tpu": self.slice_of[0], "slice": self.slice_of[1]}
        if self.slices:
            d["slices"] = [v.to_dict(full=full) for v in self.slices]
        if full:
            d["runtimeVersion"] = self.runtime_version
            d["labels"] = self.labels
            d["queuedResource"] = self.queued_resource
            d["metadata"] = {k: shorten_metadata(k, v) for k, v in self.metadata.items()}
            d["workerEndpoints"] = [
                {
                    "name": w.name,
                    "index": w.index,
                    "internalIp": w.internal_ip,
                    "externalIp": w.external_ip,
                    "startup": w.report.status if w.report else "unknown",
                }
                for w in self.workers
            ]
        return d


def shorten_metadata(key: str, value: str) -> str:
    """ssh-keys shown as user + key type + fingerprint-ish prefix; big values summarised."""
    if key == "ssh-keys":
        out = []
        for line in value.splitlines():
            user, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) >= 2:
                out.append(f"{user}:{parts[0]} {parts[1][:12]}…{parts[1][-6:]}")
        return "\n".join(out)
    if len(value) > 200:
        return f"<{len(value)} bytes>"
    return value


def _zone_of(name: str) -> str:
    """The zone in a resource's full name, projects/P/locations/ZONE/..."""
    parts = name.split("/")
    return parts[3] if len(parts) > 3 and parts[2] == "locations" else ""


def node_view(
    node: tpu_v2.Node,
    reports: list[startup.StartupReport] | None = None,
    activity: autostop.Activity | None = None,
) -> NodeView:
    where = multislice.slice_of(node)
    workers = []
    for i, ep in enumerate(node.network_endpoints):
        ext = ep.access_config.external_ip if ep.access_config else ""
        report = reports[i] if reports and i < len(reports) else None
        workers.append(WorkerView(i, ep.ip_address, ext, report, slice=where[1] if where else None))
    created = None
    if node.create_time:
        created = node.create_time if node.create_time.tzinfo else node.create_time.replace(tzinfo=dt.timezone.utc)
    return NodeView(
        name=node.name.rsplit("/", 1)[-1],
        zone=_zone_of(node.name),
        accelerator_type=node.accelerator_type,
        state=STATE(node.state).name,
        health=tpu_v2.Node.Health(node.health).name if node.health else "-",
        runtime_version=node.runtime_version,
        workers=workers,
        spot=bool(node.scheduling_config.spot),
        preemptible=bool(node.scheduling_config.preemptible),
        created=created,
        labels=dict(node.labels),
        metadata=dict(node.metadata),
        queued_resource=node.queued_resource,
        id=str(node.id) if node.id else "",
        slice_of=where,
        activity=activity or autostop.Activity(),
    )


def multislice_view(name: str, qr: tpu_v2.QueuedResource, slices: list[NodeView]) -> NodeView:
    """The view of a multislice TPU: the queued resource's state, every slice's workers in slice order
    (none yet while it waits: then the node template of its request stands for the slices)."""
    if not slices:
        template = qr.tpu.node_spec[0].node
        return NodeView(
            name=name,
            accelerator_type=template.accelerator_type,
            state=qr_state(qr),
            health="-",
            runtime_version=template.runtime_version,
            workers=[],
            spot="spot" in qr,
            preemptible=False,
            created=None,
            labels=dict(template.labels),
            metadata=dict(template.metadata),
            queued_resource=qr.name,
            zone=_zone_of(qr.name),
        )
    first = slices[0]
    return NodeView(
        name=name,
        zone=first.zone,
        accelerator_type=first.accelerator_type,
        state=qr_state(qr),
        health=first.health if all(v.health == first.health for v in slices) else "mixed",
        runtime_version=first.runtime_version,
        workers=[w for v in slices for w in v.workers],
        spot=first.spot,
        preemptible=first.preemptible,
        created=first.created,
        labels=first.labels,
        metadata=first.metadata,
        queued_resource=qr.name,
        slices=slices,
    )
