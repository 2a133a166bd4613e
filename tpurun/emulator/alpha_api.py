"""Cloud TPU v2alpha1's REST front, as its discovery document describes it: every v2 method again under
/v2alpha1/ (nodes, queued resources, operations, accelerator types, runtime versions, guest attributes,
locations), its bodies checked against v2alpha1's own messages and put in v2's words for v2's handler, its
answers put back in v2alpha1's; and the methods only v2alpha1 has (maintenance, reservations).

Where the two versions differ in shape (google-cloud-tpu's v2alpha1 messages, tpu.v2alpha1 discovery):
a queued resource's slices are `multiNodeParams` in v2alpha1 and `multisliceParams` in v2, its spot request
may be the older `bestEffort`, and it may name a `provisioningModel` and `runDuration`; a node's scheduling
may name a `provisioningModel` and reservation; v2's `protectionTier` is not in v2alpha1's Node. What has no
v2 counterpart is accepted and has no effect, as stored-only fields elsewhere in the emulator.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from googleapiclient import discovery_cache

from tpurun.emulator.alpha_shapes import to_alpha
from tpurun.emulator.model import invalid, paged, split_parent
from tpurun.emulator.routing import Handler, Request, Router
from tpurun.emulator.state import Emulator

_PARENT = r"projects/[^/]+/locations/[^/:]+"
_ID = r"[^/:]+"

# a v2 route's path (after /v2/) -> the v2alpha1 schema its body is, and where in the request it sits
_BODIES: list[tuple[str, str, str, str]] = [
    ("POST", rf"{_PARENT}/nodes", "Node", "node"),
    ("PATCH", rf"{_PARENT}/nodes/{_ID}", "Node", "node"),
    ("POST", rf"{_PARENT}/queuedResources", "QueuedResource", "queued_resource"),
    ("POST", rf"{_PARENT}/nodes/{_ID}:getGuestAttributes", "GetGuestAttributesRequest", ""),
]
_EXTRA_PARAMS = {rf"{_PARENT}/operations": ("returnPartialSuccess",)}  # v2alpha1's list has it


def add_v2alpha1_routes(r: Router, emu: Emulator) -> None:
    """v2alpha1's twin of every v2 route R has so far, then its own methods."""
    for method, rx, handler, params in list(r.routes):
        if not rx.pattern.startswith("^/v2/"):
            continue
        tail = rx.pattern[len("^/v2/") : -1]
        body = next((m for verb, p, m, _ in _BODIES if verb == method and _same(p, tail)), None)
        where = next((w for verb, p, _, w in _BODIES if verb == method and _same(p, tail)), "")
        extra = next((e for p, e in _EXTRA_PARAMS.items() if method == "GET" and _same(p, tail)), ())
        r.add(method, f"/v2alpha1/{tail}", _twin(emu, handler, body, where), tuple(params) + extra)
    _maintenance_routes(r, emu)
    r.add(
        "GET",
        f"/v2alpha1/(?P<parent>{_PARENT})/reservations",
        lambda q: _reservations(q.groups["parent"], q.q_int("pageSize"), q.q("pageToken")),
        ("pageSize", "pageToken"),
    )


def _same(pattern: str, tail: str) -> bool:
    """Whether a v2 route's TAIL (its named groups kept) is PATTERN's path."""
    return re.sub(r"\(\?P<\w+>(.*?)\)(?=/|:|$)", r"\1", tail) == pattern


def _twin(emu: Emulator, handler: Handler, body: str | None, where: str) -> Handler:
    def run(q: Request) -> Any:
        if body is not None:
            d = checked(body, q, where)  # what v2alpha1 does not know is refused in its words
            q.body = json.dumps(_to_v2(body, d)).encode()
        answer = handler(q)
        if isinstance(answer, dict) and "/operations/" in str(answer.get("name", "")) and q.method != "GET":
            with emu.lock:  # an operation this version started says so (its metadata's apiVersion)
                op = emu.ops.get(answer["name"])
                if op is not None:
                    op.api = "v2alpha1"
                    answer = op.to_json()
        return to_alpha(answer)

    return run


