"""Compute Engine in the emulator, second part: managed instance groups (zonal and regional) that make a TPU
slice's VMs from an instance template, shaped by a workload policy; resize requests; and the loop that makes a
group's VMs once capacity is free.

What the real service does and this one follows (sources in docs/emulator.md): a group's insert operation is
DONE once the group exists, before its VMs; the group then makes them (all at once in BULK mode, waiting while
the zone lacks capacity, with the reason in `status.bulkInstanceOperation.lastProgressCheck` and each managed
instance's `lastAttempt`); it is stable once every VM runs. Deleting a group deletes its VMs first. A group
with a workload policy of an accelerator topology holds exactly the VMs of that slice.
"""

from __future__ import annotations

import random
import string
import time
from typing import Any

from google.cloud import compute_v1

from tpurun.emulator.compute import (
    ComputeResources,
    ListQuery,
    aggregated,
    check_name,
    check_region,
    check_zone,
    fingerprint,
    listing,
    region_of,
    vm_machine,
)
from tpurun.emulator.compute_model import (
    ComputeOperation,
    Group,
    InstanceRecord,
    MigRecord,
    ResizeRecord,
    already_exists,
    compute_error,
    full_path,
    invalid_field,
    link,
    no_resources,
    path_of,
    stamp,
)
from tpurun.emulator.model import ApiError, EmulatorConfig, HostsLike, now_rfc3339, to_json
from tpurun.errors import UsageError
from tpurun.topology import from_machine_type, vm_topology


