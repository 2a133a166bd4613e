"""TPUs made by the Cloud TPU API: a node, a node asked for through a queued resource, or the slices of
a multislice queued resource (tpurun.cloud.multislice), told in tpurun's views."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Mapping
from typing import Any

from google.cloud import tpu_v2

from tpurun.cloud import keys, multislice, startup
from tpurun.cloud.backend import Backend, CreateSpec, Deleted, GuestAttributes, Kind, MetadataChange, Progress, Request
from tpurun.cloud.client import short_name
from tpurun.cloud.multislice import qr_state
from tpurun.cloud.views import Maintenance, NodeView, WorkerView
from tpurun.errors import ApiError, UsageError
from tpurun.topology import Topology, parse_accelerator_type
from tpurun.worker.watchdog_reports import WatchdogConfig

STATE = tpu_v2.Node.State


class TpuApi(Backend):
    kind = Kind.TPU_API

    # ------------------------------------------------------------------ reading

    def find(self, name: str) -> NodeView | None:
        cloud = self.cloud
        node = cloud.find_node(name)
        if node is not None:
            return node_view(node)
        qr = cloud.find_queued_resource(name)
        if qr is None:
            return None
        if not multislice.slice_count(qr):
            view = _waiting_view(name, qr)  # a node asked for through a queued resource: not made, or gone
            if view.state in ("ACTIVE", "SUSPENDED", "FAILED"):
                view.gone = [0]
            return view
        found = multislice.slice_nodes(cloud, name)
        assert found is not None
        qr, nodes = found
        view = multislice_view(name, qr, [node_view(n) for n in nodes if n is not None])
        view.gone = [i for i, n in enumerate(nodes) if n is None]
        return view

    def all_tpus(self) -> list[NodeView]:
        return [node_view(n) for n in sorted(self.cloud.list_nodes(), key=lambda n: n.name)]

    def start_maintenance(self, view: NodeView, progress: Progress) -> list[str]:
        """v2alpha1's nodes.performMaintenance on a TPU of one slice; queuedResources.performMaintenanceQueuedResource
        with the slices that have maintenance pending, on a multislice TPU."""
        gen, _, size = view.accelerator_type.partition("-")
        if not (gen in ("v4", "v5p") or (gen in ("v5litepod", "v6e") and size.isdigit() and int(size) >= 8)):
            raise UsageError(
                f"Cloud TPU does not start maintenance on demand for {view.accelerator_type}: only for v4, v5p, "
                "and v5e or v6e of 2x4 (8 chips) or larger; it will start in its window"
            )
        pending = [m.where or view.name for m in view.maintenance if m.status == "PENDING"]
        if view.slices:
            self.cloud.perform_queued_maintenance(view.name, pending)
        elif pending:
            self.cloud.perform_maintenance(view.name)
        for name in pending:
            progress(f"{name}: maintenance started")
        return pending

    def read_maintenance(self, views: list[NodeView]) -> None:
        """Each node's `upcomingMaintenance`, read through v2alpha1 (google-cloud-tpu's v2 Node lacks the field):
        one get for one node, one list for more."""
        parts = [part for v in views for part in v.parts]
        if not parts:
            return
        found: Mapping[str, dict[str, Any] | None]
        if len(parts) == 1:
            found = {parts[0].name: self.cloud.get_node_maintenance(parts[0].name)}
        else:
            found = self.cloud.list_node_maintenance()
        for v in views:
            for part in v.parts:
                m = found.get(part.name)
                said = Maintenance.from_api(m, part.name if v.slices else "") if m is not None else None
                part.maintenance = [said] if said else []
            if v.slices:
                v.maintenance = [m for part in v.slices for m in part.maintenance]

    def guest_attributes(self, view: NodeView, query_path: str) -> GuestAttributes:
        out: GuestAttributes = []
        for part in view.parts:
            attrs = self.cloud.guest_attributes(self._path(part), query_path)
            out += [attrs[i] if i < len(attrs) else {} for i in range(len(part.workers))]
        return out

    def _path(self, part: NodeView) -> str:
        """A node's full name (a TPU listed from every zone is in its own zone)."""
        zone = part.zone or self.cloud.zone
        return f"projects/{self.cloud.project}/locations/{zone}/nodes/{part.name}"

    # ------------------------------------------------------------------ making

    def create(self, spec: CreateSpec, request: Request, progress: Progress) -> None:
        cloud = self.cloud
        node = tpu_v2.Node(
            accelerator_type=request.topology.name,
            runtime_version=spec.version or request.topology.default_runtime_version,
            labels=request.labels,
            metadata=request.metadata,
            network_config=tpu_v2.NetworkConfig(
                network=spec.network or "",
                subnetwork=spec.subnetwork or "",
                enable_external_ips=not spec.internal_ips,
            ),
            scheduling_config=tpu_v2.SchedulingConfig(spot=spec.spot, preemptible=spec.preemptible),
        )
        if spec.slices > 1:
            multislice.refuse_taken(cloud, spec.name, spec.slices)
            qr = multislice.queued_resource(cloud, spec.name, spec.slices, node)
            self._queue(spec, qr, request.valid_until, progress)
        elif spec.queued:
            nodes = [tpu_v2.QueuedResource.Tpu.NodeSpec(parent=cloud.parent, node_id=spec.name, node=node)]
            self._queue(
                spec,
                tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=nodes)),
                request.valid_until,
                progress,
            )
        else:
            op = cloud.create_node(spec.name, node)
            if spec.wait:
                cloud.wait(
                    f"create {spec.name}", op, timeout=spec.timeout, on_poll=lambda: progress(f"{spec.name}: CREATING")
                )

    def _queue(self, spec: CreateSpec, qr: tpu_v2.QueuedResource, valid_until: int | None, progress: Progress) -> None:
        """Ask for QR and, unless --no-wait, wait until it is ACTIVE (its nodes made)."""
        cloud = self.cloud
        if spec.spot:
            qr.spot = tpu_v2.QueuedResource.Spot()
        if valid_until:
            qr.queueing_policy = tpu_v2.QueuedResource.QueueingPolicy(valid_until_duration={"seconds": valid_until})
        op = cloud.create_queued_resource(spec.name, qr)
        cloud.wait(f"queue {spec.name}", op, timeout=120)
        deadline = time.monotonic() + (valid_until or spec.timeout)
        if not spec.wait:
            return
        for _ in cloud.iter_poll():
            got = cloud.get_queued_resource(spec.name)
            state = qr_state(got)
            progress(f"{spec.name}: queued resource {state}")
            if state == "ACTIVE":
                return
            if state in ("FAILED", "SUSPENDED"):
                detail = got.state.failed_data.error.message if got.state.failed_data else ""
                raise ApiError(
                    f"queued resource {spec.name} {state}{': ' + detail if detail else ''}",
                    hint=f"delete it with `tpurun delete {spec.name} --yes` and try another zone or size",
                )
            if time.monotonic() > deadline:
                raise ApiError(
                    f"queued resource {spec.name} is still {state} after {spec.timeout:.0f} s",
                    hint="it stays queued; check later with `tpurun list`, or `tpurun delete` it",
                )

    def asked_for(self, spec: CreateSpec, topology: Topology) -> str:
        if spec.slices > 1:
            return f"the queued resource {spec.name} and its {spec.slices} slices"
        if spec.queued:
            return f"the queued resource {spec.name} and its node"
        return f"the node {spec.name}"

    def delete(self, view: NodeView, progress: Progress) -> Deleted:
        cloud, name = self.cloud, view.name
        node_made = bool(view.id)  # a node (else: a queued resource waiting, or a multislice TPU)
        if node_made:
            self._remove(
                f"delete {name}",
                lambda: cloud.delete_node(name),
                lambda: _state(cloud.find_node(name)),
                lambda: progress(f"{name}: DELETING"),
            )
        if not view.queued_resource:
            return Deleted()
        short = short_name(view.queued_resource)
        progress(f"{name}: deleting queued resource {short}" + ("" if node_made else " and its slices"))
        self._remove(
            f"delete queued resource {view.queued_resource}",
            lambda: cloud.delete_queued_resource(view.queued_resource),
            lambda: _state(cloud.find_queued_resource(short)),
        )
        return Deleted(["its queued resource"])

    def _remove(
        self,
        what: str,
        ask: Callable[[], Any],
        state: Callable[[], str | None],
        on_poll: Callable[[], None] | None = None,
    ) -> None:
        """ASK for a deletion and wait for its operation. Refused because it is being deleted already (a deletion
        that was interrupted, which the API goes on with, or the TPU's watchdog's), it is waited for until STATE
        (its state now; None once it is gone) says it is gone."""
        try:
            op = ask()
        except ApiError:
            if state() not in ("DELETING", None):
                raise
            self.cloud.wait_gone(what, lambda: state() is None, on_poll=on_poll)
            return
        self.cloud.wait(what, op, timeout=1800, on_poll=on_poll)

    def recreate(self, view: NodeView, progress: Progress) -> None:
        """A multislice TPU is asked for again whole: Cloud TPU gives a queued resource's slices back only
        together."""
        cloud, name = self.cloud, view.name
        if not view.id:
            qr = cloud.get_queued_resource(name)
            template, count, spot = qr.tpu.node_spec[0].node, multislice.slice_count(qr), "spot" in qr
            progress(f"{name}: deleting queued resource {name} and its slices")
            cloud.wait(f"delete queued resource {name}", cloud.delete_queued_resource(name), timeout=1800)
            again = CreateSpec(name=name, accelerator_type=template.accelerator_type, spot=spot, slices=count)
            self._queue(again, multislice.queued_resource(cloud, name, count, template), None, progress)
            return
        old = cloud.get_node(name)
        node = tpu_v2.Node(
            accelerator_type=old.accelerator_type,
            runtime_version=old.runtime_version,
            labels=dict(old.labels),
            metadata=dict(old.metadata),
            network_config=old.network_config,
            scheduling_config=old.scheduling_config,
        )
        cloud.wait(
            f"delete {name}", cloud.delete_node(name), timeout=1800, on_poll=lambda: progress(f"{name}: DELETING")
        )
        cloud.wait(
            f"create {name}", cloud.create_node(name, node), timeout=1800, on_poll=lambda: progress(f"{name}: CREATING")
        )

    # ------------------------------------------------------------------ changing

    def watchdog_resources(
        self, name: str, parts: list[str], multi_host: bool, view: NodeView | None
    ) -> WatchdogConfig:
        endpoint = self.cloud.endpoint
        root = endpoint if "://" in endpoint else f"https://{endpoint}"  # a bare host means https
        return WatchdogConfig(root, [self.cloud.node_path(p) for p in parts])

    def cannot_stop(self, view: NodeView, verb: str) -> str:
        if view.slices or view.gone:
            return f"{view.name} is a multislice TPU; Cloud TPU can {verb} only single-host TPU VMs"
        if not view.id:
            return f"{view.name} is a queued resource {view.state}; Cloud TPU can {verb} only a TPU VM it made"
        if view.queued_resource:  # as `cannot_stop_asked` says of one asked for
            return f"{view.name} came from a queued resource, which Cloud TPU deletes but does not {verb}"
        topo = parse_accelerator_type(view.accelerator_type)
        if topo.multi_host:
            return (
                f"{view.name} is a {topo.name} pod slice with {topo.hosts} workers; Cloud TPU can {verb} only "
                "single-host TPU VMs"
            )
        return ""

    @classmethod
    def cannot_stop_asked(cls, spec: CreateSpec, topo: Topology) -> str:
        # a node asked for through a queued resource is not stopped either: Cloud TPU deletes it
        if topo.multi_host or spec.queued or spec.slices > 1:
            return f"Cloud TPU can stop only single-host TPU VMs, and {spec.name} ({topo.name}) is not one"
        return ""

    @classmethod
    def check_create(cls, spec: CreateSpec, topo: Topology) -> None:
        pass  # every option of `create` is the Cloud TPU API's

    @classmethod
    def run_limit(cls, spec: CreateSpec) -> int | None:
        if spec.flex_start:
            raise UsageError(
                "--flex-start: tpurun asks Compute Engine for flex-start capacity, and this TPU is made by the Cloud "
                "TPU API",
                hint="add --backend compute (v5p, v6e), or wait for capacity there with --queued",
            )
        return None

    def stop(self, view: NodeView, progress: Progress) -> None:
        op = self.cloud.stop_node(view.name)
        self.cloud.wait(f"stop {view.name}", op, timeout=1800, on_poll=lambda: progress(f"{view.name}: STOPPING"))

    def start(self, view: NodeView, progress: Progress) -> None:
        op = self.cloud.start_node(view.name)
        self.cloud.wait(f"start {view.name}", op, timeout=1800, on_poll=lambda: progress(f"{view.name}: STARTING"))

    def update_metadata(self, view: NodeView, change: MetadataChange) -> None:
        for part in view.parts:
            node = self.cloud.get_node(part.name)
            metadata = dict(node.metadata)
            entries = change(metadata)
            if not entries:
                continue
            metadata.update(entries)
            startup.check_limits(metadata)
            op = self.cloud.update_metadata(part.name, metadata)
            self.cloud.wait(f"update {part.name}", op, timeout=300)


