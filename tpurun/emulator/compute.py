"""Compute Engine in the emulator, first part: operations (zonal, regional, global, with `wait`), workload
policies, instance templates and standalone instances, whose VMs are worker hosts like a node's.

Each method takes parsed compute_v1 messages and answers JSON in the real API's shapes, or raises ApiError
made by compute_model (Compute Engine's error body). The managed instance groups build on this
(compute_migs.py).
"""

from __future__ import annotations

import base64
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from google.cloud import compute_v1

from tpurun.emulator.compute_model import (
    ComputeOperation,
    Failure,
    Group,
    InstanceRecord,
    already_exists,
    compute_error,
    full_path,
    in_use,
    invalid_field,
    link,
    no_resources,
    not_found,
    path_of,
    stamp,
)
from tpurun.emulator.hosts import ComputeVms
from tpurun.emulator.model import EmulatorConfig, HostsLike, now_rfc3339, page, slots_for, to_json
from tpurun.emulator.queued import Queued
from tpurun.emulator.tpu_vm import stable_int
from tpurun.errors import UsageError
from tpurun.topology import Topology, vm_topology

T = TypeVar("T")

NAME_RE = re.compile(r"^[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?$")  # RFC 1035, as every Compute Engine name
REGION_RE = re.compile(r"^[a-z]+-[a-z]+\d+$")
ZONE_RE = re.compile(r"^[a-z]+-[a-z]+\d+-[a-z]$")
WAIT_SECONDS = 120.0  # how long `operations.wait` holds a call before answering an unfinished operation
# instance states in which a VM holds capacity in its zone (a PROVISIONING one still waits for it)
_HOLDING = {"STAGING", "RUNNING", "STOPPING", "REPAIRING"}


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def check_name(name: str, what: str = "resource.name") -> None:
    if not NAME_RE.match(name or ""):
        raise invalid_field(
            what,
            name,
            "Must be a match of regex '(?:[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?|[1-9][0-9]{0,19})'",
        )


def check_zone(zone: str) -> None:
    if not ZONE_RE.match(zone):
        raise compute_error(400, f"Invalid value for field 'zone': '{zone}'. Unknown zone.", "invalid")


def check_region(region: str) -> None:
    if not REGION_RE.match(region):
        raise compute_error(400, f"Invalid value for field 'region': '{region}'. Unknown region.", "invalid")


def fingerprint() -> str:
    return base64.b64encode(os.urandom(8)).decode()


