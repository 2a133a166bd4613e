"""The emulator's data: the records it keeps (operations, nodes, queued resources), the error it
answers with, its settings (delays, capacity), the catalogue it offers, and helpers for the v2 API's
JSON shapes."""

from __future__ import annotations

import base64
import datetime as _dt
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from google.cloud import tpu_v2

from tpurun.emulator.alpha_shapes import to_alpha
from tpurun.topology import GENERATIONS, Topology

if TYPE_CHECKING:
    from tpurun.emulator.org import Organisation

NODE_TYPE = "type.googleapis.com/google.cloud.tpu.v2.Node"
SCHEDULED, UNSCHEDULED = "SCHEDULED", "UNSCHEDULED"  # a maintenance's type
PENDING, ONGOING = "PENDING", "ONGOING"  # a maintenance's status
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
    | {g.default_runtime for g in GENERATIONS.values() if g.default_runtime}
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
HOLDING_STATES = {"CREATING", "READY", "STARTING", "STOPPING", "RESTARTING", "REPAIRING", "DELETING"}


class ApiError(Exception):
    """An error the API answers with: HTTP status + Google status name + message."""

    def __init__(self, http: int, message: str, status: str | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.http = http
        self.status = status or STATUS_FOR_HTTP.get(http, "UNKNOWN")
        self.message = message
        self.reason = reason  # Compute Engine's `errors[].reason` (compute_model.compute_body)

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.http, "message": self.message, "status": self.status}}


def not_found(name: str) -> ApiError:
    return ApiError(404, f'Resource "{name}" was not found', "NOT_FOUND")


def invalid(message: str) -> ApiError:
    return ApiError(400, message, "INVALID_ARGUMENT")


def failed_precondition(message: str) -> ApiError:
    """The resource is not in a state the call can act on (the API's 400 FAILED_PRECONDITION)."""
    return ApiError(400, message, "FAILED_PRECONDITION")


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
        extra_tpu_env: Callable[[], dict[str, str]] | None = ...,
        vms: Any = ...,
        private: Callable[[int], bool] | None = ...,
    ) -> list[Any]: ...

    def shutdown_node(self, node_key: str, *, delete: bool = False) -> None: ...
    def refresh_ssh_keys(self, node_key: str) -> None: ...
    def refresh_access(self, node_key: str) -> None: ...
    def use_organisation(self, org: Organisation) -> None: ...
    def node_of_token(self, token: str) -> str | None: ...
    def kill_sshd(self, node_key: str, index: int) -> None: ...
    def kill_worker(self, node_key: str, index: int) -> None: ...
    def guest_attributes(self, node_key: str) -> list[dict[tuple[str, str], str]]: ...
    def workers(self, node_key: str) -> list[Any]: ...
    def startup_log(self, node_key: str, index: int) -> Path: ...
    def worker_root_pids(self, node_key: str, index: int) -> list[int]: ...
    def set_events(self, node_key: str, indices: list[int], events: dict[str, str | None]) -> None: ...
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
    notice: float = 60.0  # a simulated maintenance event's notice (the metadata changes about 60 s ahead)
    maintenance: float = 5.0  # how long a simulated maintenance keeps the host down

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


# The address plan of the emulated workers, decided here only. Every address of 127.0.0.0/8 is this machine's
# on Linux, so workers need no interface: they live in 127.77.0.0/16 (127.78.0.0/16 is the latency proxy's
# mirror of it, tpurun/testing/latency_proxy.py). Its /24s 127.77.S.0/24 are the slots S = 1..250, 254
# workers each (.1 to .254). A node takes as many consecutive slots as its workers need, from its first slot
# F: worker I's address is 127.77.(F + I // 254).(I % 254 + 1). A node of up to 254 workers has one slot (the
# address it always had), a v5p-8192's 1,024 workers take 5, TPU7x's largest slice (2,304 VMs) 10; 250 nodes
# of up to 254 workers fit at once. Every worker reaches every other at its address (one network namespace).
SLOTS = range(1, 251)
WORKERS_PER_SLOT = 254
# The largest slice of any TPU (TPU7x: 2,304 VMs): the most workers --max-workers lets a node have by default.
LARGEST_SLICE_WORKERS = 2304
# A VM without an external address (a private one) is reached only from inside its network, the workers' addresses
# above, and by IAP's TCP forwarding, whose connections come from 35.235.240.0/20, the range firewall rules name. The
# emulator's IAP connects from IAP_SOURCE, an address of 127.35.240.0/20 that stands in for that range, so a worker's
# init tells IAP's connections from this machine's (127.0.0.1) by their source address alone.
INTERNAL_NETWORK = "127.77.0.0/16"
IAP_RANGE = "35.235.240.0/20"
IAP_STAND_IN = "127.35.240.0/20"
IAP_SOURCE = "127.35.240.1"


