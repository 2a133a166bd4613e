"""The emulated service's core: its state and locks, background work, faults on API calls, capacity,
and validation of what clients send. The other layers (operations, nodes, queued resources, admin) build
on it, one class each, and state.Emulator is the whole."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from google.cloud import tpu_v2

from tpurun.emulator.model import (
    GRPC_CODES,
    HOLDING_STATES,
    LABEL_KEY_RE,
    LABEL_VALUE_RE,
    METADATA_KEY_RE,
    NODE_ID_RE,
    RUNTIME_VERSIONS,
    STATUS_FOR_HTTP,
    ApiError,
    EmulatorConfig,
    HostsLike,
    NodeRecord,
    Operation,
    QueuedRecord,
    invalid,
    not_found,
    now_rfc3339,
    slots_for,
    split_name,
    worker_address,
)
from tpurun.emulator.org import Organisation
from tpurun.errors import UsageError
from tpurun.topology import GENERATIONS, Topology, parse_accelerator_type

R = TypeVar("R")


class Core:
    def __init__(self, hosts: HostsLike, config: EmulatorConfig) -> None:
        self.hosts = hosts
        self.config = config
        self.org = Organisation()  # every project's common metadata and every account's OS Login profile
        hosts.use_organisation(self.org)
        self.lock = threading.RLock()
        self.nodes: dict[str, NodeRecord] = {}
        self.ops: dict[str, Operation] = {}
        self.queued: dict[str, QueuedRecord] = {}
        self.request_log: list[dict[str, Any]] = []
        self.requests_logged = 0
        self._fail_rules: list[dict[str, Any]] = []
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ plumbing

    def _spawn(self, fn: Callable[..., None], *args: Any) -> None:
        t = threading.Thread(target=self._guard, args=(fn, *args), daemon=True)
        with self.lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
        t.start()

    def _every_tick(self, name: str, once: Callable[[], None]) -> None:
        """Run ONCE every 50 ms on a thread of its own until the emulator closes; a failure is logged for the
        admin and the loop goes on (the schedulers of queued resources and of MIGs)."""

        def loop() -> None:
            while self._sleep(0.05):
                try:
                    once()
                except Exception as e:
                    self.log_event("internal-error", f"{name}: {type(e).__name__}: {e}")

        threading.Thread(target=loop, name=f"emulator-{name}", daemon=True).start()

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # an operation thread must never die silently: log it for the admin
            self.log_event("internal-error", f"{fn.__name__}: {type(e).__name__}: {e}")

    def _sleep(self, seconds: float) -> bool:
        """Wait SECONDS; False when the emulator is shutting down."""
        return not self._closing.wait(max(0.0, seconds))

    def _found(self, table: dict[str, R], name: str, collection: str) -> R:
        """The record of NAME (projects/P/locations/Z/COLLECTION/ID) in TABLE: a malformed name is a 400 and an
        unknown one a 404, as the API answers."""
        with self.lock:
            rec = table.get(name)
        if rec is None:
            split_name(name, collection)
            raise not_found(name)
        return rec

    def _new_op(self, project: str, zone: str, verb: str, target: str, api: str = "v2") -> Operation:
        op = Operation(
            name=f"projects/{project}/locations/{zone}/operations/operation-{int(time.time() * 1000)}-"
            f"{uuid.uuid4().hex[:24]}",
            verb=verb,
            target=target,
            api=api,
        )
        with self.lock:
            self.ops[op.name] = op
        return op

    @staticmethod
    def _finish(op: Operation, response: dict[str, Any] | None = None, error: ApiError | None = None) -> None:
        if error is not None:
            op.error = {"code": GRPC_CODES.get(error.status, 2), "message": error.message}
        else:
            op.response = response
        op.ended = time.time()
        op.done = True

    def log_event(self, kind: str, message: str) -> None:
        self.log_request("EVENT", kind, 0, message)

    def log_request(self, method: str, path: str, status: int, detail: str = "", caller: str = "user") -> None:
        entry = {"time": now_rfc3339(), "method": method, "path": path, "status": status, "detail": detail}
        entry["caller"] = caller
        with self.lock:
            self.request_log.append(entry)
            self.requests_logged += 1  # ever: the log keeps the last request_log_size of them
            del self.request_log[: -self.config.request_log_size]

    def _persist_pids(self) -> None:
        """Worker init pids in the state dir: `tpurun emulator stop` kills them if the server cannot."""
        pids: dict[str, list[int]] = {}
        with self.lock:
            keys = [r.key for r in self.nodes.values() if r.booted] + self._compute_booted()
        for key in keys:
            try:
                pids[key] = [w.init_pid for w in self.hosts.workers(key) if w.init_pid]
            except Exception:
                pids[key] = []
        path = self.config.state_dir / "workers.json"
        try:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(pids))
            tmp.replace(path)
        except OSError:
            pass

    # ------------------------------------------------------------------ faults on API calls

    def add_fail_rule(self, count: int, code: int, match: str = "", message: str = "") -> None:
        if code not in STATUS_FOR_HTTP and code not in (400, 412):
            raise ApiError(400, f"fail-api: unsupported HTTP code {code} (use one of {sorted(STATUS_FOR_HTTP)})")
        with self.lock:
            self._fail_rules.append({"count": count, "code": code, "match": match, "message": message})

    def take_fault(self, method: str, path: str) -> ApiError | None:
        """The injected error for this API call, if one is armed (consumes one use)."""
        with self.lock:
            for rule in self._fail_rules:
                if rule["count"] > 0 and rule["match"] in f"{method} {path}":
                    rule["count"] -= 1
                    self._fail_rules = [r for r in self._fail_rules if r["count"] > 0]
                    msg = rule["message"] or {
                        429: "Quota exceeded for quota metric 'Requests' and limit 'Requests per minute' "
                        "of service 'tpu.googleapis.com' (injected by the emulator)",
                        503: "The service is currently unavailable (injected by the emulator).",
                        500: "Internal error encountered (injected by the emulator).",
                        403: "Permission 'tpu.nodes.create' denied on resource (or it may not exist) "
                        "(injected by the emulator).",
                    }.get(rule["code"], "Error injected by the emulator.")
                    return ApiError(rule["code"], msg)
        return None

    # ------------------------------------------------------------------ capacity

    def _usage(self, zone: str, gen: str, unit: str) -> int:
        used = self._compute_usage(zone, gen, unit)
        for rec in self.nodes.values():
            if rec.zone == zone and rec.topo.generation == gen and rec.holds and rec.state in HOLDING_STATES:
                used += rec.topo.chips if unit == "chips" else rec.topo.hosts
        return used

    # what Compute Engine's VMs hold (compute.ComputeResources): capacity, worker slots, booted worker hosts
    def _compute_usage(self, zone: str, gen: str, unit: str) -> int:
        return 0

    def _compute_slots(self) -> set[int]:
        return set()

    def _compute_booted(self) -> list[str]:
        return []

    def _fits(self, zone: str, topo: Topology, extra: list[Topology] | None = None) -> bool:
        limit = self.config.capacity.limit_for(zone, topo.generation)
        if limit is None:
            return True
        n, unit = limit
        want = sum((t.chips if unit == "chips" else t.hosts) for t in [topo, *(extra or [])])
        return self._usage(zone, topo.generation, unit) + want <= n

    def _exceeds_total(self, zone: str, topo: Topology) -> bool:
        limit = self.config.capacity.limit_for(zone, topo.generation)
        if limit is None:
            return False
        n, unit = limit
        return (topo.chips if unit == "chips" else topo.hosts) > n

    @staticmethod
    def _no_capacity(zone: str) -> ApiError:
        return ApiError(
            429,
            f'There is no more capacity in the zone "{zone}"; you can try in another zone where Cloud TPU '
            "Nodes are offered (see https://cloud.google.com/tpu/docs/regions) [EID: emulator]",
            "RESOURCE_EXHAUSTED",
        )

    def _too_many_workers(self, topo: Topology) -> ApiError | None:
        if slots_for(topo.hosts) > len(self.config.slots):
            return ApiError(
                429,
                f"the tpurun emulator cannot host {topo.name}: its {topo.hosts} workers need "
                f"{slots_for(topo.hosts)} address slots and this emulator has {len(self.config.slots)} "
                "(TPURUN_EMULATOR_SLOTS)",
                "RESOURCE_EXHAUSTED",
            )
        if topo.hosts > self.config.max_workers_per_node:
            return ApiError(
                429,
                f"the tpurun emulator cannot host {topo.name}: it has {topo.hosts} workers and this emulator "
                f"holds at most {self.config.max_workers_per_node} per node (--max-workers)",
                "RESOURCE_EXHAUSTED",
            )
        return None

    def _free_slot(self, workers: int, avoid: set[int] | None = None) -> int:
        """The first of the consecutive address slots a node of WORKERS workers takes (model.py's plan)."""
        used = set(avoid or ())
        for r in self.nodes.values():
            if r.slot:
                used.update(range(r.slot, r.slot + slots_for(r.topo.hosts)))
        used |= self._compute_slots()
        need, slots = slots_for(workers), self.config.slots
        for first in range(slots.start, slots.stop - need + 1):
            span = range(first, first + need)
            if not used.intersection(span) and all(self._slot_free_on_host(s) for s in span):
                return first
        raise self._no_capacity("emulator")

    def _slot_free_on_host(self, slot: int) -> bool:
        # Another emulator on this machine (a test session, say) may hold the slot's addresses: skip it.
        for port in {getattr(self.hosts, "ssh_port", 22), getattr(self.hosts, "metadata_port", 80)}:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((worker_address(slot, 0), port))
                except OSError:
                    return False
        return True

    # ------------------------------------------------------------------ validation

    def _validate_node(self, node: tpu_v2.Node, node_id: str) -> Topology:
        if not node_id:
            raise invalid("Invalid value for field 'node_id': ''. Must be specified.")
        if not NODE_ID_RE.match(node_id):
            raise invalid(
                f"Invalid value for field 'node_id': '{node_id}'. Must be a match of regex "
                "'[a-z]([-a-z0-9]*[a-z0-9])?' (a lowercase letter first, then lowercase letters, digits or "
                "hyphens, not ending in a hyphen) and at most 63 characters long."
            )
        if not node.runtime_version:
            raise invalid("Invalid value for field 'node.runtime_version': ''. Runtime version must be specified.")
        topo = self._topology_of(node)
        if node.runtime_version not in RUNTIME_VERSIONS:
            raise invalid(
                f"Invalid value for field 'node.runtime_version': '{node.runtime_version}'. Unsupported TPU "
                f"runtime version. Supported versions: {', '.join(RUNTIME_VERSIONS)}."
            )
        self._validate_metadata(dict(node.metadata))
        for k, v in node.labels.items():
            if not LABEL_KEY_RE.match(k) or not LABEL_VALUE_RE.match(v):
                raise invalid(
                    f"Invalid value for field 'node.labels': '{k}={v}'. Label keys must start with a lowercase "
                    "letter; keys and values may contain only lowercase letters, digits, '_' and '-' (max 63)."
                )
        return topo

    @staticmethod
    def _validate_metadata(md: dict[str, str]) -> None:
        total = 0
        for k, v in md.items():
            if not METADATA_KEY_RE.match(k) or len(k) > 128:
                raise invalid(f"Invalid value for field 'node.metadata': key '{k}' must match [a-zA-Z0-9-_]+.")
            if len(v.encode()) > 256 * 1024:
                raise invalid(f"Invalid value for field 'node.metadata': value of '{k}' exceeds 256 KiB.")
            total += len(k.encode()) + len(v.encode())
        if total >= 512 * 1024:
            raise invalid("Invalid value for field 'node.metadata': total metadata size exceeds 512 KB.")

    @staticmethod
    def _topology_of(node: tpu_v2.Node) -> Topology:
        name = node.accelerator_type
        if not name and node.accelerator_config and node.accelerator_config.type_:
            api_type = tpu_v2.AcceleratorConfig.Type(node.accelerator_config.type_).name
            gen = next((g for g in GENERATIONS.values() if g.api_type == api_type), None)
            shape = node.accelerator_config.topology
            if gen is None or not re.match(r"^\d+(x\d+){1,2}$", shape or ""):
                raise invalid(f"Invalid value for field 'node.accelerator_config': {api_type} '{shape}'.")
            size = next((s for s, sh in gen.shapes.items() if sh == shape), None)
            if size is None:
                raise invalid(
                    f"Invalid value for field 'node.accelerator_config.topology': '{shape}'. Valid {gen.name} "
                    f"topologies: {', '.join(gen.shapes.values())}."
                )
            name = f"{gen.name}-{size}"
        if not name:
            raise invalid(
                "Invalid value for field 'node.accelerator_type': ''. Either accelerator_type or "
                "accelerator_config must be specified."
            )
        try:
            topo = parse_accelerator_type(name)
        except UsageError as e:
            raise invalid(f"Invalid value for field 'node.accelerator_type': '{name}'. {e.message}") from e
        if topo.name != name:
            raise invalid(f"Invalid value for field 'node.accelerator_type': '{name}'. Did you mean {topo.name}?")
        if "tpu-api" not in topo.backends:
            raise invalid(f"Invalid value for field 'node.accelerator_type': '{name}'. Accelerator type not supported.")
        return topo

    def _queued_node_changed(self, rec: NodeRecord, gone: bool = False) -> None:
        """A node of a queued resource changed state (queued.Queued keeps the resource in step)."""