def _maintenance_routes(r: Router, emu: Emulator) -> None:
    """The maintenance methods only v2alpha1 has."""

    def perform(q: Request) -> Any:
        checked("PerformMaintenanceRequest", q, "")
        return to_alpha(emu.perform_maintenance(q.groups["name"]))

    def simulate(q: Request) -> Any:
        body = checked("SimulateMaintenanceEventRequest", q, "")
        return to_alpha(emu.simulate_maintenance_event(q.groups["name"], list(body.get("workerIds", []))))

    def perform_queued(q: Request) -> Any:
        body = checked("PerformMaintenanceQueuedResourceRequest", q, "")
        return to_alpha(emu.perform_queued_maintenance(q.groups["name"], list(body.get("nodeNames", []))))

    r.add("POST", f"/v2alpha1/(?P<name>{_PARENT}/nodes/{_ID}):performMaintenance", perform)
    r.add("POST", f"/v2alpha1/(?P<name>{_PARENT}/nodes/{_ID}):simulateMaintenanceEvent", simulate)
    queued = f"/v2alpha1/(?P<name>{_PARENT}/queuedResources/{_ID})"
    r.add("POST", f"{queued}:performMaintenanceQueuedResource", perform_queued)
    r.add("GET", f"{queued}:getMaintenanceInfo", lambda q: emu.queued_maintenance_info(q.groups["name"]))


def _reservations(parent: str, page_size: int, page_token: str) -> dict[str, Any]:
    """reservations.list: the emulator's projects hold no reservations."""
    split_parent(parent)
    return paged("reservations", [], page_size, page_token, omit_empty=True)


# ---------------------------------------------------------------- request bodies, checked against the document


@functools.cache
def _schemas() -> dict[str, Any]:
    """v2alpha1's schemas, from the discovery document googleapiclient ships (the one its client is built from)."""
    doc = discovery_cache.get_static_doc("tpu", "v2alpha1")
    if doc is None:
        raise RuntimeError("googleapiclient ships no tpu v2alpha1 discovery document")
    schemas: dict[str, Any] = json.loads(doc)["schemas"]
    return schemas


def checked(schema: str, q: Request, where: str) -> dict[str, Any]:
    """Q's body, refused with the API's 400 where a field is not SCHEMA's or an enum's value is not one of its."""
    body = q.json()
    _check(body, {"$ref": schema}, where)
    return body


def _check(value: Any, spec: dict[str, Any], where: str) -> None:
    if "$ref" in spec:
        spec = _schemas()[spec["$ref"]]
    if "enum" in spec and value not in spec["enum"]:
        raise invalid(f"Invalid value at '{where}' (TYPE_ENUM), \"{value}\"")
    if spec.get("type") == "array" and isinstance(value, list):
        for i, item in enumerate(value):
            _check(item, spec.get("items", {}), f"{where}[{i}]")
    elif isinstance(value, dict) and "properties" in spec:
        for key, item in value.items():
            field = spec["properties"].get(key)
            if field is None:
                raise invalid(f'Invalid JSON payload received. Unknown name "{key}" at \'{where}\': Cannot find field.')
            _check(item, field, f"{where}.{_snake(key)}" if where else _snake(key))


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower()


# ---------------------------------------------------------------- v2alpha1 -> v2 (request bodies)


def _to_v2(schema: str, d: dict[str, Any]) -> dict[str, Any]:
    if schema == "Node":
        return _node_to_v2(d)
    if schema == "QueuedResource":
        return _qr_to_v2(d)
    return d


def _node_to_v2(d: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in d.items() if k != "autocheckpointEnabled"}
    sc = dict(out.get("schedulingConfig") or {})
    model = sc.pop("provisioningModel", "")
    if model == "SPOT":
        sc["spot"] = True
    elif model == "RESERVATION_BOUND":
        sc["reserved"] = True
    for gone in ("reservationName", "terminationTimestamp"):
        sc.pop(gone, None)
    if "schedulingConfig" in out:
        out["schedulingConfig"] = sc
    if "bootDiskConfig" in out:
        boot = out["bootDiskConfig"]
        out["bootDiskConfig"] = {k: v for k, v in boot.items() if k == "customerEncryptionKey"}
    if "dataDisks" in out:
        out["dataDisks"] = [{k: v for k, v in disk.items() if k != "workerIds"} for disk in out["dataDisks"]]
    return out


def _qr_to_v2(d: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in d.items() if k not in ("bestEffort", "provisioningModel", "runDuration")}
    if "bestEffort" in d or d.get("provisioningModel") == "SPOT":
        out["spot"] = {}
    if "guaranteed" in out:
        out["guaranteed"] = {k: v for k, v in out["guaranteed"].items() if k != "reserved"}
    specs = []
    for spec in (d.get("tpu") or {}).get("nodeSpec", []):
        s = {k: v for k, v in spec.items() if k != "multiNodeParams"}
        if "node" in s:
            s["node"] = _node_to_v2(s["node"])
        if "multiNodeParams" in spec:
            s["multisliceParams"] = {k: v for k, v in spec["multiNodeParams"].items() if k != "workloadType"}
        specs.append(s)
    if "tpu" in d:
        out["tpu"] = {**d["tpu"], "nodeSpec": specs}
    return out
