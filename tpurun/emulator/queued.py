"""Queued resources: created, scheduled as capacity frees up (a background loop), provisioned as nodes,
and deleted with them."""

from __future__ import annotations

import datetime as _dt
import time
from typing import Any

from google.cloud import tpu_v2

from tpurun.emulator.model import (
    EMPTY_TYPE,
    NODE_ID_RE,
    QR_TYPE,
    ApiError,
    EmulatorConfig,
    HostsLike,
    NodeRecord,
    Operation,
    QueuedRecord,
    SliceOf,
    check_zone,
    failed_precondition,
    invalid,
    paged,
    split_parent,
    to_json,
)
from tpurun.emulator.nodes import Nodes
from tpurun.topology import Topology


class Queued(Nodes):
    def __init__(self, hosts: HostsLike, config: EmulatorConfig) -> None:
        super().__init__(hosts, config)
        self._every_tick("queue", self._schedule_once)  # waiting queued resources to PROVISIONING once they fit

    # ------------------------------------------------------------------ queued resources

    def create_queued_resource(self, parent: str, qr_id: str, qr: tpu_v2.QueuedResource) -> dict[str, Any]:
        project, zone = split_parent(parent)
        check_zone(zone)
        if not qr_id or not NODE_ID_RE.match(qr_id):
            raise invalid(
                f"Invalid value for field 'queued_resource_id': '{qr_id}'. Must be a match of regex "
                "'[a-z]([-a-z0-9]*[a-z0-9])?' and at most 63 characters long."
            )
        if not qr.tpu or not qr.tpu.node_spec:
            raise invalid(
                "Invalid value for field 'queued_resource.tpu.node_spec': at least one node spec is required."
            )
        specs: list[tuple[str, tpu_v2.Node, Topology]] = []
        multislice = False
        for spec in qr.tpu.node_spec:
            if spec.parent and spec.parent != parent:
                raise invalid(f"Invalid value for field 'node_spec.parent': '{spec.parent}' (must be '{parent}').")
            if "multislice_params" in spec:
                multislice = True
                ids = self._slice_ids(qr_id, spec, len(qr.tpu.node_spec))
            else:
                ids = [spec.node_id]
            for nid in ids:
                topo = self._validate_node(spec.node, nid)
                if "multislice_params" in spec and not topo.multislice:
                    raise invalid(
                        f"Invalid value for field 'node_spec.multislice_params': multislice is supported on TPU "
                        f"v4 and newer, not on {topo.name}."
                    )
                specs.append((nid, spec.node, topo))
        name = f"{parent}/queuedResources/{qr_id}"
        with self.lock:
            if name in self.queued:
                raise ApiError(409, f"Resource '{name}' already exists", "ALREADY_EXISTS")
            for nid, _, _ in specs:
                if f"{parent}/nodes/{nid}" in self.nodes:
                    raise ApiError(409, f"Resource '{parent}/nodes/{nid}' already exists", "ALREADY_EXISTS")
            qr = tpu_v2.QueuedResource(qr)
            qr.name = name
            qr.create_time = _dt.datetime.now(tz=_dt.timezone.utc)
            rec = QueuedRecord(qr=qr, project=project, zone=zone, specs=specs, multislice=multislice)
            pol = qr.queueing_policy
            if pol and pol.valid_until_duration:
                rec.deadline = time.time() + pol.valid_until_duration.total_seconds()
            elif pol and pol.valid_until_time:
                rec.deadline = pol.valid_until_time.timestamp()
            for _, _, topo in specs:
                err = self._too_many_workers(topo)
                if err is not None or self._exceeds_total(zone, topo):
                    rec.set_state("FAILED", err or self._no_capacity(zone))
                    break
            else:
                rec.set_state("WAITING_FOR_RESOURCES")
            self.queued[name] = rec
            op = self._new_op(project, zone, "create", name)
            self._finish(op, {"@type": QR_TYPE, **to_json(qr)})
        return op.to_json()

    @staticmethod
    def _slice_ids(qr_id: str, spec: tpu_v2.QueuedResource.Tpu.NodeSpec, specs: int) -> list[str]:
        """The node ids of a multislice node spec: PREFIX-0 … PREFIX-(N-1), the prefix defaulting to the
        queued resource's id."""
        ms = spec.multislice_params
        if specs != 1:
            raise invalid("Invalid value for field 'tpu.node_spec': a multislice request has exactly one node spec.")
        if spec.node_id:
            raise invalid(
                "Invalid value for field 'node_spec.node_id': give node_id_prefix in multislice_params instead."
            )
        if ms.node_count < 2:
            raise invalid(
                f"Invalid value for field 'node_spec.multislice_params.node_count': {ms.node_count}. "
                "Must be at least 2."
            )
        prefix = ms.node_id_prefix or qr_id
        return [f"{prefix}-{i}" for i in range(ms.node_count)]

    def get_qr_record(self, name: str) -> QueuedRecord:
        return self._found(self.queued, name, "queuedResources")

    def get_queued_resource(self, name: str) -> dict[str, Any]:
        rec = self.get_qr_record(name)
        with self.lock:
            return to_json(rec.qr)

    def list_queued_resources(self, parent: str, page_size: int, page_token: str) -> dict[str, Any]:
        project, zone = split_parent(parent)
        with self.lock:
            items = [
                to_json(r.qr)
                for n, r in sorted(self.queued.items())
                if r.project == project and (zone == "-" or r.zone == zone)
            ]
        return paged("queuedResources", items, page_size, page_token, omit_empty=True)

    def delete_queued_resource(self, name: str, force: bool) -> dict[str, Any]:
        rec = self.get_qr_record(name)
        with self.lock:
            live = [n for n in rec.node_names if n in self.nodes]
            if live and not force:
                raise failed_precondition(
                    f"Queued resource {name} is in state {rec.state} and still has nodes ({', '.join(live)}); "
                    "delete them first or set force=true."
                )
            rec.set_state("DELETING")
            op = self._new_op(rec.project, rec.zone, "delete", name)
        self._spawn(self._run_delete_qr, rec, op, live)
        return op.to_json()

    def _run_delete_qr(self, rec: QueuedRecord, op: Operation, live: list[str]) -> None:
        for n in live:
            try:
                self.delete_node(n)
            except ApiError:
                pass  # already deleting
        deadline = time.time() + 600
        while any(n in self.nodes for n in live) and time.time() < deadline and self._sleep(0.05):
            pass
        self._sleep(self.config.delays.delete)
        with self.lock:
            self.queued.pop(rec.qr.name, None)
        self._finish(op, {"@type": EMPTY_TYPE})

    def reset_queued_resource(self, name: str) -> dict[str, Any]:
        rec = self.get_qr_record(name)
        with self.lock:
            if rec.state not in ("FAILED", "SUSPENDED"):
                raise failed_precondition(
                    f"Queued resource {name} is in state {rec.state}; only FAILED or SUSPENDED "
                    "queued resources can be reset."
                )
            if any(n in self.nodes for n in rec.node_names):
                raise failed_precondition(f"Queued resource {name} still has nodes; delete them first.")
            rec.node_names = []
            rec.waiting_since = time.time()
            rec.set_state("WAITING_FOR_RESOURCES")
            op = self._new_op(rec.project, rec.zone, "reset", name)
            self._finish(op, {"@type": QR_TYPE, **to_json(rec.qr)})
        return op.to_json()

    def _schedule_once(self) -> None:
        with self.lock:
            waiting = sorted(
                (r for r in self.queued.values() if r.state == "WAITING_FOR_RESOURCES"), key=lambda r: r.waiting_since
            )
            now = time.time()
            for rec in waiting:
                if rec.deadline is not None and now > rec.deadline:
                    rec.set_state(
                        "FAILED",
                        ApiError(
                            504,
                            "The queued resource's valid_until time passed before capacity was available.",
                            "DEADLINE_EXCEEDED",
                        ),
                    )
                    continue
                if now - rec.waiting_since < self.config.delays.queue:
                    continue
                topos = [t for _, _, t in rec.specs]
                if not self._fits(rec.zone, topos[0], topos[1:]):
                    continue  # first come, first served: later requests may still fit
                rec.set_state("PROVISIONING")
                parent = f"projects/{rec.project}/locations/{rec.zone}"
                first = f"{parent}/nodes/{rec.specs[0][0]}"
                for i, (nid, tmpl, _) in enumerate(rec.specs):
                    node = tpu_v2.Node(tmpl)
                    if "spot" in rec.qr:  # an empty Spot message is falsy: test presence
                        node.scheduling_config = tpu_v2.SchedulingConfig(spot=True)
                    slice_of = SliceOf(i, len(rec.specs), first) if rec.multislice else None
                    try:
                        self.create_node(parent, nid, node, queued_resource=rec.qr.name, slice_of=slice_of)
                        rec.node_names.append(f"{parent}/nodes/{nid}")
                    except ApiError as e:
                        rec.set_state("FAILED", e)
                        break

    def _queued_node_changed(self, rec: NodeRecord, gone: bool = False) -> None:
        """Keep a queued resource's state in step with its nodes."""
        qr_name = rec.node.queued_resource
        if not qr_name:
            return
        with self.lock:
            q = self.queued.get(qr_name)
            if q is None or q.state == "DELETING":
                return
            states = [self.nodes[n].state if n in self.nodes else "GONE" for n in q.node_names]
            if q.state == "PROVISIONING":
                if any(s == "GONE" for s in states):
                    q.set_state("FAILED", ApiError(500, f"Node {rec.node.name} could not be created.", "INTERNAL"))
                elif all(s == "READY" for s in states):
                    q.set_state("ACTIVE")
            elif q.state == "ACTIVE" and (gone or rec.state == "PREEMPTED"):
                q.set_state("SUSPENDED")
