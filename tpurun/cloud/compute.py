"""TPUs made by Compute Engine (google-cloud-compute, v1, REST): a single-host slice is one VM instance, a
multi-host slice is a zonal managed instance group (MIG) whose workload policy (a regional resource
policy of type HIGH_THROUGHPUT) gives the slice's shape, its VMs made from a regional instance
template. tpurun names all three after the TPU.

`Compute`, the backend, is made of two parts: its `calls` (compute_calls.py: the clients, their calls and
long-running operations) and its `groups` (compute_groups.py: the groups, workload policy and instance
template of a TPU, through those calls); it tells TPUs as views, reads their VMs, and makes, deletes and
remakes whole TPUs.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from google.cloud import compute_v1

from tpurun.cloud import keys
from tpurun.cloud.backend import Backend, CreateSpec, Deleted, GuestAttributes, Kind, MetadataChange, Progress, Request
from tpurun.cloud.client import Cloud, short_name
from tpurun.cloud.compute_calls import ComputeCalls
from tpurun.cloud.compute_groups import MADE_BY, ComputeGroups
from tpurun.cloud.multislice import slice_ids
from tpurun.cloud.services import compute_endpoint
from tpurun.cloud.views import PREEMPTED, READY, REPAIRING, STOPPED, Maintenance, NodeView, WorkerView, instant
from tpurun.errors import ApiError, UsageError
from tpurun.naming import parse_duration
from tpurun.topology import Topology, vm_topology
from tpurun.worker.watchdog_reports import ComputeTpu, WatchdogConfig

log = logging.getLogger(__name__)

IMAGE_PROJECT = "ubuntu-os-accelerator-images"
BOOT_DISK_GB = 100
FLEX_RUN = (600, 7 * 86400)  # the run durations Compute Engine takes for flex-start capacity, in seconds
# a slice's group of a TPU of several slices says which, in its description
SLICE_RE = re.compile(r"^made by tpurun for the TPU (?P<tpu>[a-z][a-z0-9-]*), slice (?P<index>\d+) of (?P<count>\d+)$")
# a VM status -> the state every command reads (views); a stopped spot VM was preempted
_STATES = {
    "RUNNING": READY,
    "PROVISIONING": "CREATING",
    "STAGING": "CREATING",
    "PENDING": "CREATING",
    "STOPPING": "STOPPING",
    "PENDING_STOP": "STOPPING",
    "SUSPENDING": "STOPPING",
    "SUSPENDED": STOPPED,
    "REPAIRING": REPAIRING,  # its host is being maintained or repaired: as Cloud TPU says of a node
    "DEPROVISIONING": "DELETING",
}


class Compute(Backend):
    kind = Kind.COMPUTE

    def __init__(self, cloud: Cloud) -> None:
        super().__init__(cloud)
        self.calls = ComputeCalls(cloud)
        self.groups = ComputeGroups(self.calls)
        self.project, self.zone, self.region = self.calls.project, self.calls.zone, self.calls.region

    # ------------------------------------------------------------------ reading

    def find(self, name: str) -> NodeView | None:
        # tpurun.cloud.routing.locate asks for these three by plain REST before this client is imported
        if self.zone == "-":
            return None
        group = self.groups.get_group(name)
        if group is not None:
            return self._group_view(group, self.groups.group_vms(name))
        vm = self.calls.find(
            f"get instance {name}",
            lambda: self.calls.instances.get(project=self.project, zone=self.zone, instance=name),
        )
        if vm is not None:
            return self._vm_view(vm) if _tpu_vm(vm) and not _member(vm) else None
        return self._slices_view(name)

    def _slices_view(self, name: str) -> NodeView | None:
        """The TPU NAME of several slices, one group each (NAME-0 …, each saying which slice it is); None
        where there is no such TPU."""
        first = self.groups.get_group(slice_ids(name, 1)[0])
        where = _slice_of(first) if first is not None else None
        if first is None or where is None or where[:2] != (name, 0):
            return None
        groups = [first] + [self.groups.get_group(g) for g in slice_ids(name, where[2])[1:]]
        parts = [v for g in groups if g is not None and (v := self._group_view(g, self.groups.group_vms(g.name)))]
        gone = [i for i, g in enumerate(groups) if g is None]
        if not parts:
            return None
        states = [p.state for p in parts]
        state = next((s for s in states if s != READY), "CREATING" if gone else READY)
        return NodeView.joined(name, parts, state, gone=gone)

    def all_tpus(self) -> list[NodeView]:
        if self.zone == "-":
            return self._every_zone()
        vms = self.calls.call(
            "list instances", lambda: list(self.calls.instances.list(project=self.project, zone=self.zone))
        )
        groups = self.calls.call(
            "list instance groups", lambda: list(self.calls.managers.list(project=self.project, zone=self.zone))
        )
        return self._tpus(self.zone, groups, vms)

    def _every_zone(self) -> list[NodeView]:
        """Every zone's TPUs, through the aggregated lists (one call per kind for the whole project)."""
        vms: dict[str, list[compute_v1.Instance]] = {}
        groups: dict[str, list[compute_v1.InstanceGroupManager]] = {}
        for scope, scoped in self.calls.call(
            "list instances of every zone", lambda: list(self.calls.instances.aggregated_list(project=self.project))
        ):
            vms.setdefault(scope.rsplit("/", 1)[-1], []).extend(scoped.instances)
        for scope, scoped in self.calls.call(
            "list instance groups of every zone",
            lambda: list(self.calls.managers.aggregated_list(project=self.project)),
        ):
            if scope.startswith("zones/"):  # tpurun's groups are zonal, as a slice's VMs are in one zone
                groups.setdefault(scope.rsplit("/", 1)[-1], []).extend(scoped.instance_group_managers)
        zones = sorted(set(vms) | set(groups))
        return [v for zone in zones for v in self._tpus(zone, groups.get(zone, []), vms.get(zone, []))]

    def _tpus(
        self, zone: str, groups: list[compute_v1.InstanceGroupManager], vms: list[compute_v1.Instance]
    ) -> list[NodeView]:
        """The TPUs among ZONE's GROUPS and VMS: each TPU group, and each TPU VM in no group."""
        views = [v for g in groups if (v := self._group_view(g, [vm for vm in vms if _member(vm) == g.name], zone))]
        return views + [self._vm_view(vm, zone) for vm in vms if _tpu_vm(vm) and not _member(vm)]

    def _group_view(
        self, group: compute_v1.InstanceGroupManager, vms: list[compute_v1.Instance], zone: str = ""
    ) -> NodeView | None:
        """The TPU a group is (None for a group of other VMs), in ZONE (the configured zone unless given)."""
        template = self.groups.template(group.instance_template)
        if template is None or not _is_tpu_type(template.properties.machine_type):
            return None
        topo = self.groups.group_topology(group, template.properties.machine_type)
        vms = sorted(vms, key=lambda vm: vm.name)
        states = [_vm_state(vm) for vm in vms]
        if len(vms) < group.target_size or not group.status.is_stable:
            waiting = group.status.bulk_instance_operation.in_progress and not vms
            state = "WAITING_FOR_RESOURCES" if waiting else "CREATING"
            # what has befallen a VM says more than what the group is at (it may be remaking it)
            state = next((s for s in states if s in (PREEMPTED, STOPPED, REPAIRING)), state)
        else:
            state = next((s for s in states if s != READY), READY)
        props = template.properties
        where = _slice_of(group)
        workers = [_worker(i, vm) for i, vm in enumerate(vms)]
        for w in workers:
            w.slice = where[1] if where else None
        return NodeView(
            name=group.name,
            backend=Kind.COMPUTE.value,
            zone=zone or self.zone,
            accelerator_type=topo.name,
            state=state,
            health="-",
            runtime_version=_image(props.disks),
            workers=workers,
            spot=props.scheduling.provisioning_model == "SPOT",
            preemptible=bool(props.scheduling.preemptible),
            created=instant(group.creation_timestamp),
            labels=dict(props.labels),
            metadata=_metadata(vms[0].metadata if vms else props.metadata),
            queued_resource="",
            id=str(group.id),
            slice_metadata=False,
            slice_of=where[:2] if where else None,
            maintenance=_maintenance(vms),
        )

    def _vm_view(self, vm: compute_v1.Instance, zone: str = "") -> NodeView:
        return NodeView(
            name=vm.name,
            backend=Kind.COMPUTE.value,
            zone=zone or self.zone,
            accelerator_type=vm_topology(short_name(vm.machine_type)).name,
            state=_vm_state(vm),
            health="-",
            runtime_version=_image(vm.disks),
            workers=[_worker(0, vm)],
            spot=vm.scheduling.provisioning_model == "SPOT",
            preemptible=bool(vm.scheduling.preemptible),
            created=instant(vm.creation_timestamp),
            labels=dict(vm.labels),
            metadata=_metadata(vm.metadata),
            queued_resource="",
            id=str(vm.id),
            slice_metadata=False,
            maintenance=_maintenance([vm]),
        )

    def start_maintenance(self, view: NodeView, progress: Progress) -> list[str]:
        """instances.performMaintenance on each VM with maintenance pending."""
        started = []
        for m in view.maintenance:
            if m.status != "PENDING" or not m.where:
                continue
            vm = m.where
            call = functools.partial(
                self.calls.instances.perform_maintenance_unary, project=self.project, zone=self.zone, instance=vm
            )
            self.calls.operate(f"start the maintenance of {vm}", call, 300, tpu=view.name)
            progress(f"{vm}: maintenance started")
            started.append(vm)
        return started

    def read_maintenance(self, views: list[NodeView]) -> None:
        """Nothing to read: a VM carries its maintenance (`resourceStatus.upcomingMaintenance`), read with it."""

    def guest_attributes(self, view: NodeView, query_path: str) -> GuestAttributes:
        def read(vm: str) -> dict[tuple[str, str], str]:
            got = self.calls.find(
                f"read guest attributes of {vm}",
                lambda: self.calls.instances.get_guest_attributes(
                    request=compute_v1.GetGuestAttributesInstanceRequest(
                        project=self.project, zone=view.zone or self.zone, instance=vm, query_path=query_path
                    )
                ),
            )
            return {(i.namespace, i.key): i.value for i in got.query_value.items} if got else {}

        with ThreadPoolExecutor(max_workers=min(16, max(1, len(view.workers)))) as pool:
            return list(pool.map(read, [w.vm for w in view.workers]))

    # ------------------------------------------------------------------ making

    def create(self, spec: CreateSpec, request: Request, progress: Progress) -> None:
        """One VM for a single-host slice; else a group per slice (NAME, or NAME-0 … for several slices), all
        of one instance template NAME and, for multi-host slices, one workload policy NAME."""
        topo, name = request.topology, spec.name
        props = self._properties(spec, request)
        if not topo.multi_host and spec.slices == 1:
            vm = compute_v1.Instance(name=name, description=MADE_BY + name, **_instance_fields(props, self.zone))
            state = "CREATING"
            if request.max_run:  # a flex-start VM's insert waits for capacity that long
                wait_for = request.valid_until or int(spec.timeout)
                vm.params = compute_v1.InstanceParams(request_valid_for_duration=compute_v1.Duration(seconds=wait_for))
                state = "WAITING_FOR_RESOURCES"
            self._insert_vm(vm, spec.timeout, progress, wait=spec.wait, state=state)
            return
        groups = slice_ids(name, spec.slices) if spec.slices > 1 else [name]
        self.groups.refuse_taken(name, groups, policy=topo.multi_host)
        made: list[Callable[[], None]] = []  # how to take back what was asked for, should a later step fail
        try:
            policy = self.groups.make_policy(
                name, topo, functools.partial(made.append, functools.partial(self.groups.delete_policy, name))
            )
            template = self.groups.make_template(
                name, props, functools.partial(made.append, functools.partial(self.groups.delete_template, name))
            )
            for i, group in enumerate(groups):
                about = MADE_BY + name + (f", slice {i} of {len(groups)}" if len(groups) > 1 else "")
                self.groups.insert_group(
                    group,
                    template,
                    topo.hosts,
                    policy,
                    about,
                    functools.partial(made.append, functools.partial(self.groups.delete_groups, [group])),
                    bulk=bool(request.max_run),
                )
        except Exception:  # on Ctrl-C, `take_back` deletes what was asked for, saying so
            left = []
            for undo in reversed(made):
                try:
                    undo()
                except ApiError as exc:
                    left.append(exc.message)
            for message in left:
                log.warning("%s: could not take back what was made: %s", name, message)
            raise

    def _insert_vm(
        self, vm: compute_v1.Instance, timeout: float, progress: Progress, *, wait: bool = True, state: str = "CREATING"
    ) -> None:
        """VM made; while its insert runs, PROGRESS says it is in STATE."""
        self.calls.operate(
            f"create {vm.name}",
            lambda: self.calls.instances.insert_unary(project=self.project, zone=self.zone, instance_resource=vm),
            timeout,
            functools.partial(progress, f"{vm.name}: {state}"),
            wait=wait,
        )

    def _properties(self, spec: CreateSpec, request: Request) -> compute_v1.InstanceProperties:
        """What every VM of the TPU is made with: a template's properties (an instance takes the same)."""
        topo = request.topology
        metadata = {**request.metadata, "enable-guest-attributes": "TRUE"}
        access = [] if spec.internal_ips else [compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")]
        model = "SPOT" if spec.spot else "FLEX_START" if request.max_run else "STANDARD"
        ends = {"instance_termination_action": "STOP"} if spec.spot else {}
        if request.max_run:  # flex-start VMs run that long, then are deleted
            ends = {
                "instance_termination_action": "DELETE",
                "max_run_duration": compute_v1.Duration(seconds=request.max_run),
            }
        return compute_v1.InstanceProperties(
            machine_type=topo.machine_type,
            disks=[_boot_disk(topo)],
            network_interfaces=[
                compute_v1.NetworkInterface(
                    network=_under(spec.network or "default", "global/networks"),
                    access_configs=access,
                    **(
                        {"subnetwork": _under(spec.subnetwork, f"regions/{self.region}/subnetworks")}
                        if spec.subnetwork
                        else {}
                    ),
                )
            ],
            scheduling=compute_v1.Scheduling(
                on_host_maintenance="TERMINATE",
                automatic_restart=False,
                provisioning_model=model,
                **ends,
            ),
            **(
                {"reservation_affinity": compute_v1.ReservationAffinity(consume_reservation_type="NO_RESERVATION")}
                if request.max_run
                else {}
            ),
            metadata=compute_v1.Metadata(items=[compute_v1.Items(key=k, value=v) for k, v in metadata.items()]),
            service_accounts=[
                compute_v1.ServiceAccount(email="default", scopes=["https://www.googleapis.com/auth/cloud-platform"])
            ],
            labels=request.labels,
        )

    # ------------------------------------------------------------------ deleting

    def asked_for(self, spec: CreateSpec, topology: Topology) -> str:
        name = spec.name
        if not topology.multi_host and spec.slices == 1:
            return f"the VM {name}"
        groups = f"group {name}" if spec.slices == 1 else f"groups {name}-0 to {name}-{spec.slices - 1}"
        policy = f" and the workload policy {name}" if topology.multi_host else ""
        return f"the instance {groups}, the instance template {name}{policy}"

    def delete(self, view: NodeView, progress: Progress) -> Deleted:
        """A group's instance template and workload policy go with it only where tpurun made them for the TPU
        (their description says so): those of a group made elsewhere, then attached, are left, named."""
        name = view.name
        several = bool(view.slices or view.gone)
        names = slice_ids(name, len(view.parts) + len(view.gone)) if several else [name]
        groups = [g for n in names if (g := self.groups.get_group(n)) is not None]
        if not groups:
            self._delete_vm(name, progress)
            return Deleted()
        made_template, made_policy = (
            self.groups.made_template(groups[0], name),
            self.groups.made_policy(groups[0], name),
        )
        self.groups.delete_groups([g.name for g in groups], progress)
        also = [f"its {len(names)} slices' instance groups"] if several else []
        deleted = Deleted(also + self._delete_made(name, made_template, made_policy, progress))
        policy = groups[0].resource_policies.workload_policy
        if not made_template:
            deleted.left.append(f"the instance template {short_name(groups[0].instance_template)}")
        if policy and not made_policy:
            deleted.left.append(f"the workload policy {short_name(policy)}")
        if deleted.left:
            deleted.why_left = (
                f"tpurun deletes only what it made, which it marks in the description ({MADE_BY}{name}), and "
                "these are not marked: made elsewhere, they may serve other groups"
            )
        return deleted

    def _delete_made(self, name: str, template: bool, policy: bool, progress: Progress) -> list[str]:
        """The instance TEMPLATE and workload POLICY tpurun made for the TPU NAME deleted, once no group uses them."""
        also = []
        if template:
            progress(f"{name}: deleting its instance template")
            self.groups.delete_template(name)
            also.append("its instance template")
        if policy:
            progress(f"{name}: deleting its workload policy")
            self.groups.delete_policy(name)
            also.append("its workload policy")
        return also

    def take_back(self, name: str, progress: Progress) -> Deleted | None:
        """Also what is not a TPU (yet, or any more) of what tpurun made for NAME: the groups of its slices, its
        template and policy, each known by its description."""
        view = self.find(name)
        if view is not None:
            return self.delete(view, progress)
        groups = self.calls.call(
            "list instance groups", lambda: list(self.calls.managers.list(project=self.project, zone=self.zone))
        )
        ours = [g.name for g in groups if g.description == MADE_BY + name or (_slice_of(g) or ("",))[0] == name]
        template = self.groups.template(self.groups.template_path(name))
        policy = self.groups.policy(self.groups.policy_path(name))
        made_template, made_policy = (x is not None and x.description == MADE_BY + name for x in (template, policy))
        if not (ours or made_template or made_policy):
            return None
        self.groups.delete_groups(ours, progress)
        also = [f"its instance group{'s' if len(ours) > 1 else ''} {', '.join(ours)}"] if ours else []
        return Deleted(also + self._delete_made(name, made_template, made_policy, progress))

    def _delete_vm(self, name: str, progress: Progress) -> None:
        what = f"delete {name}"
        call = functools.partial(self.calls.instances.delete_unary, project=self.project, zone=self.zone, instance=name)
        get = functools.partial(
            self.calls.find,
            f"get instance {name}",
            lambda: self.calls.instances.get(project=self.project, zone=self.zone, instance=name),
        )
        self.calls.deleted(
            what, self.calls.ask_delete(what, call, tpu=name), get, lambda: progress(f"{name}: DELETING")
        )

    def recreate(self, view: NodeView, progress: Progress) -> None:
        """Delete the preempted VMs and make them again as they were: Google's way back for a spot TPU
        VM or group ("you must delete and then recreate it"). A group keeps its template and workload
        policy and gets new VMs; a single VM is made again with the fields it has, from the boot image
        family tpurun makes it with (so only one tpurun made)."""
        name = view.name
        groups = [g for p in view.parts if (g := self.groups.get_group(p.name)) is not None]
        if groups:
            self.groups.delete_groups([g.name for g in groups], progress)
            progress(f"{name}: CREATING")
            for group in groups:
                self.groups.insert_group(
                    group.name,
                    group.instance_template,
                    group.target_size,
                    group.resource_policies.workload_policy,
                    group.description,
                    bulk=group.target_size_policy.mode == "BULK",
                )
            return
        vm = self.calls.call(
            f"get instance {name}",
            lambda: self.calls.instances.get(project=self.project, zone=self.zone, instance=name),
        )
        if vm.description != MADE_BY + name:
            raise UsageError(
                f"{name}: tpurun remakes only the Compute Engine VMs it made, and does not know this one's boot disk",
                hint=f"remake it as it was made, then `tpurun attach {name}`",
            )
        again = _remade(vm, self.zone)
        self._delete_vm(name, progress)
        self._insert_vm(again, 1800, progress)

    # ------------------------------------------------------------------ changing

    def watchdog_resources(
        self, name: str, parts: list[str], multi_host: bool, view: NodeView | None
    ) -> WatchdogConfig:
        """A lone VM deletes itself; a group's first VM deletes the groups, then the template and the workload
        policy tpurun made with them (those of a group made elsewhere stay, as `delete` leaves them)."""
        where = ComputeTpu(self.project, self.zone, name)
        if view is None:  # what create is about to make: a group per slice, unless it is one lone VM
            groups = list(parts) if multi_host or len(parts) > 1 else []
            made = (True, multi_host)  # its template, and a workload policy for multi-host slices
        else:
            group = self.groups.get_group(view.parts[0].name)
            groups = [p.name for p in view.parts] if group is not None else []
            made = (
                (False, False)
                if group is None
                else (self.groups.made_template(group, name), self.groups.made_policy(group, name))
            )
        if groups:
            where.groups = groups
            paths = (self.groups.template_path(name), self.groups.policy_path(name))
            where.also = [path for path, ours in zip(paths, made, strict=True) if ours]
        else:
            where.instance = name
        return WatchdogConfig(compute_endpoint(self.cloud.endpoint), compute=where)

    def cannot_stop(self, view: NodeView, verb: str) -> str:
        return _cannot(view.name, verb)

    @classmethod
    def cannot_stop_asked(cls, spec: CreateSpec, topo: Topology) -> str:
        return _cannot(f"{spec.name} ({topo.name})", "stop")

    @classmethod
    def check_create(cls, spec: CreateSpec, topo: Topology) -> None:
        """What tpurun does not ask of Compute Engine (yet)."""
        refused = [
            ("--queued", spec.queued, "queued resources belong to the Cloud TPU API; --flex-start waits for capacity"),
            (
                "--valid-until",
                bool(spec.valid_until) and not spec.flex_start,
                "it applies to waiting for capacity, which it does with --flex-start",
            ),
            (
                "--version",
                bool(spec.version),
                "Compute Engine VMs boot an image family, not a Cloud TPU runtime version",
            ),
            ("--preemptible", spec.preemptible, "its VMs are spot VMs (--spot), not preemptible ones"),
        ]
        for option, given, why in refused:
            if given:
                raise UsageError(f"{option}: {topo.name} is made by Compute Engine here, and {why}")

    @classmethod
    def run_limit(cls, spec: CreateSpec) -> int | None:
        if not spec.flex_start:
            return None
        if spec.spot:
            raise UsageError("choose one of --spot and --flex-start")
        if not spec.max_run_duration:
            raise UsageError("--flex-start needs --max-run-duration (e.g. 8h): flex-start VMs run at most that long")
        seconds = parse_duration(spec.max_run_duration)
        if not FLEX_RUN[0] <= seconds <= FLEX_RUN[1]:
            raise UsageError(f"--max-run-duration {spec.max_run_duration}: give between 10m and 7d")
        return seconds

    def stop(self, view: NodeView, progress: Progress) -> None:
        raise UsageError(self.cannot_stop(view, "stop"))

    def start(self, view: NodeView, progress: Progress) -> None:
        raise UsageError(self.cannot_stop(view, "start"))

    def update_metadata(self, view: NodeView, change: MetadataChange) -> None:
        def update(vm_name: str) -> None:
            vm = self.calls.call(
                f"get instance {vm_name}",
                lambda: self.calls.instances.get(project=self.project, zone=self.zone, instance=vm_name),
            )
            entries = change(_metadata(vm.metadata))
            if not entries:
                return
            items = {**_metadata(vm.metadata), **entries}
            body = compute_v1.Metadata(
                fingerprint=vm.metadata.fingerprint,
                items=[compute_v1.Items(key=k, value=v) for k, v in items.items()],
            )
            self.calls.operate(
                f"update metadata of {vm_name}",
                lambda: self.calls.instances.set_metadata_unary(
                    project=self.project, zone=self.zone, instance=vm_name, metadata_resource=body
                ),
                300,
            )

        with ThreadPoolExecutor(max_workers=min(16, max(1, len(view.workers)))) as pool:
            list(pool.map(update, [w.vm for w in view.workers]))


# ---------------------------------------------------------------------------- Compute Engine's records


def _cannot(what: str, verb: str) -> str:
    return (
        f"{what} is made by Compute Engine, whose TPU VMs tpurun deletes but does not {verb} (Google documents "
        "deleting and creating them again)"
    )


def _under(name: str, collection: str) -> str:
    """NAME as Compute Engine takes it: a bare name (as the Cloud TPU API takes networks) under COLLECTION."""
    return name if "/" in name else f"{collection}/{name}"


def _is_tpu_type(machine_type: str) -> bool:
    try:
        vm_topology(short_name(machine_type))
    except UsageError:
        return False
    return True


def _tpu_vm(vm: compute_v1.Instance) -> bool:
    return _is_tpu_type(vm.machine_type)


def _member(vm: compute_v1.Instance) -> str:
    """The group a VM belongs to ("" for a VM on its own), from the `created-by` metadata a MIG gives it."""
    created_by = _metadata(vm.metadata).get("created-by", "")
    return short_name(created_by) if "/instanceGroupManagers/" in created_by else ""


def _slice_of(group: compute_v1.InstanceGroupManager) -> tuple[str, int, int] | None:
    """(its TPU, its slice, how many slices) of a group tpurun made as one slice of several."""
    m = SLICE_RE.match(group.description)
    return (m["tpu"], int(m["index"]), int(m["count"])) if m else None


def _metadata(md: compute_v1.Metadata) -> dict[str, str]:
    return {item.key: item.value for item in md.items}


def _vm_state(vm: compute_v1.Instance) -> str:
    if vm.status in ("TERMINATED", "STOPPED"):
        spot = vm.scheduling.provisioning_model == "SPOT" or vm.scheduling.preemptible
        return PREEMPTED if spot else STOPPED
    return _STATES.get(vm.status, vm.status)


def _maintenance(vms: list[compute_v1.Instance]) -> list[Maintenance]:
    """What Compute Engine announces for each VM (`resourceStatus.upcomingMaintenance`)."""
    found = (
        Maintenance.from_api(
            compute_v1.UpcomingMaintenance.to_dict(
                vm.resource_status.upcoming_maintenance, preserving_proto_field_name=False
            ),
            vm.name,
        )
        for vm in vms
    )
    return [m for m in found if m is not None]


def _worker(index: int, vm: compute_v1.Instance) -> WorkerView:
    nic = vm.network_interfaces[0] if vm.network_interfaces else compute_v1.NetworkInterface()
    external = nic.access_configs[0].nat_i_p if nic.access_configs else ""
    return WorkerView(index, nic.network_i_p, external, keys.instance_key_alias(str(vm.id)), vm=vm.name)


def _image(disks: Any) -> str:
    """The boot image (family) a VM or template boots, by its last name."""
    for disk in disks:
        if disk.boot:
            return short_name(disk.initialize_params.source_image or disk.source) or "-"
    return "-"


def _boot_disk(topo: Topology) -> compute_v1.AttachedDisk:
    """The boot disk tpurun gives a VM of TOPO: the newest image of its generation's family."""
    from tpurun.topology import GENERATIONS

    family = GENERATIONS[topo.generation].image_family
    return compute_v1.AttachedDisk(
        boot=True,
        auto_delete=True,
        initialize_params=compute_v1.AttachedDiskInitializeParams(
            source_image=f"projects/{IMAGE_PROJECT}/global/images/family/{family}", disk_size_gb=BOOT_DISK_GB
        ),
    )


def _instance_fields(props: compute_v1.InstanceProperties, zone: str) -> dict[str, Any]:
    """An instance's fields from template properties (an instance names its machine type by zone)."""
    return {
        "machine_type": f"zones/{zone}/machineTypes/{props.machine_type}",
        "disks": list(props.disks),
        "network_interfaces": list(props.network_interfaces),
        "scheduling": props.scheduling,
        "metadata": props.metadata,
        "service_accounts": list(props.service_accounts),
        "labels": dict(props.labels),
    }


def _remade(vm: compute_v1.Instance, zone: str) -> compute_v1.Instance:
    """What makes VM (one tpurun made) again: its own fields, and a boot disk of the image family tpurun
    gives its generation (an instance tells its disk, not the image it came from)."""
    topo = vm_topology(short_name(vm.machine_type))
    props = compute_v1.InstanceProperties(
        machine_type=topo.machine_type,
        disks=[_boot_disk(topo)],
        network_interfaces=[
            compute_v1.NetworkInterface(
                network=n.network,
                subnetwork=n.subnetwork,
                access_configs=[compute_v1.AccessConfig(name=a.name, type_=a.type_) for a in n.access_configs],
            )
            for n in vm.network_interfaces
        ],
        scheduling=vm.scheduling,
        metadata=compute_v1.Metadata(items=list(vm.metadata.items)),
        service_accounts=list(vm.service_accounts),
        labels=dict(vm.labels),
    )
    return compute_v1.Instance(name=vm.name, description=vm.description, **_instance_fields(props, zone))
