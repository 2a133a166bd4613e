"""Host events of emulated VMs, told as both APIs and the VMs' metadata servers tell them.

* Maintenance: announced on one VM (a Cloud TPU worker, or a Compute Engine instance) some time before its
  window; at the window's start the host goes down (a TPU slice is interrupted as a whole: TPUs do not
  live-migrate) and the TPU reads REPAIRING; at its end the slice boots again and reads READY. It can be
  started early (`performMaintenance`) or simulated (`simulateMaintenanceEvent`) through the APIs' own methods
  (Cloud TPU's are in v2alpha1 only).
* Preemption after a notice: the VM's metadata says `preempted` TRUE first, then the host goes.

The node (or instance) carries `upcomingMaintenance` while a window is pending or ongoing; the announced
worker's metadata server carries `upcoming-maintenance`, and `maintenance-event` once the window starts.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from google.cloud import compute_v1, tpu_v2

from tpurun.emulator.compute_migs import ManagedGroups
from tpurun.emulator.compute_model import InstanceRecord
from tpurun.emulator.model import (
    ONGOING,
    PENDING,
    SCHEDULED,
    UNSCHEDULED,
    ApiError,
    NodeRecord,
    Operation,
    Window,
    failed_precondition,
    set_enum,
)

TERMINATE = "TERMINATE_ON_HOST_MAINTENANCE"  # what `maintenance-event` says once a TPU VM's window starts


@dataclass
class Host:
    """Where a host event lands: a Cloud TPU node's worker, or a Compute Engine instance (alone or in a MIG)."""

    key: str  # WorkerHosts' node
    worker: int  # WorkerHosts' index of the worker (a MIG's: in the order its VMs were made)
    node: NodeRecord | None = None
    vm: InstanceRecord | None = None
    number: int | None = None  # the worker as tpurun numbers it (wN), where it differs from WORKER

    @property
    def name(self) -> str:
        return self.node.node.name if self.node else self.vm.path  # type: ignore[union-attr]

    @property
    def label(self) -> str:
        """The host in the event log: its TPU and worker, as tpurun numbers it (a group's: its VM named too)."""
        if self.number is None:
            return f"{self.name} worker {self.worker}"
        return f"{self.vm.mig} worker {self.number} ({self.name.rsplit('/', 1)[-1]})"  # type: ignore[union-attr]

    @property
    def lock(self) -> threading.RLock:
        return self.node.lock if self.node else self.vm.group.lock  # type: ignore[union-attr]

    @property
    def running(self) -> bool:
        """Its worker is up (the node booted, the VM RUNNING or under maintenance)."""
        if self.node is not None:
            return self.node.booted
        return self.vm.group.booted and self.vm.inst.status in ("RUNNING", "REPAIRING")  # type: ignore[union-attr]


def _named(ref: str, path: str) -> bool:
    """Whether REF names the resource at PATH: its whole path or its last part."""
    return ref in (path, path.rsplit("/", 1)[-1])


