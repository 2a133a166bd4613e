"""TPU nodes: create, get, list, delete, stop, start, update, guest attributes; each change that takes
time runs as an operation on a background thread and boots or stops the workers through the hosts."""

from __future__ import annotations

import datetime as _dt
import errno
import random
from collections.abc import Callable
from typing import Any

from google.cloud import tpu_v2

from tpurun.emulator.compute_model import InstanceRecord
from tpurun.emulator.model import (
    EMPTY_TYPE,
    NODE_TYPE,
    ApiError,
    NodeRecord,
    Operation,
    SliceOf,
    check_zone,
    failed_precondition,
    invalid,
    paged,
    set_enum,
    slots_for,
    split_parent,
    to_json,
)
from tpurun.emulator.operations import Operations
from tpurun.topology import MEGASCALE_PORT


class Nodes(Operations):
    # ------------------------------------------------------------------ nodes

    def get_record(self, name: str) -> NodeRecord:
        return self._found(self.nodes, name, "nodes")

    def find_node(self, ref: str, zone: str | None = None) -> NodeRecord:
        """A node by full name or bare id, in ZONE if given (admin convenience)."""
        with self.lock:
            if ref in self.nodes and zone in (None, self.nodes[ref].zone):
                return self.nodes[ref]
            hits = [
                r for r in self.nodes.values() if r.node.name.rsplit("/", 1)[-1] == ref and zone in (None, r.zone)
            ]
        if not hits:
            raise ApiError(404, f"no node named '{ref}'" + (f" in zone {zone}" if zone else ""), "NOT_FOUND")
        if len(hits) > 1:
            raise ApiError(400, f"'{ref}' is ambiguous: {', '.join(h.node.name for h in hits)}; give the full name")
        return hits[0]

    def node_json(self, rec: NodeRecord) -> dict[str, Any]:
        with self.lock:
            return self._node_dict(rec)

    @staticmethod
    def _drop_maintenance(rec: NodeRecord | InstanceRecord) -> None:
        """REC (a node or a VM) goes: its announced maintenance with it (caller holds self.lock)."""
        if rec.maintenance is not None:
            rec.maintenance.now.set()  # its waiting thread wakes, finds it dropped and ends
            rec.maintenance = None

    @staticmethod
    def _node_dict(rec: NodeRecord) -> dict[str, Any]:
        """REC as the API answers it (caller holds self.lock): the v2 Node, with its upcoming maintenance (an
        output field of v2's REST resource that google-cloud-tpu's v2 Node lacks)."""
        out = to_json(rec.node)
        if rec.maintenance is not None:
            out["upcomingMaintenance"] = rec.maintenance.api()
        return out

    def _get_metadata_fn(self, rec: NodeRecord) -> Callable[[], dict[str, str]]:
        def get() -> dict[str, str]:
            with self.lock:
                return dict(rec.node.metadata)

        return get

    def create_node(
        self,
        parent: str,
        node_id: str,
        node: tpu_v2.Node,
        queued_resource: str = "",
        slice_of: SliceOf | None = None,
    ) -> dict[str, Any]:
        project, zone = split_parent(parent)
        check_zone(zone)
        topo = self._validate_node(node, node_id)
        name = f"{parent}/nodes/{node_id}"
        with self.lock:
            if name in self.nodes:
                raise ApiError(409, f"Resource '{name}' already exists", "ALREADY_EXISTS")
            node = tpu_v2.Node(node)
            node.name = name
            node.accelerator_type = topo.name
            node.accelerator_config = tpu_v2.AcceleratorConfig(
                type_=getattr(tpu_v2.AcceleratorConfig.Type, topo.api_type), topology=topo.topology
            )
            set_enum(node, "state", tpu_v2.Node.State.CREATING)
            node.id = random.randint(10**18, 9 * 10**18)
            set_enum(node, "api_version", tpu_v2.Node.ApiVersion.V2)
            node.create_time = _dt.datetime.now(tz=_dt.timezone.utc)
            node.network_endpoints = []
            set_enum(node, "health", tpu_v2.Node.Health.HEALTH_UNSPECIFIED)
            if queued_resource:
                node.queued_resource = queued_resource
            node.multislice_node = slice_of is not None
            region = zone.rsplit("-", 1)[0]
            nc = node.network_config
            if not nc.network:
                nc.network = f"projects/{project}/global/networks/default"
            if not nc.subnetwork:
                nc.subnetwork = f"projects/{project}/regions/{region}/subnetworks/default"
            node.network_config = nc
            rec = NodeRecord(node=node, topo=topo, project=project, zone=zone, key=name, slice_of=slice_of)
            rec.fail_with = self._too_many_workers(topo)
            if rec.fail_with is None and not queued_resource and not self._fits(zone, topo):
                rec.fail_with = self._no_capacity(zone)
            rec.holds = rec.fail_with is None
            self.nodes[name] = rec
            op = self._new_op(project, zone, "create", name)
        self._spawn(self._run_create, rec, op)
        return op.to_json()

    def _boot(self, rec: NodeRecord) -> None:
        """Boot the node's workers (blocking) and fill in its endpoints; caller holds rec.lock."""
        with self.lock:
            if not rec.slot:
                rec.slot = self._free_slot(rec.topo.hosts)
            slot = rec.slot
            project, zone = rec.project, rec.zone
        tried: set[int] = set()  # the slots of the spans that lost a race
        attempts = 0
        while True:
            try:
                workers = self.hosts.boot_node(
                    rec.key,
                    slot,
                    num_workers=rec.topo.hosts,
                    generation=rec.topo.generation,
                    accelerator_type=rec.topo.name,
                    get_metadata=self._get_metadata_fn(rec),
                    project=project,
                    zone=zone,
                    extra_tpu_env=(lambda: self._megascale_env(rec)) if rec.slice_of else None,
                    private=lambda i: not self._node_is_public(rec),
                )
                break
            except OSError as e:
                # lost a race for the slot's addresses to another emulator on this machine: a fresh
                # node moves to another slot (a stopped one keeps its addresses, like a real VM)
                attempts += 1
                if e.errno != errno.EADDRINUSE or rec.ever_booted or attempts >= 5:
                    raise
                tried.update(range(slot, slot + slots_for(rec.topo.hosts)))
                self.hosts.shutdown_node(rec.key, delete=True)
                with self.lock:
                    rec.slot = slot = self._free_slot(rec.topo.hosts, tried)
        with self.lock:
            rec.booted = rec.ever_booted = True
            external = bool(rec.node.network_config.enable_external_ips)
            rec.node.network_endpoints = [self._endpoint(w.address, external) for w in workers]
        self._persist_pids()

    def _megascale_env(self, rec: NodeRecord) -> dict[str, str]:
        """What a multislice node's `tpu-env` carries to join its slices: the coordinator (slice 0's first
        worker, once it has an address), the number of slices, this node's slice and the port."""
        assert rec.slice_of is not None
        env = {
            "MEGASCALE_NUM_SLICES": str(rec.slice_of.num_slices),
            "MEGASCALE_SLICE_ID": str(rec.slice_of.slice_id),
            "MEGASCALE_PORT": str(MEGASCALE_PORT),
        }
        with self.lock:
            first = self.nodes.get(rec.slice_of.first)
            endpoints = list(first.node.network_endpoints) if first is not None else []
        if endpoints:
            env["MEGASCALE_COORDINATOR_ADDRESS"] = f"{endpoints[0].ip_address}:{MEGASCALE_PORT}"
        return env

    def _ready(self, rec: NodeRecord, op: Operation) -> None:
        """REC is up and healthy: OP ends with the node."""
        with self.lock:
            rec.set_state("READY")
            set_enum(rec.node, "health", tpu_v2.Node.Health.HEALTHY)
            resp = {"@type": NODE_TYPE, **to_json(rec.node)}
        self._finish(op, resp)

    def _node_is_public(self, rec: NodeRecord) -> bool:
        """Whether REC's workers have external addresses (networkConfig.enableExternalIps; the API's default is
        none, gcloud's is one each)."""
        with self.lock:
            return bool(rec.node.network_config.enable_external_ips)

    @staticmethod
    def _endpoint(address: str, external: bool) -> tpu_v2.NetworkEndpoint:
        ep = tpu_v2.NetworkEndpoint(ip_address=address, port=8470)
        if external:
            ep.access_config = tpu_v2.AccessConfig(external_ip=address)
        return ep

    def _shutdown(self, rec: NodeRecord, delete: bool) -> None:
        if rec.booted or (delete and rec.ever_booted):
            self.hosts.shutdown_node(rec.key, delete=delete)
        rec.booted = False
        self._persist_pids()

    def _remove(self, rec: NodeRecord) -> None:
        with self.lock:
            if self.nodes.get(rec.node.name) is rec:
                del self.nodes[rec.node.name]
        self._persist_pids()

    def _run_create(self, rec: NodeRecord, op: Operation) -> None:
        if not self._sleep(self.config.delays.create):
            return
        with rec.lock:
            if rec.state != "CREATING":  # deleted while creating
                self._finish(
                    op, error=ApiError(409, f"{rec.node.name} was deleted while it was being created", "ABORTED")
                )
                return
            if rec.fail_with is not None:
                self._remove(rec)
                self._finish(op, error=rec.fail_with)
                return
            try:
                self._boot(rec)
            except Exception as e:  # boot failure: the create fails like an internal error on Google's side
                try:
                    self._shutdown(rec, delete=True)
                finally:
                    self._remove(rec)
                self._finish(op, error=ApiError(500, f"Internal error creating {rec.node.name}: {e}", "INTERNAL"))
                return
            self._ready(rec, op)
        self._queued_node_changed(rec)

    def get_node(self, name: str) -> dict[str, Any]:
        return self.node_json(self.get_record(name))

    def list_nodes(self, parent: str, page_size: int, page_token: str) -> dict[str, Any]:
        project, zone = split_parent(parent)
        with self.lock:
            recs = sorted(
                (r for r in self.nodes.values() if r.project == project and (zone == "-" or r.zone == zone)),
                key=lambda r: r.node.name,
            )
            return paged("nodes", [self._node_dict(r) for r in recs], page_size, page_token, omit_empty=True)

    def delete_node(self, name: str) -> dict[str, Any]:
        rec = self.get_record(name)
        with self.lock:
            if rec.state == "DELETING":
                raise failed_precondition(f"Node {name} is already being deleted.")
            rec.set_state("DELETING")
            set_enum(rec.node, "health", tpu_v2.Node.Health.HEALTH_UNSPECIFIED)
            self._drop_maintenance(rec)
        return self._node_operation(rec, "delete", self._run_delete)

    def _node_operation(self, rec: NodeRecord, verb: str, run: Callable[..., None], *args: Any) -> dict[str, Any]:
        """The operation VERB on REC's node, answered now and carried out by RUN(REC, the operation, *ARGS) on a
        thread of its own (the caller, holding the lock, has checked it may begin and set the node's new state)."""
        op = self._new_op(rec.project, rec.zone, verb, rec.node.name)
        self._spawn(run, rec, op, *args)
        return op.to_json()

    def _run_delete(self, rec: NodeRecord, op: Operation) -> None:
        self._sleep(self.config.delays.delete)
        with rec.lock:  # waits for a boot in progress to end
            try:
                self._shutdown(rec, delete=True)
            finally:
                self._remove(rec)
                self._finish(op, {"@type": EMPTY_TYPE})
        self._queued_node_changed(rec, gone=True)

    def stop_node(self, name: str) -> dict[str, Any]:
        rec = self.get_record(name)
        with self.lock:
            if rec.topo.multi_host:
                raise invalid(
                    f"Stop is not supported for multi-host TPU slices: {name} is a {rec.topo.name} with "
                    f"{rec.topo.hosts} workers. Only single-host TPU VMs can be stopped; delete the slice instead."
                )
            if rec.state != "READY":
                raise failed_precondition(f"Node {name} is in state {rec.state}; only a READY node can be stopped.")
            rec.set_state("STOPPING")
            self._drop_maintenance(rec)
        return self._node_operation(rec, "stop", self._run_stop)

    def _run_stop(self, rec: NodeRecord, op: Operation) -> None:
        self._sleep(self.config.delays.stop)
        with rec.lock:
            self._shutdown(rec, delete=False)
            with self.lock:
                rec.set_state("STOPPED")
                set_enum(rec.node, "health", tpu_v2.Node.Health.HEALTH_UNSPECIFIED)
                resp = {"@type": NODE_TYPE, **to_json(rec.node)}
            self._finish(op, resp)

    def start_node(self, name: str) -> dict[str, Any]:
        rec = self.get_record(name)
        with self.lock:
            if rec.state != "STOPPED":
                raise failed_precondition(f"Node {name} is in state {rec.state}; only a STOPPED node can be started.")
            rec.set_state("STARTING")
            rec.holds = False
            fail = None if self._fits(rec.zone, rec.topo) else self._no_capacity(rec.zone)
            rec.holds = True
        return self._node_operation(rec, "start", self._run_start, fail)

    def _run_start(self, rec: NodeRecord, op: Operation, fail: ApiError | None) -> None:
        self._sleep(self.config.delays.start)
        with rec.lock:
            if fail is not None:
                with self.lock:
                    rec.set_state("STOPPED")
                self._finish(op, error=fail)
                return
            try:
                self._boot(rec)
            except Exception as e:
                with self.lock:
                    rec.set_state("STOPPED")
                self._finish(op, error=ApiError(500, f"Internal error starting {rec.node.name}: {e}", "INTERNAL"))
                return
            self._ready(rec, op)

    UPDATABLE = {
        "description": "description",
        "tags": "tags",
        "labels": "labels",
        "metadata": "metadata",
        "network_config.enable_external_ips": "network_config.enable_external_ips",
        "networkConfig.enableExternalIps": "network_config.enable_external_ips",
    }

    def update_node(self, node: tpu_v2.Node, update_mask: str) -> dict[str, Any]:
        name = node.name
        rec = self.get_record(name)
        paths = [p.strip() for p in update_mask.split(",") if p.strip()]
        if not paths:
            raise invalid("Invalid value for field 'update_mask': ''. The update mask must name the fields to update.")
        fields = []
        for p in paths:
            if p not in self.UPDATABLE:
                raise invalid(
                    f"Invalid value for field 'update_mask': '{p}'. Updatable fields: description, tags, labels, "
                    "metadata, network_config.enable_external_ips."
                )
            fields.append(self.UPDATABLE[p])
        if "metadata" in fields:
            self._validate_metadata(dict(node.metadata))
        with self.lock:
            if rec.state not in ("READY", "STOPPED"):
                raise failed_precondition(f"Node {name} is in state {rec.state}; it cannot be updated now.")
        return self._node_operation(rec, "update", self._run_update, node, fields)

    def _run_update(self, rec: NodeRecord, op: Operation, node: tpu_v2.Node, fields: list[str]) -> None:
        self._sleep(self.config.delays.update)
        refresh = access = False
        with self.lock:
            n = rec.node
            for f in fields:
                if f == "description":
                    n.description = node.description
                elif f == "tags":
                    n.tags = list(node.tags)
                elif f == "labels":
                    n.labels = dict(node.labels)
                elif f == "metadata":
                    # who may log in follows the metadata (ssh-keys, enable-oslogin, ...): guest_login
                    refresh = dict(n.metadata) != dict(node.metadata)
                    n.metadata = dict(node.metadata)
                else:
                    nc = n.network_config
                    access = nc.enable_external_ips != node.network_config.enable_external_ips
                    nc.enable_external_ips = node.network_config.enable_external_ips
                    n.network_config = nc
                    n.network_endpoints = [
                        self._endpoint(ep.ip_address, nc.enable_external_ips) for ep in n.network_endpoints
                    ]
            booted, ever = rec.booted, rec.ever_booted
        if refresh and booted:
            with rec.lock:
                self.hosts.refresh_ssh_keys(rec.key)
        if access and ever:  # a stopped node's workers take it at their next boot, a running one's now
            with rec.lock:
                self.hosts.refresh_access(rec.key)
        with self.lock:
            resp = {"@type": NODE_TYPE, **to_json(rec.node)}
        self._finish(op, resp)

    def get_guest_attributes(self, name: str, query_path: str, worker_ids: list[str]) -> dict[str, Any]:
        rec = self.get_record(name)
        with self.lock:
            if rec.state != "READY" or not rec.booted:
                raise failed_precondition(
                    f"Node {name} is in state {rec.state}; guest attributes are available only while it is READY."
                )
        per_worker = self.hosts.guest_attributes(rec.key)
        wanted: set[int] | None = None
        if worker_ids and worker_ids != ["all"]:
            try:
                wanted = {int(w) for w in worker_ids}
            except ValueError as e:
                raise invalid(f"Invalid value for field 'worker_ids': {worker_ids}.") from e
            bad = sorted(w for w in wanted if not 0 <= w < len(per_worker))
            if bad:
                raise invalid(
                    f"Invalid value for field 'worker_ids': worker {bad[0]} does not exist "
                    f"(the node has {len(per_worker)} workers)."
                )
        ns, _, key = query_path.partition("/")
        out = []
        for i, attrs in enumerate(per_worker):
            if wanted is not None and i not in wanted:
                continue
            items = [
                {"namespace": n, "key": k, "value": v}
                for (n, k), v in sorted(attrs.items())
                if (not ns or n == ns) and (not key or k == key)
            ]
            entry: dict[str, Any] = {"queryPath": query_path}
            if items:
                entry["queryValue"] = {"items": items}
            out.append(entry)
        return {"guestAttributes": out}
