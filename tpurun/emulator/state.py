"""The emulator's model of Cloud TPU: nodes, queued resources, long-running operations, capacity.

Everything the HTTP layer (api.py) answers comes from here. Methods take already-parsed proto-plus
messages and return JSON-ready dicts in the real API's shapes, or raise `ApiError` carrying the
HTTP status and Google status name the real service would send.

State changes that take time on the real service (create, stop, start, delete, queued-resource
provisioning) run on background threads with configurable delays; the workers themselves are
booted and stopped through a `WorkerHosts` (hosts.py), which is the only part that touches the OS.
"""

from __future__ import annotations

import base64
import datetime as _dt
import errno
import json
import random
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from google.cloud import tpu_v2

from tpurun.errors import UsageError
from tpurun.topology import GENERATIONS, Topology, all_accelerator_types, parse_accelerator_type

NODE_TYPE = "type.googleapis.com/google.cloud.tpu.v2.Node"
QR_TYPE = "type.googleapis.com/google.cloud.tpu.v2.QueuedResource"
EMPTY_TYPE = "type.googleapis.com/google.protobuf.Empty"
METADATA_TYPE = "type.googleapis.com/google.cloud.tpu.v2.OperationMetadata"

# google.rpc.Code numbers, used in failed operations' `error.code`
GRPC_CODES = {
    "OK": 0,
    "CANCELLED": 1,
    "UNKNOWN": 2,
    "INVALID_ARGUMENT": 3,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6,
    "PERMISSION_DENIED": 7,
    "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9,
    "ABORTED": 10,
    "OUT_OF_RANGE": 11,
    "UNIMPLEMENTED": 12,
    "INTERNAL": 13,
    "UNAVAILABLE": 14,
    "DATA_LOSS": 15,
    "UNAUTHENTICATED": 16,
}
# the Google status name a given HTTP status carries in error bodies
STATUS_FOR_HTTP = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ALREADY_EXISTS",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
HTTP_FOR_STATUS = {v: k for k, v in STATUS_FOR_HTTP.items()} | {"FAILED_PRECONDITION": 400, "ABORTED": 409}

NODE_ID_RE = re.compile(r"^[a-z](?:[a-z0-9-]{0,61}[a-z0-9])?$")
METADATA_KEY_RE = re.compile(r"^[a-zA-Z0-9_-]+$")
LABEL_KEY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")

# Runtime versions the real API lists (a generous subset). Creating a node with any other version
# fails as it does on Google's side, so a typo is caught by a dry run.
RUNTIME_VERSIONS = sorted(
    {
        "tpu-ubuntu2204-base",
        "tpu-vm-base",
        "tpu-vm-v4-base",
        "tpu-vm-pt-1.13",
        "tpu-vm-pt-2.0",
        "tpu-vm-v4-pt-1.13",
        "tpu-vm-v4-pt-2.0",
        "tpu-vm-tf-2.15.0-pjrt",
        "tpu-vm-tf-2.16.1-pjrt",
        "tpu-vm-tf-2.17.0-pjrt",
        "tpu-vm-tf-2.18.0-pjrt",
        "v2-alpha-tpuv5-lite",
        "v2-alpha-tpuv5",
        "v2-alpha-tpuv6e",
        "v2-tpuv5-litepod",
    }
    | {g.default_runtime for g in GENERATIONS.values()}
)

ZONES = [
    "us-central1-a",
    "us-central1-b",
    "us-central1-c",
    "us-central1-f",
    "us-central2-b",
    "us-east1-d",
    "us-east5-a",
    "us-east5-b",
    "us-south1-a",
    "us-west4-a",
    "europe-west4-a",
    "europe-west4-b",
    "asia-east1-c",
    "asia-northeast1-b",
]

# states in which a node holds capacity in its zone
_HOLDING = {"CREATING", "READY", "STARTING", "STOPPING", "RESTARTING", "REPAIRING", "DELETING"}


class ApiError(Exception):
    """An error the API answers with: HTTP status + Google status name + message."""

    def __init__(self, http: int, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.http = http
        self.status = status or STATUS_FOR_HTTP.get(http, "UNKNOWN")
        self.message = message

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.http, "message": self.message, "status": self.status}}


