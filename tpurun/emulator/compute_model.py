"""The emulator's Compute Engine records and wire shapes: resource links, Compute Engine's error body, its
operations (zonal, regional and global, with `wait`), and the records of instances, managed instance groups
(MIGs) and resize requests.

Compute Engine answers differently from the Cloud TPU API: errors carry `errors[].reason` instead of a status
name; an operation is a resource of its own (`status` PENDING/RUNNING/DONE, `httpErrorStatusCode` and
`error.errors[].code` when it failed) in the scope of what it changes; links are full URLs under
https://www.googleapis.com/compute/v1/. Sources: docs/emulator.md.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from google.cloud import compute_v1

from tpurun.emulator.model import ApiError, Window, now_rfc3339, set_enum, to_json
from tpurun.topology import Topology

# the prefix of every link the real API answers with, whichever host the client called
API_ROOT = "https://www.googleapis.com/compute/v1/"
_ROOTS = (API_ROOT, "https://compute.googleapis.com/compute/v1/")

# the error reason each HTTP status carries in Compute Engine's error body
_REASONS = {
    400: "invalid",
    401: "required",
    403: "forbidden",
    404: "notFound",
    409: "alreadyExists",
    412: "conditionNotMet",
    429: "rateLimitExceeded",
    500: "backendError",
    503: "backendError",
    504: "backendError",
}
# the HTTP reason phrase a failed operation's httpErrorMessage carries
_HTTP_MESSAGES = {
    400: "BAD REQUEST",
    403: "FORBIDDEN",
    404: "NOT FOUND",
    409: "CONFLICT",
    412: "PRECONDITION FAILED",
    429: "TOO MANY REQUESTS",
    500: "INTERNAL SERVER ERROR",
    503: "SERVICE UNAVAILABLE",
}


def link(path: str) -> str:
    return API_ROOT + path


def path_of(ref: str) -> str:
    """A resource reference as a path: a full link loses its root ('projects/p/zones/z/...'), a partial one
    ('zones/z/machineTypes/m', 'global/instanceTemplates/t', a bare name) is kept as given."""
    for root in _ROOTS:
        if ref.startswith(root):
            return ref[len(root) :]
    return ref.removeprefix("/")


def full_path(ref: str, project: str, collection: str) -> str:
    """REF as a path from 'projects/': a link, a partial path ('global/instanceTemplates/t') or a bare name
    (then in COLLECTION, e.g. 'global/instanceTemplates')."""
    path = path_of(ref)
    if path.startswith("projects/"):
        return path
    return f"projects/{project}/{path if '/' in path else f'{collection}/{path}'}"


def compute_error(http: int, message: str, reason: str = "") -> ApiError:
    """An error answered in Compute Engine's shape (see `compute_body`)."""
    return ApiError(http, message, reason=reason or _REASONS.get(http, "backendError"))


def compute_body(err: ApiError) -> dict[str, Any]:
    """ERR as Compute Engine writes an error: its code and message, and the one `errors[]` item giving the
    reason (no `status` name, unlike the Cloud TPU API)."""
    reason = err.reason or _REASONS.get(err.http, "backendError")
    return {
        "error": {
            "code": err.http,
            "message": err.message,
            "errors": [{"message": err.message, "domain": "global", "reason": reason}],
        }
    }


def not_found(path: str) -> ApiError:
    return compute_error(404, f"The resource '{path}' was not found", "notFound")


def already_exists(path: str) -> ApiError:
    return compute_error(409, f"The resource '{path}' already exists", "alreadyExists")


def invalid_field(field_name: str, value: object, why: str) -> ApiError:
    return compute_error(400, f"Invalid value for field '{field_name}': '{value}'. {why}", "invalid")


def in_use(kind: str, path: str, user: str) -> ApiError:
    return compute_error(
        400, f"The {kind} resource '{path}' is already being used by '{user}'", "resourceInUseByAnotherResource"
    )


def new_id() -> int:
    return random.randint(10**18, 9 * 10**18)


def stamp(msg: Any, kind: str, path: str) -> None:
    """What the API sets on every resource it makes: its kind, a new id, its link and its creation time."""
    msg.kind = f"compute#{kind}"
    msg.id = new_id()
    msg.self_link = link(path)
    msg.creation_timestamp = now_rfc3339()