def slots_for(workers: int) -> int:
    """How many consecutive slots a node of WORKERS workers takes."""
    return max(1, -(-workers // WORKERS_PER_SLOT))


def worker_address(first_slot: int, index: int) -> str:
    """The address of worker INDEX of the node whose first slot is FIRST_SLOT."""
    return f"127.77.{first_slot + index // WORKERS_PER_SLOT}.{index % WORKERS_PER_SLOT + 1}"


def default_max_workers() -> int:
    """--max-workers when not given: the largest slice, fewer where this machine's free memory would not hold
    that many workers as tpurun makes them (16 MiB each: an idle worker costs under 1, tpurun's watchdog on
    each about 12, a command running more), but never fewer than one slot's."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(ln.split()[1]) for ln in f if ln.startswith("MemAvailable:")) // 1024
    except (OSError, StopIteration, ValueError):
        return LARGEST_SLICE_WORKERS
    return max(WORKERS_PER_SLOT, min(LARGEST_SLICE_WORKERS, (avail - 1024) // 16))


# Under a parallel test run, the emulators that tests start themselves (`tpurun emulator start`) take these,
# the session's own emulators the rest (pytest_plugin)
STANDALONE_SLOTS = range(201, 251)


def parse_slots(text: str) -> range:
    """TPURUN_EMULATOR_SLOTS's FIRST-LAST (inside SLOTS) as a range; all of SLOTS when empty."""
    if not text:
        return SLOTS
    first, _, last = text.partition("-")
    chosen = range(int(first), int(last or first) + 1)
    if not chosen or chosen.start < SLOTS.start or chosen.stop > SLOTS.stop:
        raise ValueError(f"TPURUN_EMULATOR_SLOTS={text!r}: give FIRST-LAST within {SLOTS.start}-{SLOTS.stop - 1}")
    return chosen


@dataclass
class EmulatorConfig:
    state_dir: Path
    delays: Delays = field(default_factory=Delays)
    capacity: Capacity = field(default_factory=Capacity)
    max_workers_per_node: int = field(default_factory=default_max_workers)
    request_log_size: int = 10_000
    slots: range = SLOTS  # the share of them its nodes take (a parallel test run gives each emulator its own)


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
    api: str = "v2"  # the API version whose method made it (v2alpha1: the maintenance methods)

    def response_type(self, kind: str) -> str:
        """The type URL of its response, a KIND (Node, QueuedResource) of its API version."""
        return f"type.googleapis.com/google.cloud.tpu.{self.api}.{kind}"

    def to_json(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "@type": METADATA_TYPE.replace(".v2.", f".{self.api}."),
            "createTime": now_rfc3339(self.created),
            "target": self.target,
            "verb": self.verb,
            "cancelRequested": self.cancel_requested,
            "apiVersion": self.api,
        }
        if self.ended is not None:
            meta["endTime"] = now_rfc3339(self.ended)
        out: dict[str, Any] = {"name": self.name, "metadata": meta, "done": self.done}
        if self.error is not None:
            out["error"] = self.error
        elif self.response is not None:
            out["response"] = self.response
        if self.api == "v2alpha1":  # its response in its version's shape, wherever it is listed
            return to_alpha(out)
        return out


@dataclass
class Window:
    """One announced maintenance of one VM."""

    worker: int
    kind: str  # SCHEDULED | UNSCHEDULED
    start: float  # epoch seconds
    length: float  # seconds the host is down
    can_reschedule: bool = False
    status: str = PENDING
    now: threading.Event = field(default_factory=threading.Event)  # start it now (performMaintenance)

    def api(self) -> dict[str, Any]:
        """The APIs' UpcomingMaintenance (Cloud TPU's and Compute Engine's share these fields)."""
        return {
            "type": self.kind,
            "canReschedule": self.can_reschedule,
            "windowStartTime": now_rfc3339(self.start),
            "windowEndTime": now_rfc3339(self.start + self.length),
            "latestWindowStartTime": now_rfc3339(self.start),
            "maintenanceStatus": self.status,
        }

    def metadata(self) -> str:
        """The metadata server's `upcoming-maintenance` (snake_case)."""
        a = self.api()
        return json.dumps(
            {
                "type": a["type"],
                "can_reschedule": a["canReschedule"],
                "window_start_time": a["windowStartTime"],
                "window_end_time": a["windowEndTime"],
                "latest_window_start_time": a["latestWindowStartTime"],
                "maintenance_status": a["maintenanceStatus"],
            }
        )


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
    slice_of: SliceOf | None = None  # set for a node made by a multislice queued resource
    maintenance: Window | None = None  # announced and not over (maintenance.py)
    lock: threading.RLock = field(default_factory=threading.RLock)  # serialises worker boot/shutdown

    @property
    def state(self) -> str:
        return tpu_v2.Node.State(self.node.state).name

    def set_state(self, s: str) -> None:
        self.node.state = getattr(tpu_v2.Node.State, s)


@dataclass(frozen=True)
class SliceOf:
    """Where a multislice node sits: its slice, how many there are, and slice 0's node (its first worker
    is the coordinator every slice's `tpu-env` names)."""

    slice_id: int
    num_slices: int
    first: str  # full name of slice 0's node


@dataclass
class QueuedRecord:
    qr: tpu_v2.QueuedResource
    project: str
    zone: str
    specs: list[tuple[str, tpu_v2.Node, Topology]]  # (node id, node template, topology)
    multislice: bool = False  # the specs are the slices of one multislice request, in slice order
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