class ManagedGroups(ComputeResources):
    def __init__(self, hosts: HostsLike, config: EmulatorConfig) -> None:
        self.migs: dict[str, MigRecord] = {}
        self.resize_requests: dict[str, ResizeRecord] = {}
        super().__init__(hosts, config)
        self._every_tick("migs", self._reconcile_once)

    # ------------------------------------------------------------------ create

    def insert_mig(self, scope: str, igm: compute_v1.InstanceGroupManager) -> dict[str, Any]:
        """A MIG in SCOPE ('projects/p/zones/z' or 'projects/p/regions/r')."""
        _, project, kind, where = scope.split("/")
        if kind == "zones":
            check_zone(where)
        else:
            check_region(where)
        check_name(igm.name)
        if not igm.instance_template:
            raise invalid_field("resource.instanceTemplate", "", "An instance template must be specified.")
        template_path = full_path(igm.instance_template, project, "global/instanceTemplates")
        template = self._template(template_path)
        zone = where if kind == "zones" else self._regional_zone(where, igm)
        region = region_of(zone)
        if "/regions/" in template_path and template_path.split("/")[3] != region:
            raise invalid_field(
                "resource.instanceTemplate", igm.instance_template, f"A regional template must be in region {region}."
            )
        policy_path = self._mig_policy(project, region, igm)
        machine = vm_machine(template.properties)
        topo = vm_topology(machine)
        if policy_path and self.policies[policy_path].workload_policy.accelerator_topology:
            shape = self.policies[policy_path].workload_policy.accelerator_topology
            try:
                topo = from_machine_type(machine, shape)
            except UsageError as e:
                raise invalid_field("resource.resourcePolicies.workloadPolicy", policy_path, e.message) from e
            if igm.target_size not in (0, topo.hosts):
                raise invalid_field(
                    "resource.targetSize",
                    igm.target_size,
                    f"The workload policy's accelerator topology {shape} takes {topo.hosts} VMs of {machine}.",
                )
        bulk = igm.target_size_policy.mode == "BULK"
        if bulk and template.properties.scheduling.provisioning_model not in (
            "FLEX_START",
            "RESERVATION_BOUND",
        ):
            raise compute_error(
                400,
                "A managed instance group in BULK mode needs an instance template whose provisioning model is "
                "FLEX_START or RESERVATION_BOUND.",
                "invalid",
            )
        path = f"{scope}/instanceGroupManagers/{igm.name}"
        with self.lock:
            if path in self.migs:
                raise already_exists(path)
            stored = self._new_mig(igm, scope, path, template_path)
            group = Group(path, project, zone, topo, machine)
            rec = MigRecord(stored, path, scope, zone, template, policy_path, group, bulk)
            self._grow(rec, igm.target_size)
            self.migs[path] = rec
            op = self._operation(scope, "insert", path, stored.id)
        return self._quick(op)

    @staticmethod
    def _regional_zone(region: str, igm: compute_v1.InstanceGroupManager) -> str:
        """The one zone a regional TPU MIG's VMs go to: the first its distribution policy names."""
        zones = [path_of(z.zone).rsplit("/", 1)[-1] for z in igm.distribution_policy.zones]
        shape = igm.distribution_policy.target_shape
        if igm.target_size_policy.mode == "BULK" and shape and shape != "ANY_SINGLE_ZONE":
            raise invalid_field(
                "resource.distributionPolicy.targetShape",
                shape,
                "A regional MIG in BULK mode takes the ANY_SINGLE_ZONE target shape only.",
            )
        zone = zones[0] if zones else f"{region}-a"
        for z in zones:
            check_zone(z)
            if region_of(z) != region:
                raise invalid_field("resource.distributionPolicy.zones", z, f"The zone is not in region {region}.")
        return zone

    def _mig_policy(self, project: str, region: str, igm: compute_v1.InstanceGroupManager) -> str:
        ref = igm.resource_policies.workload_policy
        if not ref:
            return ""
        policy_path = full_path(ref, project, f"regions/{region}/resourcePolicies")
        with self.lock:
            if policy_path not in self.policies:
                raise invalid_field(
                    "resource.resourcePolicies.workloadPolicy", ref, "The resource policy does not exist."
                )
        policy_region = policy_path.split("/")[3]
        if policy_region != region:
            raise invalid_field(
                "resource.resourcePolicies.workloadPolicy",
                ref,
                f"The workload policy is in region {policy_region}; the group's VMs are in region {region}.",
            )
        return policy_path

    def _new_mig(
        self, igm: compute_v1.InstanceGroupManager, scope: str, path: str, template_path: str
    ) -> compute_v1.InstanceGroupManager:
        stored = compute_v1.InstanceGroupManager(igm)
        stamp(stored, "instanceGroupManager", path)
        stored.fingerprint = fingerprint()
        stored.instance_template = link(template_path)
        stored.base_instance_name = igm.base_instance_name or igm.name
        stored.instance_group = link(f"{scope}/instanceGroups/{igm.name}")
        stored.target_size = igm.target_size
        if not stored.list_managed_instances_results:
            stored.list_managed_instances_results = "PAGELESS"
        if "/zones/" in scope:
            stored.zone = link(scope)
        else:
            stored.region = link(scope)
        if "resource_policies" in igm and igm.resource_policies.workload_policy:
            stored.resource_policies.workload_policy = link(path_of(igm.resource_policies.workload_policy))
        return stored

    def _grow(self, rec: MigRecord, size: int) -> None:
        """REC's group aims at SIZE VMs: names for the missing ones (its base name and 4 random characters)."""
        base = rec.igm.base_instance_name
        while len(rec.group.members) < size:
            suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=4))
            rec.group.members.append(f"projects/{rec.group.project}/zones/{rec.zone}/instances/{base}-{suffix}")
        rec.igm.target_size = size

    # ------------------------------------------------------------------ making the VMs

    def _reconcile_once(self) -> None:
        """Start making the VMs of every group that lacks them, when its zone has the capacity for all of them."""
        now = time.time()
        with self.lock:
            for rec in self.migs.values():
                group = rec.group
                if rec.deleting or not group.members or group.booted or group.members[0] in self.instances:
                    continue
                if now - rec.created < self.config.delays.create:
                    continue
                topo = vm_topology(group.machine_type)
                if not self._fits(group.zone, topo, [topo] * (len(group.members) - 1)):
                    rec.last_failure = no_resources(group.zone, group.project)
                    continue
                for i, path in enumerate(group.members):
                    self.instances[path] = InstanceRecord(self._member(rec, path), path, group, i, rec.path)
                self._hold(group)
                self.groups[group.key] = group
                self._spawn(self._make_vms, rec)

    def _member(self, rec: MigRecord, path: str) -> compute_v1.Instance:
        props = rec.template.properties
        inst = compute_v1.Instance.from_json(compute_v1.InstanceProperties.to_json(props), ignore_unknown_fields=True)
        inst.name = path.rsplit("/", 1)[-1]
        number = self.project_number(rec.group.project)
        extra = {
            "created-by": f"projects/{number}/{rec.path.split('/', 2)[2]}",
            "instance-template": f"projects/{number}/{path_of(rec.igm.instance_template).split('/', 2)[2]}",
        }
        return self._new_instance(inst, rec.group.project, rec.zone, path, rec.group.machine_type, extra)

    def _make_vms(self, rec: MigRecord) -> None:
        failure = self._boot_group(rec.group)
        with self.lock:
            rec.last_failure = failure
            if failure is None:
                for rr in self.resize_requests.values():
                    if rr.mig == rec.path and rr.rr.state == "ACCEPTED":
                        rr.rr.state = "SUCCEEDED"

    # ------------------------------------------------------------------ read

    def _mig(self, path: str) -> MigRecord:
        return self._lookup(self.migs, path)

    def get_mig(self, path: str) -> dict[str, Any]:
        rec = self._mig(path)
        with self.lock:
            return self._mig_json(rec)

    def _mig_json(self, rec: MigRecord) -> dict[str, Any]:
        """The group as the API shows it: what it is doing to its VMs, their states, whether it is stable."""
        igm = compute_v1.InstanceGroupManager(rec.igm)
        made = [self.instances[p] for p in self._managed(rec) if p in self.instances]
        running = sum(1 for r in made if r.inst.status == "RUNNING")
        idle = sum(1 for r in made if not _acted_on(r))  # a VM whose host is repaired is no action of the group's
        creating = len(self._managed(rec)) - idle if not rec.deleting else 0
        actions = {name: 0 for name in compute_v1.InstanceGroupManagerActionsSummary.meta.fields}
        actions["none"], actions["creating"] = idle, creating
        if rec.deleting:
            actions["deleting"] = len(made)
        igm.current_actions = compute_v1.InstanceGroupManagerActionsSummary(actions)
        stable = creating == 0 and not rec.deleting
        status = compute_v1.InstanceGroupManagerStatus(
            is_stable=stable,
            version_target={"is_reached": stable},
            current_instance_statuses=_counts(made),
        )
        if rec.bulk:
            bulk = compute_v1.InstanceGroupManagerStatusBulkInstanceOperation(in_progress=creating > 0)
            if rec.last_failure is not None and creating:
                bulk.last_progress_check = compute_v1.InstanceGroupManagerStatusBulkInstanceOperationLastProgressCheck(
                    timestamp=now_rfc3339(), error=rec.last_failure.errors()
                )
            status.bulk_instance_operation = bulk
        if rec.policy and stable and running:
            shape = (
                self.policies[rec.policy].workload_policy.accelerator_topology if rec.policy in self.policies else ""
            )
            if shape:
                status.applied_accelerator_topologies = [
                    compute_v1.InstanceGroupManagerStatusAcceleratorTopology(accelerator_topology=shape, state="ACTIVE")
                ]
        igm.status = status
        return to_json(igm)

    def list_migs(self, scope: str, query: ListQuery) -> dict[str, Any]:
        with self.lock:
            items = [
                self._mig_json(r)
                for k, r in sorted(self.migs.items())
                if k.startswith(scope + "/instanceGroupManagers/")
            ]
        return listing("compute#instanceGroupManagerList", f"{scope}/instanceGroupManagers", items, query)

    def aggregated_migs(self, project: str, query: ListQuery) -> dict[str, Any]:
        """Every zone's and region's groups (instanceGroupManagers.aggregatedList)."""
        with self.lock:
            items = [self._mig_json(r) for k, r in sorted(self.migs.items()) if k.startswith(f"projects/{project}/")]
        path = f"projects/{project}/aggregated/instanceGroupManagers"
        return aggregated("compute#instanceGroupManagerAggregatedList", path, "instanceGroupManagers", items, query)

    def list_managed_instances(self, path: str, query: ListQuery) -> dict[str, Any]:
        """Every VM the group manages or is making, in the order it made their names."""
        rec = self._mig(path)
        with self.lock:
            items = []
            for member in self._managed(rec):
                made = self.instances.get(member)
                mi: dict[str, Any] = {
                    "name": member.rsplit("/", 1)[-1],
                    "currentAction": "DELETING" if rec.deleting else "CREATING" if made is None else "NONE",
                    "version": {"instanceTemplate": rec.igm.instance_template},
                    "targetStatus": "RUNNING",
                }
                if made is not None:
                    mi["instance"] = made.inst.self_link
                    mi["id"] = str(made.inst.id)
                    mi["instanceStatus"] = made.inst.status
                    if _acted_on(made) and not rec.deleting:
                        mi["currentAction"] = "CREATING"
                elif rec.last_failure is not None:
                    mi["lastAttempt"] = {"errors": rec.last_failure.errors()}
                items.append(mi)
        chunk, nxt = query.page(items)
        return {k: v for k, v in (("managedInstances", chunk), ("nextPageToken", nxt)) if v}

    @staticmethod
    def _managed(rec: MigRecord) -> list[str]:
        """The paths of the VMs REC manages (made or to be made): its members, less those it abandoned."""
        return [p for p in rec.group.members if p not in rec.group.left]

    # ------------------------------------------------------------------ change

    def abandon_instances(self, path: str, urls: list[str]) -> dict[str, Any]:
        """The VMs at URLS leave the group and live on as VMs of their own; its target size drops by as many."""
        rec = self._mig(path)
        with self.lock:
            if rec.deleting or rec.emptying:
                raise compute_error(400, f"The resource '{path}' is being changed", "resourceNotReady")
            going = [full_path(u, rec.group.project, f"zones/{rec.zone}/instances") for u in urls]
            if not going:
                raise invalid_field("instances", "", "At least one instance must be specified.")
            for vm in going:
                if vm not in self._managed(rec) or vm not in self.instances:
                    raise compute_error(
                        400, f"The instance '{vm}' is not a member of the instance group '{path}'.", "invalid"
                    )
            for vm in going:
                rec.group.left.add(vm)
                self.instances[vm].mig = ""
            rec.igm.target_size -= len(going)
            op = self._operation(rec.scope, "compute.instanceGroupManagers.abandonInstances", path, rec.igm.id)
        return self._quick(op)

    def resize_mig(self, path: str, size: int) -> dict[str, Any]:
        """A slice's VMs come and go together: to 0 (delete them) or from 0 to its size."""
        rec = self._mig(path)
        with self.lock:
            current = rec.igm.target_size
            if rec.group.left:
                raise compute_error(400, "The tpurun emulator does not resize a group that abandoned VMs.", "invalid")
            if size < 0:
                raise invalid_field("size", size, "Must be at least 0.")
            full = rec.group.topo.hosts if rec.policy else None
            if size not in (0, current) and (current != 0 or (full is not None and size != full)):
                raise compute_error(
                    400,
                    f"The tpurun emulator resizes a TPU group only to 0 or from 0 to its full size"
                    f"{f' ({full} VMs)' if full else ''}; it has {current}.",
                    "invalid",
                )
            op = self._operation(rec.scope, "compute.instanceGroupManagers.resize", path, rec.igm.id)
            grow = size > current
            if grow:
                self._grow(rec, size)
        if grow:
            return self._quick(op)
        if size == current:
            return self._quick(op)
        return self._empty(rec, op)

    def _empty(self, rec: MigRecord, op: ComputeOperation) -> dict[str, Any]:
        """Answer OP now; in the background, delete REC's VMs and bring its target to 0, then finish OP."""

        rec.emptying = True

        def run() -> None:
            self._take_down(rec.group)
            with self.lock:
                rec.group.members.clear()
                rec.igm.target_size = 0
                rec.emptying = False
            op.finish()

        self._spawn(run)
        return op.to_json()

    def delete_mig(self, path: str) -> dict[str, Any]:
        """Deletes the group's VMs, then the group (the operation ends with both)."""
        rec = self._mig(path)
        with self.lock:
            if rec.deleting:
                raise compute_error(400, f"The resource '{path}' is already being deleted", "resourceNotReady")
            rec.deleting = True
            op = self._operation(rec.scope, "delete", path, rec.igm.id)

        def run() -> None:
            if not self._sleep(self.config.delays.delete):
                return
            self._take_down(rec.group)
            with self.lock:
                self.migs.pop(path, None)
                for key in [k for k, r in self.resize_requests.items() if r.mig == path]:
                    del self.resize_requests[key]
            op.finish()

        self._spawn(run)
        return op.to_json()

    def _policy_user(self, path: str) -> str:
        return next((m.path for m in self.migs.values() if m.policy == path), "")

    def _template_user(self, path: str) -> str:
        return next((m.path for m in self.migs.values() if path_of(m.igm.instance_template) == path), "")

    # ------------------------------------------------------------------ resize requests

    def insert_resize_request(self, mig_path: str, rr: compute_v1.InstanceGroupManagerResizeRequest) -> dict[str, Any]:
        """Adds RR's VMs to the group's target at once; they are made together when capacity allows (ACCEPTED,
        then SUCCEEDED). The emulator takes a request only for a group with no VMs, of the slice's size."""
        rec = self._mig(mig_path)
        check_name(rr.name)
        if not rr.resize_by:
            raise invalid_field("resource.resizeBy", rr.resize_by, "Must be greater than 0.")
        seconds = rr.requested_run_duration.seconds
        if "requested_run_duration" in rr and not 600 <= seconds <= 7 * 86400:
            raise invalid_field(
                "resource.requestedRunDuration", seconds, "The run duration must be between 10 minutes and 7 days."
            )
        path = f"{mig_path}/resizeRequests/{rr.name}"
        with self.lock:
            if path in self.resize_requests:
                raise already_exists(path)
            full = rec.group.topo.hosts if rec.policy else None
            if rec.igm.target_size or rec.group.left or (full is not None and rr.resize_by != full):
                raise compute_error(
                    400,
                    f"The tpurun emulator takes a resize request only for a TPU group with no VMs, for its full size"
                    f"{f' ({full} VMs)' if full else ''}.",
                    "invalid",
                )
            stored = compute_v1.InstanceGroupManagerResizeRequest(rr)
            stamp(stored, "instanceGroupManagerResizeRequest", path)
            stored.state = "ACCEPTED"
            stored.zone = link(rec.scope) if "/zones/" in rec.scope else ""
            self._grow(rec, rr.resize_by)
            self.resize_requests[path] = ResizeRecord(stored, path, mig_path)
            op = self._operation(rec.scope, "insert", path, stored.id)
        return self._quick(op)

    def _resize_request(self, path: str) -> ResizeRecord:
        return self._lookup(self.resize_requests, path)

    def get_resize_request(self, path: str) -> dict[str, Any]:
        rec = self._resize_request(path)
        with self.lock:
            return to_json(rec.rr)

    def list_resize_requests(self, mig_path: str, query: ListQuery) -> dict[str, Any]:
        self._mig(mig_path)
        with self.lock:
            items = [to_json(r.rr) for r in self.resize_requests.values() if r.mig == mig_path]
        return listing("compute#instanceGroupManagerResizeRequestList", f"{mig_path}/resizeRequests", items, query)

    def cancel_resize_request(self, path: str) -> dict[str, Any]:
        """An ACCEPTED request gives its VMs up: the group's target drops back to 0."""
        rec = self._resize_request(path)
        mig = self._mig(rec.mig)
        with self.lock:
            if rec.rr.state != "ACCEPTED":
                raise compute_error(
                    400,
                    f"The resize request is {rec.rr.state}; only an ACCEPTED one can be cancelled.",
                    "invalid",
                )
            rec.rr.state = "CANCELLED"
            op = self._operation(mig.scope, "cancel", path, rec.rr.id)
        return self._empty(mig, op)

    def delete_resize_request(self, path: str) -> dict[str, Any]:
        rec = self._resize_request(path)
        mig = self._mig(rec.mig)
        with self.lock:
            if rec.rr.state in ("ACCEPTED", "CREATING"):
                raise compute_error(
                    400, "An ACCEPTED resize request must be cancelled before it is deleted.", "invalid"
                )
            del self.resize_requests[path]
            op = self._operation(mig.scope, "delete", path, rec.rr.id)
        return self._quick(op)

    # ------------------------------------------------------------------ faults

    def preempt_instance(self, ref: str, *, force: bool = False) -> dict[str, Any]:
        """A spot (or any, with FORCE) VM is preempted: its worker dies and it is TERMINATED, as Compute
        Engine does to a spot VM whose termination action is STOP (a MIG does not remake it here)."""
        rec = self.find_instance(ref)
        self._check_spot(rec, force)
        self.hosts.kill_worker(rec.group.key, rec.index)
        with self.lock:
            rec.inst.status = "TERMINATED"
            rec.inst.last_stop_timestamp = now_rfc3339()
            self._drop_maintenance(rec)  # its waiting thread woken, not left asleep until the window
            rec.inst.resource_status.upcoming_maintenance = compute_v1.UpcomingMaintenance()
        self.log_event("preempt", rec.path)
        return self.get_instance(rec.path)

    @staticmethod
    def _check_spot(rec: InstanceRecord, force: bool) -> None:
        spot = rec.inst.scheduling.provisioning_model == "SPOT" or rec.inst.scheduling.preemptible
        if not spot and not force:
            raise ApiError(
                400, f"{rec.path} is not a spot VM, so Compute Engine would not preempt it; pass --force to preempt it anyway."
            )
        if rec.inst.status != "RUNNING":
            raise ApiError(400, f"{rec.path} is {rec.inst.status}, not RUNNING.")

    def find_instance(self, ref: str, zone: str | None = None) -> InstanceRecord:
        """An instance by path or bare name, in ZONE if given (admin convenience)."""
        with self.lock:
            hits = [
                r
                for p, r in self.instances.items()
                if ref in (p, p.rsplit("/", 1)[-1]) and zone in (None, r.group.zone)
            ]
        if len(hits) != 1:
            where = f" in zone {zone}" if zone else ""
            raise ApiError(404 if not hits else 400, f"no single instance named '{ref}'{where}")
        return hits[0]

    def by_worker_number(self, rec: MigRecord) -> list[InstanceRecord]:
        """The VMs REC manages in the order tpurun numbers a group's workers, w0 …: by name (a group names its
        VMs at random, so their order of making says nothing to anyone reading the API)."""
        with self.lock:
            made = [self.instances[p] for p in self._managed(rec) if p in self.instances]
        return sorted(made, key=lambda r: r.inst.name)

    def compute_status(self) -> dict[str, Any]:
        """What the admin status shows of Compute Engine (caller holds self.lock)."""
        return {
            "instances": [
                {
                    "name": p,
                    "status": r.inst.status,
                    "address": r.inst.network_interfaces[0].network_i_p if r.inst.network_interfaces else "",
                }
                for p, r in sorted(self.instances.items())
            ],
            "computeTpus": self._compute_tpus(),
            "instanceGroupManagers": sorted(self.migs),
            "instanceTemplates": sorted(self.templates),
            "resourcePolicies": sorted(self.policies),
            "resizeRequests": sorted(self.resize_requests),
        }

    def _compute_tpus(self) -> list[dict[str, Any]]:
        """Every TPU Compute Engine holds, as the admin status shows it beside the nodes: each managed instance
        group and each VM no group manages, with its accelerator type, state and workers (caller holds self.lock)."""
        out = []
        for path, mig in sorted(self.migs.items()):
            members = self._managed(mig)
            made = [self.instances[p] for p in members if p in self.instances]
            out.append(_tpu_json(path, "group", mig.group.topo.name, _mig_state(mig, members, made), members, made))
        for path, rec in sorted(self.instances.items()):
            if not rec.mig:
                alone = rec.group.key == path  # else a VM a group abandoned: one VM of its slice
                accel = rec.group.topo.name if alone else vm_topology(rec.group.machine_type).name
                out.append(_tpu_json(path, "instance", accel, rec.inst.status, [path], [rec]))
        return out

    def compute_teardown(self) -> None:
        """Every VM down and every Compute Engine resource forgotten (reset and close)."""
        with self.lock:
            groups = list(self.groups.values())
        for group in groups:
            try:
                self._take_down(group, list(group.members))
            except Exception as e:
                self.log_event("internal-error", f"shutdown {group.key}: {e}")
        with self.lock:
            for table in (
                self.migs,
                self.resize_requests,
                self.templates,
                self.policies,
                self.compute_ops,
                self.instances,
            ):
                table.clear()