def not_found(name: str) -> ApiError:
    return ApiError(404, f'Resource "{name}" was not found', "NOT_FOUND")


def invalid(message: str) -> ApiError:
    return ApiError(400, message, "INVALID_ARGUMENT")


class HostsLike(Protocol):
    """What the model needs from hosts.WorkerHosts (kept structural so tests can use a fake)."""

    def boot_node(
        self,
        node_key: str,
        slot: int,
        *,
        num_workers: int,
        generation: str,
        accelerator_type: str,
        get_metadata: Callable[[], dict[str, str]],
        project: str = ...,
        zone: str = ...,
    ) -> list[Any]: ...

    def shutdown_node(self, node_key: str, *, delete: bool = False) -> None: ...
    def refresh_ssh_keys(self, node_key: str) -> None: ...
    def kill_sshd(self, node_key: str, index: int) -> None: ...
    def kill_worker(self, node_key: str, index: int) -> None: ...
    def guest_attributes(self, node_key: str) -> list[dict[tuple[str, str], str]]: ...
    def workers(self, node_key: str) -> list[Any]: ...
    def startup_log(self, node_key: str, index: int) -> Path: ...
    def worker_root_pids(self, node_key: str, index: int) -> list[int]: ...
    def close(self) -> None: ...


@dataclass
class Delays:
    """Seconds each transition takes (the real service takes minutes; tests want milliseconds)."""

    create: float = 1.0
    delete: float = 0.5
    stop: float = 0.5
    start: float = 0.5
    update: float = 0.1
    queue: float = 1.0  # WAITING_FOR_RESOURCES -> PROVISIONING once capacity is free

    def update_from(self, values: dict[str, Any]) -> None:
        for k, v in values.items():
            if k not in self.__dataclass_fields__:
                raise ApiError(400, f"unknown delay '{k}' (known: {', '.join(self.__dataclass_fields__)})")
            setattr(self, k, float(v))


@dataclass
class Capacity:
    """Free capacity per (zone or '*', generation), in chips or hosts; absent = unlimited."""

    limits: dict[tuple[str, str], tuple[int, str]] = field(default_factory=dict)

    @staticmethod
    def parse(spec: str) -> tuple[tuple[str, str], tuple[int, str]]:
        """'v4=32' (chips, any zone), 'us-central2-b/v4=8h' (hosts in one zone)."""
        try:
            where, amount = spec.split("=", 1)
            zone, _, gen = where.rpartition("/")
            unit = "hosts" if amount.endswith("h") else "chips"
            n = int(amount.rstrip("h").removesuffix("chips").removesuffix("host"))
        except ValueError as e:
            raise ApiError(400, f"bad capacity '{spec}': expected [ZONE/]GENERATION=N (chips) or =Nh (hosts)") from e
        if gen not in GENERATIONS:
            raise ApiError(400, f"bad capacity '{spec}': unknown generation '{gen}'")
        return (zone or "*", gen), (n, unit)

    def limit_for(self, zone: str, gen: str) -> tuple[int, str] | None:
        return self.limits.get((zone, gen)) or self.limits.get(("*", gen))


@dataclass
class EmulatorConfig:
    state_dir: Path
    delays: Delays = field(default_factory=Delays)
    capacity: Capacity = field(default_factory=Capacity)
    max_workers_per_node: int = 128
    request_log_size: int = 10_000


def set_enum(msg: Any, field_name: str, value: Any) -> None:
    """Assign a proto-plus enum field (its stubs type members as int, which mypy rejects)."""
    setattr(msg, field_name, value)


def now_rfc3339(t: float | None = None) -> str:
    d = _dt.datetime.fromtimestamp(time.time() if t is None else t, tz=_dt.timezone.utc)
    return d.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def to_json(msg: Any) -> dict[str, Any]:
    """A proto-plus message as the REST API's JSON (camelCase, enums by name, defaults omitted)."""
    text = type(msg).to_json(msg, use_integers_for_enums=False, indent=None, always_print_fields_with_no_presence=False)
    out: dict[str, Any] = json.loads(text)
    return out