@dataclass(frozen=True)
class Failure:
    """Why an operation (or a MIG's attempt to make a VM) failed, as Compute Engine reports it: a code such as
    ZONE_RESOURCE_POOL_EXHAUSTED or QUOTA_EXCEEDED, a message, and the HTTP status the operation carries."""

    code: str
    message: str
    http: int

    def errors(self) -> dict[str, Any]:
        return {"errors": [{"code": self.code, "message": self.message}]}

    @staticmethod
    def of(err: ApiError) -> Failure:
        return Failure(err.reason or err.status, err.message, err.http)


def no_resources(zone: str, project: str) -> Failure:
    """What Compute Engine says when a zone has no capacity for a VM."""
    return Failure(
        "ZONE_RESOURCE_POOL_EXHAUSTED",
        f"The zone 'projects/{project}/zones/{zone}' does not have enough resources available to fulfill the "
        "request.  Try a different zone, or try again later.",
        503,
    )


class ComputeOperation:
    """One operation: the scope it lives in ('projects/p/zones/z', 'projects/p/regions/r', 'projects/p/global')
    and an event `wait` blocks on."""

    def __init__(self, scope: str, kind: str, target: str, target_id: int = 0) -> None:
        self.scope = scope
        self.name = f"operation-{int(time.time() * 1000)}-{random.getrandbits(48):012x}-{random.getrandbits(32):08x}"
        self.path = f"{scope}/operations/{self.name}"
        self.event = threading.Event()
        self.msg = compute_v1.Operation(
            kind="compute#operation",
            id=new_id(),
            name=self.name,
            operation_type=kind,
            target_link=link(target),
            status=compute_v1.Operation.Status.RUNNING,
            progress=0,
            user="user@emulated-project.iam.gserviceaccount.com",
            insert_time=now_rfc3339(),
            start_time=now_rfc3339(),
            self_link=link(self.path),
        )
        if target_id:
            self.msg.target_id = target_id
        where = scope.split("/")
        if where[2] == "zones":
            self.msg.zone = link(scope)
        elif where[2] == "regions":
            self.msg.region = link(scope)

    @property
    def done(self) -> bool:
        return self.event.is_set()

    def finish(self, failure: Failure | None = None) -> None:
        """DONE, failed with FAILURE when given (both httpErrorStatusCode and httpErrorMessage set, as the real
        service does: the client raises the HTTP status's exception only when both are there)."""
        if self.done:
            return
        if failure is not None:
            self.msg.error = compute_v1.Error(failure.errors())
            self.msg.http_error_status_code = failure.http
            self.msg.http_error_message = _HTTP_MESSAGES.get(failure.http, "ERROR")
        set_enum(self.msg, "status", compute_v1.Operation.Status.DONE)
        self.msg.progress = 100
        self.msg.end_time = now_rfc3339()
        self.event.set()

    def to_json(self) -> dict[str, Any]:
        return to_json(self.msg)


@dataclass
class Group:
    """The worker hosts of one or more instances, booted together (WorkerHosts' node): a standalone instance
    alone, or every VM of a MIG."""

    key: str  # WorkerHosts' handle: the instance's or the MIG's path
    project: str
    zone: str
    topo: Topology  # the slice (a MIG with a workload policy) or one VM's single-host slice
    machine_type: str
    slot: int = 0
    booted: bool = False
    ever_booted: bool = False
    members: list[str] = field(default_factory=list)  # the instances' paths, in worker order
    left: set[str] = field(default_factory=set)  # members a MIG abandoned: their VMs live on outside it
    lock: threading.RLock = field(default_factory=threading.RLock)


@dataclass
class InstanceRecord:
    inst: compute_v1.Instance
    path: str
    group: Group
    index: int  # its worker in the group
    mig: str = ""  # the path of the MIG that manages it
    maintenance: Window | None = None  # announced and not over (maintenance.py)


@dataclass
class MigRecord:
    igm: compute_v1.InstanceGroupManager
    path: str
    scope: str  # 'projects/p/zones/z' or 'projects/p/regions/r'
    zone: str  # where its VMs are
    template: compute_v1.InstanceTemplate
    policy: str  # the workload policy's path, or ''
    group: Group
    bulk: bool
    last_failure: Failure | None = None  # why its VMs could not be made yet
    deleting: bool = False
    emptying: bool = False  # a resize to 0 takes its VMs down
    created: float = field(default_factory=time.time)


@dataclass
class ResizeRecord:
    rr: compute_v1.InstanceGroupManagerResizeRequest
    path: str
    mig: str
    since: float = field(default_factory=time.time)