class HostEvents(ManagedGroups):
    # ------------------------------------------------------------------ where

    def _host(self, ref: str, worker: int, zone: str | None = None) -> Host:
        """A node's worker, a MIG's VM or a lone VM (worker 0), by name (in ZONE if given); WORKER as tpurun
        numbers workers (a MIG's by its VMs' names). A name in several zones needs ZONE."""
        with self.lock:
            nodes = [r for r in self.nodes.values() if _named(ref, r.node.name) and zone in (None, r.zone)]
            migs = [m for p, m in self.migs.items() if _named(ref, p) and zone in (None, m.zone)]
            vms = [v for p, v in self.instances.items() if _named(ref, p) and zone in (None, v.group.zone)]
        found = len(nodes) + len(migs) + len(vms)
        if found != 1:
            where = f" in zone {zone}" if zone else ""
            if not found:
                raise ApiError(404, f"no TPU named '{ref}'{where}", "NOT_FOUND")
            zones = sorted({r.zone for r in nodes} | {m.zone for m in migs} | {v.group.zone for v in vms})
            raise ApiError(400, f"'{ref}' names a TPU in each of {', '.join(zones)}: give its zone")
        if nodes:
            rec = nodes[0]
            if not 0 <= worker < rec.topo.hosts:
                raise ApiError(400, f"{rec.node.name} has workers 0-{rec.topo.hosts - 1}, not {worker}.")
            return Host(rec.key, worker, node=rec)
        if vms and not vms[0].mig:
            if worker != 0:
                raise ApiError(400, f"{vms[0].path} is a TPU of one VM: its worker is 0, not {worker}.")
            return Host(vms[0].group.key, vms[0].index, vm=vms[0])
        mig = migs[0] if migs else self.migs[vms[0].mig]
        ordered = self.by_worker_number(mig)
        if not 0 <= worker < len(ordered):
            raise ApiError(400, f"{mig.path} has workers 0-{len(ordered) - 1}, not {worker}.")
        vm = ordered[worker]
        if vms and vm is not vms[0]:
            raise ApiError(400, f"{vms[0].path} is worker {ordered.index(vms[0])} of {mig.path}, not {worker}.")
        return Host(mig.group.key, vm.index, vm=vm, number=worker)

    def _window(self, host: Host) -> Window | None:
        rec = host.node or host.vm
        return rec.maintenance  # type: ignore[union-attr]

    def _show(self, host: Host, window: Window | None) -> None:
        """Put WINDOW (None: none) in the API's view of HOST and in its worker's metadata (caller holds self.lock)."""
        if host.node is not None:
            host.node.maintenance = window
        else:
            vm = host.vm
            assert vm is not None
            vm.maintenance = window
            if window is None:
                vm.inst.resource_status.upcoming_maintenance = compute_v1.UpcomingMaintenance()
            else:
                a = window.api()
                vm.inst.resource_status.upcoming_maintenance = compute_v1.UpcomingMaintenance(
                    type_=a["type"],
                    can_reschedule=a["canReschedule"],
                    window_start_time=a["windowStartTime"],
                    window_end_time=a["windowEndTime"],
                    latest_window_start_time=a["latestWindowStartTime"],
                    maintenance_status=a["maintenanceStatus"],
                )
        events: dict[str, str | None] = {"upcoming-maintenance": None, "maintenance-event": None}
        if window is not None:
            events["upcoming-maintenance"] = window.metadata()
            if window.status == ONGOING:
                events["maintenance-event"] = TERMINATE
        self.hosts.set_events(host.key, [host.worker], events)

    # ------------------------------------------------------------------ maintenance

    def announce_maintenance(
        self,
        ref: str,
        worker: int,
        notice: float,
        length: float,
        kind: str = UNSCHEDULED,
        can_reschedule: bool = False,
        zone: str | None = None,
    ) -> Window:
        """Maintenance of REF's WORKER (in ZONE, if given) in NOTICE seconds, its host down for LENGTH seconds
        (admin)."""
        if kind not in (SCHEDULED, UNSCHEDULED):
            raise ApiError(400, f"unknown maintenance type '{kind}' (SCHEDULED or UNSCHEDULED)")
        if notice < 0 or length < 0:
            raise ApiError(400, "notice and duration cannot be negative")
        return self._announce(self._host(ref, worker, zone), notice, length, kind, can_reschedule)

    def _announce(self, host: Host, notice: float, length: float, kind: str, can_reschedule: bool) -> Window:
        with self.lock:
            ready = host.node.state == "READY" if host.node else host.vm.inst.status == "RUNNING"  # type: ignore[union-attr]
            if not ready or self._window(host) is not None:
                raise ApiError(400, f"{host.name} is not running, or has a maintenance announced already.")
            window = Window(host.worker, kind, time.time() + notice, length, can_reschedule)
            self._show(host, window)
        self.log_event("maintenance", f"{host.label}: {kind} in {notice:g}s for {length:g}s")
        self._spawn(self._carry_out, host, window)
        return window

    def _carry_out(self, host: Host, window: Window) -> None:
        """Wait for WINDOW's start; take the host down; after its length, boot the slice again."""
        while not window.now.is_set() and time.time() < window.start:
            if not self._sleep(min(0.5, window.start - time.time())):
                return  # the emulator closes
            if window.now.is_set():
                break
        with self.lock:
            if self._window(host) is not window:  # the TPU went meanwhile
                return
            window.status, window.start = ONGOING, min(window.start, time.time())
            self._show(host, window)
            if host.node is not None:
                host.node.set_state("REPAIRING")
                set_enum(host.node.node, "health", tpu_v2.Node.Health.UNHEALTHY_MAINTENANCE)
            else:
                host.vm.inst.status = "REPAIRING"  # type: ignore[union-attr]
        self.log_event("maintenance", f"{host.label}: down")
        with host.lock:
            try:
                self.hosts.kill_worker(host.key, host.worker)
            except KeyError:
                return
        if not self._sleep(window.length):
            return
        self._bring_back(host, window)

    def _bring_back(self, host: Host, window: Window) -> None:
        with self.lock:
            if self._window(host) is not window:
                return
            self._show(host, None)
            everyone = list(range(host.node.topo.hosts if host.node else len(host.vm.group.members)))  # type: ignore[union-attr]
        if host.node is not None:
            with host.node.lock:
                self._boot(host.node)
                with self.lock:
                    host.node.set_state("READY")
                    set_enum(host.node.node, "health", tpu_v2.Node.Health.HEALTHY)
        else:
            self._boot_group(host.vm.group)  # type: ignore[union-attr]
        self.hosts.set_events(host.key, everyone, {"maintenance-event": None, "upcoming-maintenance": None})
        self.log_event("maintenance", f"{host.label}: back")

    def _start_now(self, host: Host) -> None:
        with self.lock:
            window = self._window(host)
            if window is None or window.status != PENDING:
                raise failed_precondition(f"{host.name} has no pending maintenance.")
        window.now.set()

    # ------------------------------------------------------------------ the APIs' methods

    def perform_maintenance(self, name: str) -> dict[str, Any]:
        """Cloud TPU v2alpha1 nodes.performMaintenance: the node's pending maintenance starts now."""
        rec = self.get_record(name)
        with self.lock:
            window = rec.maintenance
        self._start_now(Host(rec.key, window.worker if window else 0, node=rec))
        return self._done_op(rec, "performMaintenance")

    def simulate_maintenance_event(self, name: str, worker_ids: list[str]) -> dict[str, Any]:
        """Cloud TPU v2alpha1 nodes.simulateMaintenanceEvent: an unscheduled maintenance of the first worker
        listed (worker 0 if none), after the emulator's notice delay."""
        rec = self.get_record(name)
        try:
            worker = int(worker_ids[0]) if worker_ids else 0
        except ValueError as e:
            raise ApiError(400, f"Invalid worker id '{worker_ids[0]}'") from e
        self.announce_maintenance(rec.node.name, worker, self.config.delays.notice, self.config.delays.maintenance)
        return self._done_op(rec, "simulateMaintenanceEvent")

    def perform_queued_maintenance(self, name: str, node_names: list[str]) -> dict[str, Any]:
        """Cloud TPU v2alpha1 queuedResources.performMaintenanceQueuedResource: the pending maintenance of
        the slices named (every slice with one, if none is) starts now."""
        qr = self.get_qr_record(name)
        with self.lock:
            names = [n for n in qr.node_names if not node_names or n.rsplit("/", 1)[-1] in node_names]
            recs = [self.nodes[n] for n in names if n in self.nodes]
        started = 0
        for rec in recs:
            with self.lock:
                window = rec.maintenance
            if window is not None and window.status == PENDING:
                window.now.set()
                started += 1
        if not started:
            raise failed_precondition(f"{name} has no slice with pending maintenance.")
        op = self._new_op(qr.project, qr.zone, "performMaintenanceQueuedResource", name, api="v2alpha1")
        self._finish(op, {"@type": op.response_type("QueuedResource"), **self.get_queued_resource(name)})
        return op.to_json()

    def queued_maintenance_info(self, name: str) -> dict[str, Any]:
        """Cloud TPU v2alpha1 queuedResources.getMaintenanceInfo."""
        qr = self.get_qr_record(name)
        with self.lock:
            out = []
            for n in qr.node_names:
                rec = self.nodes.get(n)
                if rec is not None:
                    info: dict[str, Any] = {"nodeName": n.rsplit("/", 1)[-1], "nodeUid": str(rec.node.id)}
                    if rec.maintenance is not None:
                        info["upcomingMaintenance"] = rec.maintenance.api()
                    out.append(info)
        return {"nodeUpcomingMaintenances": out} if out else {}

    def _done_op(self, rec: NodeRecord, verb: str) -> dict[str, Any]:
        op: Operation = self._new_op(rec.project, rec.zone, verb, rec.node.name, api="v2alpha1")
        self._finish(op, {"@type": op.response_type("Node"), **self.node_json(rec)})
        return op.to_json()

    def simulate_instance_maintenance(self, path: str) -> dict[str, Any]:
        """Compute Engine instances.simulateMaintenanceEvent: a TPU VM (onHostMaintenance TERMINATE) is taken
        down for maintenance after the emulator's notice delay."""
        rec = self._record(path)
        delays = self.config.delays
        self._announce(Host(rec.group.key, rec.index, vm=rec), delays.notice, delays.maintenance, UNSCHEDULED, False)
        return self._quick(
            self._operation(rec.path.rsplit("/instances/", 1)[0], "simulateMaintenanceEvent", path, rec.inst.id)
        )

    def perform_instance_maintenance(self, path: str) -> dict[str, Any]:
        """Compute Engine instances.performMaintenance: the instance's pending maintenance starts now."""
        rec = self._record(path)
        self._start_now(Host(rec.group.key, rec.index, vm=rec))
        return self._quick(
            self._operation(rec.path.rsplit("/instances/", 1)[0], "performMaintenance", path, rec.inst.id)
        )

    # ------------------------------------------------------------------ preemption

    def preempt(self, ref: str, force: bool = False) -> dict[str, Any]:
        rec = self.find_node(ref)
        self._check_preemptible(rec, force)
        with rec.lock:
            self._shutdown(rec, delete=False)
            with self.lock:
                rec.set_state("PREEMPTED")
                self._drop_maintenance(rec)  # its waiting thread woken, not left asleep until the window
                set_enum(rec.node, "health", tpu_v2.Node.Health.HEALTH_UNSPECIFIED)
        self.log_event("preempt", rec.node.name)
        self._queued_node_changed(rec)
        return self.node_json(rec)

    def _check_preemptible(self, rec: NodeRecord, force: bool) -> None:
        with self.lock:
            sc = rec.node.scheduling_config
            if not (sc.spot or sc.preemptible) and not force:
                raise ApiError(
                    400,
                    f"{rec.node.name} is not a spot or preemptible node, so Cloud TPU would not "
                    "preempt it; pass --force to preempt it anyway.",
                )
            if rec.state != "READY":
                raise ApiError(400, f"{rec.node.name} is {rec.state}; only a running node can be preempted.")

    def preempt_after(self, ref: str, notice: float, *, force: bool = False, instance: bool = False) -> None:
        """Preempt REF (a spot node, or with INSTANCE a spot VM) NOTICE seconds after its workers' metadata
        says `preempted` TRUE (a spot VM has about 30 s between the two; the emulator's OS is not told)."""
        if instance:
            vm = self.find_instance(ref)
            self._check_spot(vm, force)
            key, workers = vm.group.key, [vm.index]

            def act() -> None:
                if self.instances.get(vm.path) is vm and vm.inst.status == "RUNNING":
                    self.preempt_instance(vm.path, force=True)
        else:
            rec = self.find_node(ref)
            self._check_preemptible(rec, force)
            key, workers = rec.key, list(range(rec.topo.hosts))

            def act() -> None:
                if self.nodes.get(rec.node.name) is rec and rec.state == "READY":  # not deleted or remade meanwhile
                    self.preempt(rec.node.name, force=True)

        self.hosts.set_events(key, workers, {"preempted": "TRUE"})
        if notice <= 0:
            act()
            return
        self.log_event("preempt", f"{ref}: in {notice:g}s")

        def later() -> None:
            if self._sleep(notice):
                act()

        self._spawn(later)