def _acted_on(vm: InstanceRecord) -> bool:
    """Whether the group is still at work on VM (making it, or making it run again). A VM under host
    maintenance is REPAIRING, which is Compute Engine's doing, not the group's: its action stays NONE and the
    group stable, as while it runs."""
    return vm.inst.status not in ("RUNNING", "REPAIRING")


def _counts(made: list[InstanceRecord]) -> compute_v1.InstanceGroupManagerStatusInstanceStatusSummary:
    """How many of a group's VMs are in each state (`status.currentInstanceStatuses`, shown for TPU groups)."""
    summary = compute_v1.InstanceGroupManagerStatusInstanceStatusSummary
    counts = {name: 0 for name in summary.meta.fields}
    states = {
        "PROVISIONING": "provisioning",
        "STAGING": "staging",
        "RUNNING": "running",
        "STOPPING": "stopping",
        "TERMINATED": "terminated",
        "STOPPED": "stopped",
        "SUSPENDED": "suspended",
        "REPAIRING": "repairing",
    }
    for r in made:
        key = states.get(r.inst.status)
        if key in counts:
            counts[key] += 1
    return summary(counts)


__all__ = ["ManagedGroups", "ComputeOperation"]


def _mig_state(mig: MigRecord, members: list[str], made: list[InstanceRecord]) -> str:
    """One word (or a count per state) for what a group and its VMs are doing."""
    if mig.deleting:
        return "DELETING"
    if mig.emptying:
        return "EMPTYING"
    if not members:
        return "EMPTY"
    if not made:
        return "WAITING_FOR_CAPACITY" if mig.last_failure is not None else "CREATING"
    states = [r.inst.status for r in made] + ["CREATING"] * (len(members) - len(made))
    if len(set(states)) == 1:
        return states[0]
    return ", ".join(f"{states.count(s)} {s}" for s in sorted(set(states)))


def _tpu_json(
    path: str, kind: str, accel: str, state: str, members: list[str], made: list[InstanceRecord]
) -> dict[str, Any]:
    address = {r.path: r.inst.network_interfaces[0].network_i_p if r.inst.network_interfaces else "" for r in made}
    return {
        "name": path,
        "kind": kind,
        "acceleratorType": accel,
        "state": state,
        "workers": len(members),
        "instances": [p.rsplit("/", 1)[-1] for p in members],
        "addresses": [address.get(p, "") for p in members],
    }