def paged(key: str, items: list[Any], page_size: int, page_token: str, *, omit_empty: bool = False) -> dict[str, Any]:
    """A list response: one page of ITEMS under KEY plus nextPageToken when more follow.

    OMIT_EMPTY: proto3 JSON leaves out an empty repeated field (nodes, operations, queued resources)."""
    chunk, token = page(items, page_size, page_token)
    out: dict[str, Any] = {key: chunk} if chunk or not omit_empty else {}
    if token:
        out["nextPageToken"] = token
    return out


def page(items: list[Any], page_size: int, page_token: str, default_size: int = 1000) -> tuple[list[Any], str]:
    """One page of ITEMS plus the token of the next page ('' when this is the last)."""
    start = 0
    if page_token:
        try:
            start = int(base64.urlsafe_b64decode(page_token.encode()).decode().removeprefix("o:"))
        except (ValueError, UnicodeDecodeError) as e:
            raise invalid(f"Invalid page token '{page_token}'") from e
    if page_size < 0:
        raise invalid("page_size must not be negative")
    size = page_size or default_size
    chunk = items[start : start + size]
    nxt = start + size
    token = base64.urlsafe_b64encode(f"o:{nxt}".encode()).decode() if nxt < len(items) else ""
    return chunk, token


@dataclass
class Operation:
    name: str
    verb: str
    target: str
    created: float = field(default_factory=time.time)
    done: bool = False
    ended: float | None = None
    response: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    cancel_requested: bool = False

    def to_json(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "@type": METADATA_TYPE,
            "createTime": now_rfc3339(self.created),
            "target": self.target,
            "verb": self.verb,
            "cancelRequested": self.cancel_requested,
            "apiVersion": "v2",
        }
        if self.ended is not None:
            meta["endTime"] = now_rfc3339(self.ended)
        out: dict[str, Any] = {"name": self.name, "metadata": meta, "done": self.done}
        if self.error is not None:
            out["error"] = self.error
        elif self.response is not None:
            out["response"] = self.response
        return out


@dataclass
class NodeRecord:
    node: tpu_v2.Node
    topo: Topology
    project: str
    zone: str
    key: str  # WorkerHosts' handle for this node: its full name (hosts derives NODE_ID from it)
    slot: int = 0
    booted: bool = False
    ever_booted: bool = False  # WorkerHosts keeps homes and host keys of a stopped node
    holds: bool = True  # counted against zone capacity
    fail_with: ApiError | None = None  # decided at create time: why the create operation will fail
    lock: threading.RLock = field(default_factory=threading.RLock)  # serialises worker boot/shutdown

    @property
    def state(self) -> str:
        return tpu_v2.Node.State(self.node.state).name

    def set_state(self, s: str) -> None:
        self.node.state = getattr(tpu_v2.Node.State, s)


@dataclass
class QueuedRecord:
    qr: tpu_v2.QueuedResource
    project: str
    zone: str
    specs: list[tuple[str, tpu_v2.Node, Topology]]  # (node id, node template, topology)
    waiting_since: float = field(default_factory=time.time)
    deadline: float | None = None
    node_names: list[str] = field(default_factory=list)

    @property
    def state(self) -> str:
        return tpu_v2.QueuedResourceState.State(self.qr.state.state).name

    def set_state(self, s: str, error: ApiError | None = None) -> None:
        st = tpu_v2.QueuedResourceState(state=getattr(tpu_v2.QueuedResourceState.State, s))
        set_enum(st, "state_initiator", tpu_v2.QueuedResourceState.StateInitiator.SERVICE)
        if error is not None:
            st.failed_data = tpu_v2.QueuedResourceState.FailedData(
                error={"code": GRPC_CODES[error.status], "message": error.message}
            )
        self.qr.state = st


def split_name(name: str, kind: str) -> tuple[str, str, str]:
    """projects/P/locations/Z/KIND/ID -> (P, Z, ID)."""
    parts = name.split("/")
    if len(parts) != 6 or parts[0] != "projects" or parts[2] != "locations" or parts[4] != kind:
        raise invalid(f"Invalid resource name '{name}'")
    return parts[1], parts[3], parts[5]