def _state(found: tpu_v2.Node | tpu_v2.QueuedResource | None) -> str | None:
    """A node's or a queued resource's state; None when there is none."""
    if found is None:
        return None
    return STATE(found.state).name if isinstance(found, tpu_v2.Node) else qr_state(found)


def _zone_of(name: str) -> str:
    """The zone in a resource's full name, projects/P/locations/ZONE/..."""
    parts = name.split("/")
    return parts[3] if len(parts) > 3 and parts[2] == "locations" else ""


def node_view(node: tpu_v2.Node) -> NodeView:
    where = multislice.slice_of(node)
    workers = []
    for i, ep in enumerate(node.network_endpoints):
        ext = ep.access_config.external_ip if ep.access_config else ""
        alias = keys.host_key_alias(str(node.id), i)
        workers.append(WorkerView(i, ep.ip_address, ext, alias, slice=where[1] if where else None))
    created = None
    if node.create_time:
        created = node.create_time if node.create_time.tzinfo else node.create_time.replace(tzinfo=dt.timezone.utc)
    return NodeView(
        name=short_name(node.name),
        backend=Kind.TPU_API.value,
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
    )


def _waiting_view(name: str, qr: tpu_v2.QueuedResource) -> NodeView:
    """A queued resource whose node(s) are not made yet: its request's node stands for them."""
    template = qr.tpu.node_spec[0].node
    return NodeView(
        name=name,
        backend=Kind.TPU_API.value,
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


def multislice_view(name: str, qr: tpu_v2.QueuedResource, slices: list[NodeView]) -> NodeView:
    """The view of a multislice TPU: the queued resource's state, every slice's workers in slice order
    (none yet while it waits)."""
    if not slices:
        return _waiting_view(name, qr)
    return NodeView.joined(name, slices, qr_state(qr), queued_resource=qr.name)