@dataclass(frozen=True)
class ListQuery:
    """A list call's page and filter: `maxResults` (500 when 0), `pageToken`, and `filter` in the simple form
    `FIELD = VALUE`, `FIELD != VALUE` (exact), `FIELD eq REGEX`, `FIELD ne REGEX` (whole value), joined by
    spaces or AND; FIELD is a JSON path such as `name`, `status` or `labels.team`."""

    max_results: int = 0
    page_token: str = ""
    filter: str = ""

    def keeps(self, item: dict[str, Any]) -> bool:
        for field_path, op, value in _terms(self.filter):
            got: Any = item
            for part in field_path.split("."):
                got = got.get(part, "") if isinstance(got, dict) else ""
            text = str(got)
            hit = re.fullmatch(value, text) is not None if op in ("eq", "ne") else text == value
            if hit == (op in ("!=", "ne")):
                return False
        return True

    def page(self, items: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
        """One page (500 items by default) of the ITEMS the filter keeps, and the next page's token."""
        return page([item for item in items if self.keeps(item)], self.max_results, self.page_token, default_size=500)


_TERM = re.compile(r'\s*\(?\s*([A-Za-z][\w.]*)\s*(=|!=|\beq\b|\bne\b)\s*(?:"([^"]*)"|([^\s)]+))\s*\)?\s*(?:AND\s+)?')


def _terms(text: str) -> list[tuple[str, str, str]]:
    terms, pos, text = [], 0, text.strip()
    while pos < len(text):
        m = _TERM.match(text, pos)
        if m is None:
            raise compute_error(400, f"Invalid list filter expression '{text}'.", "invalid")
        terms.append((m.group(1), m.group(2), m.group(3) if m.group(3) is not None else m.group(4)))
        pos = m.end()
    return terms


def listing(kind: str, path: str, items: list[dict[str, Any]], query: ListQuery) -> dict[str, Any]:
    """A Compute Engine list answer: the items QUERY's filter keeps, one page of them, with its kind and link."""
    chunk, nxt = query.page(items)
    out: dict[str, Any] = {"kind": kind, "id": path, "items": chunk, "selfLink": link(path)}
    if not chunk:
        del out["items"]
    if nxt:
        out["nextPageToken"] = nxt
    return out


def aggregated(kind: str, path: str, collection: str, items: list[dict[str, Any]], query: ListQuery) -> dict[str, Any]:
    """A Compute Engine aggregated list answer: one page of the ITEMS the filter keeps, under the scope
    each is in (`zones/Z`, `regions/R`), each scope's list named COLLECTION (`instances`)."""
    chunk, nxt = query.page(items)
    scoped: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for item in chunk:
        where = item.get("zone") or item.get("region") or ""
        scope = "/".join(where.rstrip("/").split("/")[-2:])
        scoped.setdefault(scope, {collection: []})[collection].append(item)
    out: dict[str, Any] = {"kind": kind, "id": path, "items": scoped, "selfLink": link(path)}
    if nxt:
        out["nextPageToken"] = nxt
    return out


class ComputeResources(Queued):
    def __init__(self, hosts: HostsLike, config: EmulatorConfig) -> None:
        self.compute_ops: dict[str, ComputeOperation] = {}
        self.policies: dict[str, compute_v1.ResourcePolicy] = {}
        self.templates: dict[str, compute_v1.InstanceTemplate] = {}
        self.instances: dict[str, InstanceRecord] = {}
        self.groups: dict[str, Group] = {}  # by key: the worker hosts of instances
        super().__init__(hosts, config)

    # ------------------------------------------------------------------ operations

    def _operation(self, scope: str, kind: str, target: str, target_id: int = 0) -> ComputeOperation:
        op = ComputeOperation(scope, kind, target, target_id)
        with self.lock:
            self.compute_ops[op.path] = op
        return op

    def _quick(self, op: ComputeOperation, change: Callable[[], None] | None = None) -> dict[str, Any]:
        """Answer OP now and finish it a moment later, after CHANGE (the way a policy or a template is made)."""

        def run() -> None:
            if self._sleep(self.config.delays.update):
                if change is not None:
                    with self.lock:
                        change()
                op.finish()

        self._spawn(run)
        return op.to_json()

    def _lookup(self, table: dict[str, T], path: str) -> T:
        """The record at PATH in TABLE, or Compute Engine's 404."""
        with self.lock:
            found = table.get(path)
        if found is None:
            raise not_found(path)
        return found

    def _find_op(self, scope: str, name: str) -> ComputeOperation:
        return self._lookup(self.compute_ops, f"{scope}/operations/{name}")

    def get_compute_operation(self, scope: str, name: str) -> dict[str, Any]:
        return self._find_op(scope, name).to_json()

    def wait_compute_operation(self, scope: str, name: str) -> dict[str, Any]:
        """The operation once it is DONE, or as it is after WAIT_SECONDS (the real service's `wait`)."""
        op = self._find_op(scope, name)
        op.event.wait(WAIT_SECONDS)
        return op.to_json()

    def list_compute_operations(self, scope: str, query: ListQuery) -> dict[str, Any]:
        with self.lock:
            ops = [o.to_json() for p, o in sorted(self.compute_ops.items()) if p.startswith(scope + "/operations/")]
        return listing("compute#operationList", f"{scope}/operations", ops, query)

    def delete_compute_operation(self, scope: str, name: str) -> None:
        op = self._find_op(scope, name)
        with self.lock:
            self.compute_ops.pop(op.path, None)

    # ------------------------------------------------------------------ workload policies

    def insert_policy(self, project: str, region: str, policy: compute_v1.ResourcePolicy) -> dict[str, Any]:
        check_region(region)
        check_name(policy.name)
        if "workload_policy" not in policy:
            raise compute_error(
                400,
                "The tpurun emulator makes workload policies only (resourcePolicy.workloadPolicy); other resource "
                "policies are not emulated.",
                "invalid",
            )
        wp = policy.workload_policy
        if wp.accelerator_topology:
            if not re.fullmatch(r"\d+x\d+(x\d+)?", wp.accelerator_topology):
                raise invalid_field(
                    "resource.workloadPolicy.acceleratorTopology", wp.accelerator_topology, "Invalid topology."
                )
            if wp.type_ != "HIGH_THROUGHPUT":
                raise invalid_field(
                    "resource.workloadPolicy.type",
                    wp.type_,
                    "An accelerator topology needs a HIGH_THROUGHPUT workload policy.",
                )
            if wp.max_topology_distance:
                raise compute_error(400, "acceleratorTopology and maxTopologyDistance cannot both be set.", "invalid")
        scope = f"projects/{project}/regions/{region}"
        stored = compute_v1.ResourcePolicy(policy, region=link(scope), status="READY")
        return self._insert_at_once(
            self.policies, scope, f"{scope}/resourcePolicies/{policy.name}", stored, "resourcePolicy"
        )

    def get_policy(self, path: str) -> dict[str, Any]:
        return to_json(self._lookup(self.policies, path))

    def list_policies(self, project: str, region: str, query: ListQuery) -> dict[str, Any]:
        scope = f"projects/{project}/regions/{region}/resourcePolicies"
        with self.lock:
            items = [to_json(p) for k, p in sorted(self.policies.items()) if k.startswith(scope + "/")]
        return listing("compute#resourcePolicyList", scope, items, query)

    def delete_policy(self, path: str) -> dict[str, Any]:
        return self._delete_unused(self.policies, path, "resource_policy", self._policy_user)

    def _insert_at_once(self, table: dict[str, Any], scope: str, path: str, stored: Any, kind: str) -> dict[str, Any]:
        """STORED, a KIND the API makes at once (a policy, a template), kept at PATH; refused where PATH is taken."""
        with self.lock:
            if path in table:
                raise already_exists(path)
            stamp(stored, kind, path)
            op = self._operation(scope, "insert", path, stored.id)
            table[path] = stored
        return self._quick(op)

    def _delete_unused(
        self, table: dict[str, Any], path: str, kind: str, user_of: Callable[[str], str]
    ) -> dict[str, Any]:
        """Delete a policy or template, unless a MIG uses it (USER_OF names the MIG)."""
        found = self._lookup(table, path)
        with self.lock:
            user = user_of(path)
            if user:
                raise in_use(kind, path, user)
            op = self._operation(path.rsplit("/", 2)[0], "delete", path, found.id)
            del table[path]
        return self._quick(op)

    def _policy_user(self, path: str) -> str:
        """The MIG that uses the policy at PATH ('' when none does)."""
        return ""

    # ------------------------------------------------------------------ instance templates

    def insert_template(self, project: str, region: str, template: compute_v1.InstanceTemplate) -> dict[str, Any]:
        """A global template (REGION '') or a regional one."""
        if region:
            check_region(region)
        check_name(template.name)
        self._check_properties(template.properties, "resource.properties")
        scope = f"projects/{project}/regions/{region}" if region else f"projects/{project}/global"
        stored = compute_v1.InstanceTemplate(template)
        if region:
            stored.region = link(scope)
        return self._insert_at_once(
            self.templates, scope, f"{scope}/instanceTemplates/{template.name}", stored, "instanceTemplate"
        )

    @staticmethod
    def _check_properties(props: compute_v1.InstanceProperties | compute_v1.Instance, where: str) -> Topology:
        """What every TPU VM needs: a TPU machine type this emulator has, and no live migration."""
        machine = path_of(props.machine_type).rsplit("/", 1)[-1]
        try:
            topo = vm_topology(machine)
        except UsageError as e:
            raise invalid_field(f"{where}.machineType", props.machine_type, f"The tpurun emulator: {e.message}") from e
        if props.scheduling.on_host_maintenance != "TERMINATE":
            given = props.scheduling.on_host_maintenance
            raise invalid_field(
                f"{where}.scheduling.onHostMaintenance",
                given or "MIGRATE",
                "TPU VMs cannot live-migrate: set onHostMaintenance to TERMINATE.",
            )
        sched = props.scheduling
        if sched.provisioning_model == "FLEX_START":
            if "max_run_duration" not in sched and "termination_time" not in sched:
                raise invalid_field(
                    f"{where}.scheduling.maxRunDuration",
                    "",
                    "A FLEX_START VM needs a run duration or a termination time.",
                )
            if sched.instance_termination_action != "DELETE":
                raise invalid_field(
                    f"{where}.scheduling.instanceTerminationAction",
                    sched.instance_termination_action,
                    "A FLEX_START VM is deleted at the end of its run: set instanceTerminationAction to DELETE.",
                )
        return topo

    def _template(self, path: str) -> compute_v1.InstanceTemplate:
        return self._lookup(self.templates, path)

    def get_template(self, path: str) -> dict[str, Any]:
        return to_json(self._template(path))

    def list_templates(self, scope: str, query: ListQuery) -> dict[str, Any]:
        with self.lock:
            items = [
                to_json(t) for k, t in sorted(self.templates.items()) if k.startswith(scope + "/instanceTemplates/")
            ]
        return listing("compute#instanceTemplateList", f"{scope}/instanceTemplates", items, query)

    def delete_template(self, path: str) -> dict[str, Any]:
        return self._delete_unused(self.templates, path, "instance_template", self._template_user)

    def _template_user(self, path: str) -> str:
        """The MIG that uses the template at PATH ('' when none does)."""
        return ""

    # ------------------------------------------------------------------ instances

    def insert_instance(
        self, project: str, zone: str, instance: compute_v1.Instance, source_template: str = ""
    ) -> dict[str, Any]:
        check_zone(zone)
        if source_template:
            props = self._template(full_path(source_template, project, "global/instanceTemplates")).properties
            base = compute_v1.Instance.from_json(
                compute_v1.InstanceProperties.to_json(props), ignore_unknown_fields=True
            )
            instance = _merge(base, instance)
        check_name(instance.name)
        topo = self._check_properties(instance, "resource")
        path = f"projects/{project}/zones/{zone}/instances/{instance.name}"
        with self.lock:
            if path in self.instances:
                raise already_exists(path)
            group = Group(path, project, zone, topo, vm_machine(instance), members=[path])
            rec = InstanceRecord(self._new_instance(instance, project, zone, path, group.machine_type), path, group, 0)
            self.instances[path] = rec
            self.groups[path] = group
            op = self._operation(f"projects/{project}/zones/{zone}", "insert", path, rec.inst.id)
        self._spawn(self._run_insert, rec, op)
        return op.to_json()

    def _new_instance(
        self,
        instance: compute_v1.Instance,
        project: str,
        zone: str,
        path: str,
        machine: str,
        extra: dict[str, str] | None = None,
    ) -> compute_v1.Instance:
        """What the API keeps of a VM it is making: ids, links, PROVISIONING, and its metadata with a fingerprint
        (EXTRA: what a MIG adds to its VMs' metadata)."""
        inst = compute_v1.Instance(instance)
        stamp(inst, "instance", path)
        inst.zone = link(f"projects/{project}/zones/{zone}")
        inst.machine_type = link(f"projects/{project}/zones/{zone}/machineTypes/{machine}")
        inst.status = "PROVISIONING"
        items = [i for i in inst.metadata.items if i.key not in (extra or {})]
        items += [compute_v1.Items(key=k, value=v) for k, v in (extra or {}).items()]
        inst.metadata = compute_v1.Metadata(kind="compute#metadata", items=items, fingerprint=fingerprint())
        inst.label_fingerprint = fingerprint()
        inst.fingerprint = fingerprint()
        for disk in inst.disks:
            disk.kind = "compute#attachedDisk"
            if disk.boot:
                disk.source = link(f"projects/{project}/zones/{zone}/disks/{inst.name}")
        return inst

    def _run_insert(self, rec: InstanceRecord, op: ComputeOperation) -> None:
        """Make a standalone VM: wait for capacity (a flex-start VM up to its requestValidForDuration), boot it."""
        if not self._sleep(self.config.delays.create):
            return
        group = rec.group
        flex = rec.inst.scheduling.provisioning_model == "FLEX_START"
        deadline = time.time() + (rec.inst.params.request_valid_for_duration.seconds if flex else 0)
        while True:
            with self.lock:
                if self.instances.get(rec.path) is not rec:
                    op.finish(Failure("RESOURCE_NOT_READY", f"{rec.path} was deleted while it was being made", 400))
                    return
                if self._fits(group.zone, group.topo):
                    self._hold(group)
                    break
            if time.time() >= deadline or not self._sleep(self.config.delays.queue):
                with self.lock:
                    self._forget_group(group)
                op.finish(no_resources(group.zone, group.project))
                return
        failure = self._boot_group(group)
        op.finish(failure)

    def _hold(self, group: Group) -> None:
        """GROUP's VMs take their capacity (caller holds self.lock)."""
        for path in group.members:
            rec = self.instances.get(path)
            if rec is not None:
                rec.inst.status = "STAGING"

    def _boot_group(self, group: Group) -> Failure | None:
        """Boot the worker hosts of GROUP's instances and mark them RUNNING; on failure forget them."""
        with group.lock:
            with self.lock:
                if not group.slot:
                    group.slot = self._free_slot(len(group.members))
                recs = [self.instances[p] for p in group.members]
            vms = ComputeVms(
                names=tuple(r.inst.name for r in recs),
                ids=tuple(str(r.inst.id) for r in recs),
                machine_type=group.machine_type,
                metadata=lambda i: self._instance_metadata(group.members[i]),
            )
            try:
                workers = self.hosts.boot_node(
                    group.key,
                    group.slot,
                    num_workers=len(recs),
                    generation=group.topo.generation,
                    accelerator_type=group.topo.name,
                    get_metadata=dict,
                    project=group.project,
                    zone=group.zone,
                    vms=vms,
                    private=lambda i: not self._vm_is_public(group.members[i]),
                )
            except Exception as e:
                try:
                    self.hosts.shutdown_node(group.key, delete=True)
                except KeyError:
                    pass
                with self.lock:
                    self._forget_group(group)
                return Failure("INTERNAL_ERROR", f"Internal error creating {group.key}: {e}", 500)
            with self.lock:
                group.booted = group.ever_booted = True
                for rec, w in zip(recs, workers, strict=True):
                    _attach_network(rec.inst, w.address, group.project, region_of(group.zone))
                    rec.inst.status = "RUNNING"
                    rec.inst.last_start_timestamp = now_rfc3339()
        self._persist_pids()
        return None

    def _instance_metadata(self, path: str) -> dict[str, str]:
        with self.lock:
            rec = self.instances.get(path)
            return {i.key: i.value for i in rec.inst.metadata.items} if rec is not None else {}

    def _vm_is_public(self, path: str) -> bool:
        """Whether the VM at PATH has an external address: an access config on a network interface (none asked for,
        none given)."""
        with self.lock:
            rec = self.instances.get(path)
            return rec is not None and any(nic.access_configs for nic in rec.inst.network_interfaces)

    def _forget_group(self, group: Group) -> None:
        """GROUP's instances no longer exist (caller holds self.lock; its hosts are already down)."""
        for path in group.members:
            gone = self.instances.pop(path, None)
            if gone is not None:
                self._drop_maintenance(gone)
        self.groups.pop(group.key, None)
        group.booted = False

    def _record(self, path: str) -> InstanceRecord:
        return self._lookup(self.instances, path)

    def get_instance(self, path: str) -> dict[str, Any]:
        rec = self._record(path)
        with self.lock:
            return to_json(rec.inst)

    def list_instances(self, project: str, zone: str, query: ListQuery) -> dict[str, Any]:
        scope = f"projects/{project}/zones/{zone}/instances"
        with self.lock:
            items = [to_json(r.inst) for k, r in sorted(self.instances.items()) if k.startswith(scope + "/")]
        return listing("compute#instanceList", scope, items, query)

    def aggregated_instances(self, project: str, query: ListQuery) -> dict[str, Any]:
        """Every zone's instances (instances.aggregatedList)."""
        with self.lock:
            items = [to_json(r.inst) for k, r in sorted(self.instances.items()) if k.startswith(f"projects/{project}/")]
        path = f"projects/{project}/aggregated/instances"
        return aggregated("compute#instanceAggregatedList", path, "instances", items, query)

    def delete_instance(self, path: str) -> dict[str, Any]:
        rec = self._record(path)
        if rec.mig:
            raise in_use("instance", path, rec.mig)
        with self.lock:
            op = self._operation(path.rsplit("/instances/", 1)[0], "delete", path, rec.inst.id)
            rec.inst.status = "STOPPING"

        def run() -> None:
            if not self._sleep(self.config.delays.delete):
                return
            self._take_down(rec.group, [path])
            op.finish()

        self._spawn(run)
        return op.to_json()

    def _take_down(self, group: Group, paths: list[str] | None = None) -> None:
        """Shut down for good the worker hosts of GROUP's instances at PATHS (all but those its MIG abandoned,
        by default) and forget those instances; the hosts go with the last instance."""
        with group.lock:
            with self.lock:
                going = [p for p in group.members if p not in group.left] if paths is None else paths
                staying = [p for p in group.members if p in self.instances and p not in going]
            if not staying and (group.booted or group.ever_booted):
                try:
                    self.hosts.shutdown_node(group.key, delete=True)
                except KeyError:
                    pass
            elif group.booted:
                for path in going:
                    try:
                        self.hosts.kill_worker(group.key, group.members.index(path))
                    except KeyError:
                        pass
            with self.lock:
                if staying:
                    for path in going:
                        gone = self.instances.pop(path, None)
                        if gone is not None:
                            self._drop_maintenance(gone)
                else:
                    self._forget_group(group)
        self._persist_pids()

    def set_metadata(self, path: str, metadata: compute_v1.Metadata) -> dict[str, Any]:
        rec = self._record(path)
        with self.lock:
            if metadata.fingerprint != rec.inst.metadata.fingerprint:
                raise compute_error(
                    412, "Supplied fingerprint does not match current metadata fingerprint.", "conditionNotMet"
                )
            md = {i.key: i.value for i in metadata.items}
            self._validate_metadata(md)
            rec.inst.metadata = compute_v1.Metadata(
                kind="compute#metadata",
                items=[compute_v1.Items(key=k, value=v) for k, v in md.items()],
                fingerprint=fingerprint(),
            )
            op = self._operation(path.rsplit("/instances/", 1)[0], "setMetadata", path, rec.inst.id)
        if rec.group.booted:
            self.hosts.refresh_ssh_keys(rec.group.key)
        return self._quick(op)

    def instance_guest_attributes(self, path: str, query_path: str, variable_key: str) -> dict[str, Any]:
        rec = self._record(path)
        attrs: dict[tuple[str, str], str] = {}
        if rec.group.booted:
            attrs = self.hosts.guest_attributes(rec.group.key)[rec.index]
        out: dict[str, Any] = {"kind": "compute#guestAttributes", "selfLink": link(path + "/getGuestAttributes")}
        if variable_key:
            namespace, _, key = variable_key.partition("/")
            if (namespace, key) not in attrs:
                raise not_found(variable_key)
            return {**out, "variableKey": variable_key, "variableValue": attrs[(namespace, key)]}
        namespace, _, key = query_path.partition("/")
        items = [
            {"namespace": ns, "key": k, "value": v}
            for (ns, k), v in sorted(attrs.items())
            if (not namespace or ns == namespace) and (not key or k == key)
        ]
        if not items:
            raise compute_error(
                404, f"The resource '{query_path}' of type 'Guest Attribute' was not found.", "notFound"
            )
        return {**out, "queryPath": query_path, "queryValue": {"items": items}}

    # ------------------------------------------------------------------ the emulator's own bookkeeping

    def _compute_usage(self, zone: str, generation: str, unit: str) -> int:
        used = 0
        for rec in self.instances.values():
            topo = vm_topology(rec.group.machine_type)
            if rec.group.zone == zone and topo.generation == generation and rec.inst.status in _HOLDING:
                used += topo.chips if unit == "chips" else 1
        return used

    def _compute_slots(self) -> set[int]:
        return {s for g in self.groups.values() if g.slot for s in range(g.slot, g.slot + slots_for(len(g.members)))}

    def _compute_booted(self) -> list[str]:
        return [g.key for g in self.groups.values() if g.booted]

    def project_number(self, project: str) -> str:
        return str(stable_int("project:" + project, 12))


def vm_machine(instance: compute_v1.Instance | compute_v1.InstanceProperties) -> str:
    return path_of(instance.machine_type).rsplit("/", 1)[-1]


def _merge(base: compute_v1.Instance, given: compute_v1.Instance) -> compute_v1.Instance:
    """An instance from a template: the template's properties with what the request sets on top."""
    out = compute_v1.Instance(base)
    for name in compute_v1.Instance.meta.fields:
        if name in given:
            setattr(out, name, getattr(given, name))
    return out


def _attach_network(inst: compute_v1.Instance, address: str, project: str, region: str) -> None:
    """The VM's interface gets its address (internal, and external when the request asked for one: here the
    same loopback address, since the emulated VMs live on this machine)."""
    if not inst.network_interfaces:
        inst.network_interfaces = [compute_v1.NetworkInterface()]
    nic = inst.network_interfaces[0]
    nic.kind = "compute#networkInterface"
    nic.name = "nic0"
    nic.network_i_p = address
    nic.network = link(f"projects/{project}/global/networks/" + (path_of(nic.network).rsplit("/", 1)[-1] or "default"))
    nic.subnetwork = link(f"projects/{project}/regions/{region}/subnetworks/default")
    for ac in nic.access_configs:
        ac.kind = "compute#accessConfig"
        ac.nat_i_p = address
        ac.type_ = "ONE_TO_ONE_NAT"