def split_parent(parent: str) -> tuple[str, str]:
    parts = parent.split("/")
    if len(parts) != 4 or parts[0] != "projects" or parts[2] != "locations":
        raise invalid(f"Invalid parent '{parent}'")
    return parts[1], parts[3]


def check_zone(zone: str) -> None:
    if zone not in ZONES and not re.match(r"^[a-z]+-[a-z]+\d+-[a-z]$", zone):
        raise invalid(f"Invalid location '{zone}'")


class Emulator:
    """The whole emulated service. Thread-safe: HTTP handler threads and operation threads share it."""

    def __init__(self, hosts: HostsLike, config: EmulatorConfig) -> None:
        self.hosts = hosts
        self.config = config
        self.lock = threading.RLock()
        self.nodes: dict[str, NodeRecord] = {}
        self.ops: dict[str, Operation] = {}
        self.queued: dict[str, QueuedRecord] = {}
        self.request_log: list[dict[str, Any]] = []
        self._fail_rules: list[dict[str, Any]] = []
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self._scheduler = threading.Thread(target=self._schedule_loop, name="emulator-queue", daemon=True)
        self._scheduler.start()

    # ------------------------------------------------------------------ plumbing

    def _spawn(self, fn: Callable[..., None], *args: Any) -> None:
        t = threading.Thread(target=self._guard, args=(fn, *args), daemon=True)
        with self.lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
        t.start()

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # an operation thread must never die silently: log it for the admin
            self.log_event("internal-error", f"{fn.__name__}: {type(e).__name__}: {e}")

    def _sleep(self, seconds: float) -> bool:
        """Wait SECONDS; False when the emulator is shutting down."""
        return not self._closing.wait(max(0.0, seconds))

    def _new_op(self, project: str, zone: str, verb: str, target: str) -> Operation:
        op = Operation(
            name=f"projects/{project}/locations/{zone}/operations/operation-{int(time.time() * 1000)}-"
            f"{uuid.uuid4().hex[:24]}",
            verb=verb,
            target=target,
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

    def log_request(self, method: str, path: str, status: int, detail: str = "") -> None:
        with self.lock:
            self.request_log.append(
                {"time": now_rfc3339(), "method": method, "path": path, "status": status, "detail": detail}
            )
            del self.request_log[: -self.config.request_log_size]

    def _persist_pids(self) -> None:
        """Worker init pids in the state dir: `tpurun emulator stop` kills them if the server cannot."""
        pids: dict[str, list[int]] = {}
        with self.lock:
            records = list(self.nodes.values())
        for rec in records:
            if rec.booted:
                try:
                    pids[rec.key] = [w.init_pid for w in self.hosts.workers(rec.key) if w.init_pid]
                except Exception:
                    pids[rec.key] = []
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
        used = 0
        for rec in self.nodes.values():
            if rec.zone == zone and rec.topo.generation == gen and rec.holds and rec.state in _HOLDING:
                used += rec.topo.chips if unit == "chips" else rec.topo.hosts
        return used

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
        if topo.hosts > self.config.max_workers_per_node:
            return ApiError(
                429,
                f"the tpurun emulator cannot host {topo.name}: it has {topo.hosts} workers and this emulator "
                f"holds at most {self.config.max_workers_per_node} per node (--max-workers)",
                "RESOURCE_EXHAUSTED",
            )
        return None

    def _free_slot(self, avoid: set[int] | None = None) -> int:
        used = {r.slot for r in self.nodes.values() if r.slot} | (avoid or set())
        for s in range(1, 251):  # WorkerHosts' slot range
            if s not in used and self._slot_free_on_host(s):
                return s
        raise self._no_capacity("emulator")

    def _slot_free_on_host(self, slot: int) -> bool:
        # Another emulator on this machine (a test session, say) may hold 127.77.SLOT.*: skip it.
        for port in {getattr(self.hosts, "ssh_port", 22), getattr(self.hosts, "metadata_port", 80)}:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((f"127.77.{slot}.1", port))
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
        return topo

    # ------------------------------------------------------------------ nodes

    def get_record(self, name: str) -> NodeRecord:
        with self.lock:
            rec = self.nodes.get(name)
        if rec is None:
            split_name(name, "nodes")
            raise not_found(name)
        return rec

    def find_node(self, ref: str) -> NodeRecord:
        """A node by full name or bare id (admin convenience)."""
        with self.lock:
            if ref in self.nodes:
                return self.nodes[ref]
            hits = [r for r in self.nodes.values() if r.node.name.rsplit("/", 1)[-1] == ref]
        if not hits:
            raise ApiError(404, f"no node named '{ref}'", "NOT_FOUND")
        if len(hits) > 1:
            raise ApiError(400, f"'{ref}' is ambiguous: {', '.join(h.node.name for h in hits)}; give the full name")
        return hits[0]

    def node_json(self, rec: NodeRecord) -> dict[str, Any]:
        with self.lock:
            return to_json(rec.node)

    def _get_metadata_fn(self, rec: NodeRecord) -> Callable[[], dict[str, str]]:
        def get() -> dict[str, str]:
            with self.lock:
                return dict(rec.node.metadata)

        return get

    def create_node(self, parent: str, node_id: str, node: tpu_v2.Node, queued_resource: str = "") -> dict[str, Any]:
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
            region = zone.rsplit("-", 1)[0]
            nc = node.network_config
            if not nc.network:
                nc.network = f"projects/{project}/global/networks/default"
            if not nc.subnetwork:
                nc.subnetwork = f"projects/{project}/regions/{region}/subnetworks/default"
            node.network_config = nc
            rec = NodeRecord(node=node, topo=topo, project=project, zone=zone, key=name)
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
                rec.slot = self._free_slot()
            slot = rec.slot
            project, zone = rec.project, rec.zone
        tried: set[int] = set()
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
                )
                break
            except OSError as e:
                # lost a race for the slot's addresses to another emulator on this machine: a fresh
                # node moves to another slot (a stopped one keeps its addresses, like a real VM)
                if e.errno != errno.EADDRINUSE or rec.ever_booted or len(tried) >= 5:
                    raise
                tried.add(slot)
                self.hosts.shutdown_node(rec.key, delete=True)
                with self.lock:
                    rec.slot = slot = self._free_slot(tried)
        with self.lock:
            rec.booted = rec.ever_booted = True
            external = bool(rec.node.network_config.enable_external_ips)
            rec.node.network_endpoints = [self._endpoint(w.address, external) for w in workers]
        self._persist_pids()

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
            with self.lock:
                rec.set_state("READY")
                set_enum(rec.node, "health", tpu_v2.Node.Health.HEALTHY)
                resp = {"@type": NODE_TYPE, **to_json(rec.node)}
            self._finish(op, resp)
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
            return paged("nodes", [to_json(r.node) for r in recs], page_size, page_token, omit_empty=True)

    def delete_node(self, name: str) -> dict[str, Any]:
        rec = self.get_record(name)
        with self.lock:
            if rec.state == "DELETING":
                raise ApiError(400, f"Node {name} is already being deleted.", "FAILED_PRECONDITION")
            rec.set_state("DELETING")
            set_enum(rec.node, "health", tpu_v2.Node.Health.HEALTH_UNSPECIFIED)
            op = self._new_op(rec.project, rec.zone, "delete", name)
        self._spawn(self._run_delete, rec, op)
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
                raise ApiError(
                    400,
                    f"Node {name} is in state {rec.state}; only a READY node can be stopped.",
                    "FAILED_PRECONDITION",
                )
            rec.set_state("STOPPING")
            op = self._new_op(rec.project, rec.zone, "stop", name)
        self._spawn(self._run_stop, rec, op)
        return op.to_json()

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
                raise ApiError(
                    400,
                    f"Node {name} is in state {rec.state}; only a STOPPED node can be started.",
                    "FAILED_PRECONDITION",
                )
            rec.set_state("STARTING")
            rec.holds = False
            fail = None if self._fits(rec.zone, rec.topo) else self._no_capacity(rec.zone)
            rec.holds = True
            op = self._new_op(rec.project, rec.zone, "start", name)
        self._spawn(self._run_start, rec, op, fail)
        return op.to_json()

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
            with self.lock:
                rec.set_state("READY")
                set_enum(rec.node, "health", tpu_v2.Node.Health.HEALTHY)
                resp = {"@type": NODE_TYPE, **to_json(rec.node)}
            self._finish(op, resp)

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
                raise ApiError(
                    400, f"Node {name} is in state {rec.state}; it cannot be updated now.", "FAILED_PRECONDITION"
                )
            op = self._new_op(rec.project, rec.zone, "update", name)
        self._spawn(self._run_update, rec, op, node, fields)
        return op.to_json()

    def _run_update(self, rec: NodeRecord, op: Operation, node: tpu_v2.Node, fields: list[str]) -> None:
        self._sleep(self.config.delays.update)
        refresh = False
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
                    refresh = dict(n.metadata).get("ssh-keys") != dict(node.metadata).get("ssh-keys")
                    n.metadata = dict(node.metadata)
                else:
                    nc = n.network_config
                    nc.enable_external_ips = node.network_config.enable_external_ips
                    n.network_config = nc
                    n.network_endpoints = [
                        self._endpoint(ep.ip_address, nc.enable_external_ips) for ep in n.network_endpoints
                    ]
            booted = rec.booted
        if refresh and booted:
            with rec.lock:
                self.hosts.refresh_ssh_keys(rec.key)
        with self.lock:
            resp = {"@type": NODE_TYPE, **to_json(rec.node)}
        self._finish(op, resp)

    def get_guest_attributes(self, name: str, query_path: str, worker_ids: list[str]) -> dict[str, Any]:
        rec = self.get_record(name)
        with self.lock:
            if rec.state != "READY" or not rec.booted:
                raise ApiError(
                    400,
                    f"Node {name} is in state {rec.state}; guest attributes are available only while it is READY.",
                    "FAILED_PRECONDITION",
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

    # ------------------------------------------------------------------ operations

    def get_operation(self, name: str) -> dict[str, Any]:
        with self.lock:
            op = self.ops.get(name)
            if op is None:
                raise not_found(name)
            return op.to_json()

    def list_operations(self, name: str, page_size: int, page_token: str) -> dict[str, Any]:
        project, zone = split_parent(name)
        with self.lock:
            ops = [
                o.to_json()
                for n, o in sorted(self.ops.items())
                if n.startswith(f"projects/{project}/locations/{zone}/")
            ]
        return paged("operations", ops, page_size, page_token, omit_empty=True)

    def delete_operation(self, name: str) -> None:
        with self.lock:
            if self.ops.pop(name, None) is None:
                raise not_found(name)

    def cancel_operation(self, name: str) -> None:
        # like most Google services: the request is recorded, the work carries on
        with self.lock:
            op = self.ops.get(name)
            if op is None:
                raise not_found(name)
            op.cancel_requested = True

    # ------------------------------------------------------------------ catalogue

    def list_accelerator_types(self, parent: str, page_size: int, page_token: str) -> dict[str, Any]:
        split_parent(parent)
        items = [self._accel_json(parent, t) for t in all_accelerator_types()]
        return paged("acceleratorTypes", items, page_size, page_token)

    def get_accelerator_type(self, name: str) -> dict[str, Any]:
        project, zone, t = split_name(name, "acceleratorTypes")
        if t not in all_accelerator_types():
            raise not_found(name)
        return self._accel_json(f"projects/{project}/locations/{zone}", t)

    @staticmethod
    def _accel_json(parent: str, t: str) -> dict[str, Any]:
        topo = parse_accelerator_type(t)
        return {
            "name": f"{parent}/acceleratorTypes/{t}",
            "type": t,
            "acceleratorConfigs": [{"type": topo.api_type, "topology": topo.topology}],
        }

    def list_runtime_versions(self, parent: str, page_size: int, page_token: str) -> dict[str, Any]:
        split_parent(parent)
        items = [{"name": f"{parent}/runtimeVersions/{v}", "version": v} for v in RUNTIME_VERSIONS]
        return paged("runtimeVersions", items, page_size, page_token)

    def get_runtime_version(self, name: str) -> dict[str, Any]:
        _, _, v = split_name(name, "runtimeVersions")
        if v not in RUNTIME_VERSIONS:
            raise not_found(name)
        return {"name": name, "version": v}

    def list_locations(self, project_name: str, page_size: int, page_token: str) -> dict[str, Any]:
        items = [{"name": f"{project_name}/locations/{z}", "locationId": z} for z in ZONES]
        return paged("locations", items, page_size, page_token)

    def get_location(self, name: str) -> dict[str, Any]:
        zone = name.rsplit("/", 1)[-1]
        if zone not in ZONES:
            raise not_found(name)
        return {"name": name, "locationId": zone}

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
        for spec in qr.tpu.node_spec:
            if spec.parent and spec.parent != parent:
                raise invalid(f"Invalid value for field 'node_spec.parent': '{spec.parent}' (must be '{parent}').")
            if spec.multislice_params and spec.multislice_params.node_count:
                ms = spec.multislice_params
                prefix = ms.node_id_prefix or qr_id
                ids = [f"{prefix}-{i}" for i in range(ms.node_count)]
            else:
                ids = [spec.node_id]
            for nid in ids:
                topo = self._validate_node(spec.node, nid)
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
            rec = QueuedRecord(qr=qr, project=project, zone=zone, specs=specs)
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

    def get_qr_record(self, name: str) -> QueuedRecord:
        with self.lock:
            rec = self.queued.get(name)
        if rec is None:
            split_name(name, "queuedResources")
            raise not_found(name)
        return rec

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
                raise ApiError(
                    400,
                    f"Queued resource {name} is in state {rec.state} and still has nodes ({', '.join(live)}); "
                    "delete them first or set force=true.",
                    "FAILED_PRECONDITION",
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
                raise ApiError(
                    400,
                    f"Queued resource {name} is in state {rec.state}; only FAILED or SUSPENDED "
                    "queued resources can be reset.",
                    "FAILED_PRECONDITION",
                )
            if any(n in self.nodes for n in rec.node_names):
                raise ApiError(
                    400, f"Queued resource {name} still has nodes; delete them first.", "FAILED_PRECONDITION"
                )
            rec.node_names = []
            rec.waiting_since = time.time()
            rec.set_state("WAITING_FOR_RESOURCES")
            op = self._new_op(rec.project, rec.zone, "reset", name)
            self._finish(op, {"@type": QR_TYPE, **to_json(rec.qr)})
        return op.to_json()

    def _schedule_loop(self) -> None:
        """Moves waiting queued resources to PROVISIONING when their capacity is free."""
        while self._sleep(0.05):
            try:
                self._schedule_once()
            except Exception as e:
                self.log_event("internal-error", f"queue scheduler: {type(e).__name__}: {e}")

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
                for nid, tmpl, _ in rec.specs:
                    node = tpu_v2.Node(tmpl)
                    if "spot" in rec.qr:  # an empty Spot message is falsy: test presence
                        node.scheduling_config = tpu_v2.SchedulingConfig(spot=True)
                    try:
                        self.create_node(parent, nid, node, queued_resource=rec.qr.name)
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

    # ------------------------------------------------------------------ faults and admin

    def preempt(self, ref: str, force: bool = False) -> dict[str, Any]:
        rec = self.find_node(ref)
        with self.lock:
            sc = rec.node.scheduling_config
            if not (sc.spot or sc.preemptible) and not force:
                raise ApiError(
                    400,
                    f"{rec.node.name} is not a spot or preemptible node, so Cloud TPU would not "
                    "preempt it; pass force to preempt it anyway.",
                )
            if rec.state != "READY":
                raise ApiError(400, f"{rec.node.name} is {rec.state}; only a running node can be preempted.")
        with rec.lock:
            self._shutdown(rec, delete=False)
            with self.lock:
                rec.set_state("PREEMPTED")
                set_enum(rec.node, "health", tpu_v2.Node.Health.HEALTH_UNSPECIFIED)
        self.log_event("preempt", rec.node.name)
        self._queued_node_changed(rec)
        return self.node_json(rec)

    def kill_worker(self, ref: str, index: int) -> None:
        rec = self._worker_check(ref, index)
        self.hosts.kill_worker(rec.key, index)
        self.log_event("kill-worker", f"{rec.node.name} worker {index}")
        self._persist_pids()

    def kill_sshd(self, ref: str, index: int) -> None:
        rec = self._worker_check(ref, index)
        self.hosts.kill_sshd(rec.key, index)
        self.log_event("kill-sshd", f"{rec.node.name} worker {index}")

    def _worker_check(self, ref: str, index: int) -> NodeRecord:
        rec = self.find_node(ref)
        if not rec.booted:
            raise ApiError(400, f"{rec.node.name} is {rec.state}: its workers are not running.")
        if not 0 <= index < rec.topo.hosts:
            raise ApiError(400, f"{rec.node.name} has workers 0..{rec.topo.hosts - 1}, not {index}.")
        return rec

    def node_info(self, ref: str) -> dict[str, Any]:
        rec = self.find_node(ref)
        workers = []
        if rec.booted:
            for w in self.hosts.workers(rec.key):
                workers.append(
                    {
                        "index": w.index,
                        "address": w.address,
                        "hostname": w.hostname,
                        "sshPort": w.ssh_port,
                        "hostKey": w.host_key,
                        "initPid": w.init_pid,
                        "startupLog": str(self.hosts.startup_log(rec.key, w.index)),
                        "rootPids": self.hosts.worker_root_pids(rec.key, w.index),
                        "startupExitCode": self._startup_code(rec.key, w.index),
                    }
                )
        return {"name": rec.node.name, "key": rec.key, "state": rec.state, "slot": rec.slot, "workers": workers}

    def _startup_code(self, key: str, index: int) -> int | None:
        fn = getattr(self.hosts, "startup_exit_code", None)  # optional in the hosts interface
        return fn(key, index) if fn is not None else None

    def status(self) -> dict[str, Any]:
        with self.lock:
            nodes = [
                {
                    "name": r.node.name,
                    "acceleratorType": r.topo.name,
                    "state": r.state,
                    "workers": r.topo.hosts,
                    "addresses": [ep.ip_address for ep in r.node.network_endpoints],
                }
                for r in sorted(self.nodes.values(), key=lambda r: r.node.name)
            ]
            queued = [{"name": q.qr.name, "state": q.state} for q in self.queued.values()]
            return {
                "nodes": nodes,
                "queuedResources": queued,
                "delays": self.config.delays.__dict__,
                "capacity": {f"{z}/{g}": f"{n} {u}" for (z, g), (n, u) in self.config.capacity.limits.items()},
                "maxWorkersPerNode": self.config.max_workers_per_node,
                "failRules": list(self._fail_rules),
            }

    def reset(self) -> None:
        """Delete every node and queued resource at once, forget operations, faults and the request log."""
        with self.lock:
            recs = list(self.nodes.values())
        for rec in recs:
            with rec.lock:
                try:
                    self._shutdown(rec, delete=True)
                finally:
                    self._remove(rec)
        with self.lock:
            self.nodes.clear()
            self.queued.clear()
            self.ops.clear()
            self._fail_rules.clear()
            self.request_log.clear()
        self._persist_pids()

    def close(self) -> None:
        """Stop background work, shut every worker down and release the hosts."""
        self._closing.set()
        with self.lock:
            # running nodes first: WorkerHosts waits for a stopped node's old pid namespaces to empty,
            # and a namespace inode the kernel reused for a running worker would stall that wait
            recs = sorted(self.nodes.values(), key=lambda r: not r.booted)
            threads = list(self._threads)
        for rec in recs:
            # a boot in progress finishes first (rec.lock), then is torn down
            with rec.lock:
                try:
                    self._shutdown(rec, delete=True)
                except Exception as e:
                    self.log_event("internal-error", f"shutdown {rec.key}: {e}")
        for t in threads:
            t.join(timeout=30)
        self.hosts.close()
        with self.lock:
            self.nodes.clear()
        self._persist_pids()
