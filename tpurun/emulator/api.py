"""HTTP front of the emulator: the Cloud TPU v2 REST surface (v2alpha1's, made of it, in alpha_api.py; Compute
Engine's in compute_api.py, OS Login's in oslogin_api.py, the Billing Catalog's in billing_api.py), IAP's TCP forwarding endpoint under /v4/ (iap.py, a
WebSocket upgrade of a GET) plus an admin interface.

The REST routes are the ones google-cloud-tpu's REST transport calls (see its
`services/tpu/transports/rest_base.py`); bodies are parsed with the package's own proto-plus
message types, so an unknown field is a 400 exactly where the real API would reject it. Errors are
Google's error JSON, so the client raises the same exceptions it raises against Google.

Admin and fault-injection routes live under /emulator/v1/, a prefix the real API never uses; they
are not part of the request log, which records only what a Cloud TPU client sent.
The server binds to 127.0.0.1 only: it grants root-made hosts to whoever can reach it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from google.cloud import tpu_v2

from tpurun.emulator.admin_client import ADMIN_PREFIX
from tpurun.emulator.alpha_api import add_v2alpha1_routes
from tpurun.emulator.billing_api import add_billing_routes
from tpurun.emulator.compute_api import COMPUTE_PREFIX, add_compute_routes
from tpurun.emulator.compute_model import compute_body
from tpurun.emulator.iap import TUNNEL_PREFIX, Tunnels
from tpurun.emulator.model import SCHEDULED, UNSCHEDULED, ApiError, invalid
from tpurun.emulator.oslogin_api import add_oslogin_routes
from tpurun.emulator.routing import SYSTEM_PARAMS, Request, Router, parse_message, render
from tpurun.emulator.state import Emulator

_PARENT = r"projects/[^/]+/locations/[^/:]+"
_ID = r"[^/:]+"


_PAGE = ("pageSize", "pageToken", "filter", "orderBy")  # the query parameters of every list call


def build_api_router(emu: Emulator) -> Router:
    """The Cloud TPU v2 REST surface, resource by resource; v2alpha1's, the same and its own methods (alpha_api);
    Compute Engine's under /compute/v1/; OS Login's under /v1/users/; the Billing Catalog's under /v1/services."""
    r = Router()
    for add in (_node_routes, _operation_routes, _catalogue_routes, _queued_routes, _location_routes):
        add(r, emu)
    add_v2alpha1_routes(r, emu)  # after v2's: it serves each of them again
    add_compute_routes(r, emu)
    add_oslogin_routes(r, emu)
    add_billing_routes(r, emu)
    return r


def _list_and_get(r: Router, collection: str, list_them: Callable[..., Any], get_one: Callable[[str], Any]) -> None:
    """A collection's List (a page of it under its location) and Get (one of it by its full name)."""
    r.add(
        "GET",
        f"/v2/(?P<parent>{_PARENT})/{collection}",
        lambda q: list_them(q.groups["parent"], q.q_int("pageSize"), q.q("pageToken")),
        _PAGE,
    )
    r.add("GET", f"/v2/(?P<name>{_PARENT}/{collection}/{_ID})", lambda q: get_one(q.groups["name"]))


def _node_routes(r: Router, emu: Emulator) -> None:
    """Nodes: create, list, get, delete, stop, start, update, guest attributes."""
    r.add(
        "POST",
        f"/v2/(?P<parent>{_PARENT})/nodes",
        lambda q: emu.create_node(q.groups["parent"], q.q("nodeId"), parse_message(tpu_v2.Node, q, "node")),
        ("nodeId", "requestId"),
    )
    _list_and_get(r, "nodes", emu.list_nodes, emu.get_node)
    r.add("DELETE", f"/v2/(?P<name>{_PARENT}/nodes/{_ID})", lambda q: emu.delete_node(q.groups["name"]), ("requestId",))

    def empty_body(q: Request) -> None:
        # stop/start carry no fields besides the name (in the path); anything else is unknown
        extra = list(q.json())
        if extra:
            raise invalid(f'Invalid JSON payload received. Unknown name "{extra[0]}": Cannot find field.')

    def stop(q: Request) -> Any:
        empty_body(q)
        return emu.stop_node(q.groups["name"])

    def start(q: Request) -> Any:
        empty_body(q)
        return emu.start_node(q.groups["name"])

    def update(q: Request) -> Any:
        node = parse_message(tpu_v2.Node, q, "node")
        node.name = q.groups["name"]
        return emu.update_node(node, q.q("updateMask"))

    def guest(q: Request) -> Any:
        body = parse_message(tpu_v2.GetGuestAttributesRequest, q, "")
        return emu.get_guest_attributes(q.groups["name"], body.query_path, list(body.worker_ids))

    r.add("POST", f"/v2/(?P<name>{_PARENT}/nodes/{_ID}):stop", stop)
    r.add("POST", f"/v2/(?P<name>{_PARENT}/nodes/{_ID}):start", start)
    r.add("PATCH", f"/v2/(?P<name>{_PARENT}/nodes/{_ID})", update, ("updateMask",))
    r.add("POST", f"/v2/(?P<name>{_PARENT}/nodes/{_ID}):getGuestAttributes", guest)


def _operation_routes(r: Router, emu: Emulator) -> None:
    """Long-running operations."""
    _list_and_get(r, "operations", emu.list_operations, emu.get_operation)

    def op_delete(q: Request) -> Any:
        emu.delete_operation(q.groups["name"])
        return {}

    def op_cancel(q: Request) -> Any:
        emu.cancel_operation(q.groups["name"])
        return {}

    r.add("DELETE", f"/v2/(?P<name>{_PARENT}/operations/{_ID})", op_delete)
    r.add("POST", f"/v2/(?P<name>{_PARENT}/operations/{_ID}):cancel", op_cancel)


def _catalogue_routes(r: Router, emu: Emulator) -> None:
    """Accelerator types and runtime versions."""
    _list_and_get(r, "acceleratorTypes", emu.list_accelerator_types, emu.get_accelerator_type)
    _list_and_get(r, "runtimeVersions", emu.list_runtime_versions, emu.get_runtime_version)


def _queued_routes(r: Router, emu: Emulator) -> None:
    """Queued resources."""
    r.add(
        "POST",
        f"/v2/(?P<parent>{_PARENT})/queuedResources",
        lambda q: emu.create_queued_resource(
            q.groups["parent"], q.q("queuedResourceId"), parse_message(tpu_v2.QueuedResource, q, "queued_resource")
        ),
        ("queuedResourceId", "requestId"),
    )
    _list_and_get(r, "queuedResources", emu.list_queued_resources, emu.get_queued_resource)
    r.add(
        "DELETE",
        f"/v2/(?P<name>{_PARENT}/queuedResources/{_ID})",
        lambda q: emu.delete_queued_resource(q.groups["name"], q.q_bool("force")),
        ("requestId", "force"),
    )
    r.add(
        "POST",
        f"/v2/(?P<name>{_PARENT}/queuedResources/{_ID}):reset",
        lambda q: emu.reset_queued_resource(q.groups["name"]),
    )


def _location_routes(r: Router, emu: Emulator) -> None:
    """Locations and the service identity."""
    r.add(
        "POST",
        f"/v2/(?P<parent>{_PARENT}):generateServiceIdentity",
        lambda q: {
            "identity": {"email": f"service-{q.groups['parent'].split('/')[1]}@cloud-tpu.iam.gserviceaccount.com"}
        },
    )
    r.add(
        "GET",
        "/v2/(?P<name>projects/[^/]+)/locations",
        lambda q: emu.list_locations(q.groups["name"], q.q_int("pageSize"), q.q("pageToken")),
        _PAGE,
    )
    r.add("GET", f"/v2/(?P<name>{_PARENT})", lambda q: emu.get_location(q.groups["name"]))


def _add_oslogin_admin(r: Router, emu: Emulator) -> None:
    """The administrator's OS Login routes: an account's one-time password now, its role in a project."""

    def security_code(q: Request) -> Any:
        email = unquote(q.groups["email"])
        return {"account": email, "code": emu.org.oslogin.security_code(email)}

    def oslogin_role(q: Request) -> Any:
        email, d = unquote(q.groups["email"]), q.json()
        project = str(d.get("project") or "")
        emu.org.oslogin.set_role(email, project, str(d.get("role") or ""))
        return {"account": email, "project": project, "role": emu.org.oslogin.role(email, project)}

    r.add("GET", f"{ADMIN_PREFIX}/oslogin/(?P<email>[^/:]+):security-code", security_code)
    r.add("POST", f"{ADMIN_PREFIX}/oslogin/(?P<email>[^/:]+):role", oslogin_role)


def build_admin_router(emu: Emulator, server: EmulatorServer) -> Router:
    r = Router()
    A = ADMIN_PREFIX
    r.add(
        "GET",
        f"{A}/status",
        lambda q: {"pid": _pid(), "port": server.port, "stateDir": str(emu.config.state_dir), **emu.status()},
    )

    def log(q: Request) -> Any:
        with emu.lock:
            return {"requests": list(emu.request_log)}

    def reset(q: Request) -> Any:
        emu.reset()
        return {}

    def shutdown(q: Request) -> Any:
        # answer first, then stop: the caller waits for the process to exit
        threading.Thread(target=server.stop, daemon=True).start()
        return {}

    def fail_api(q: Request) -> Any:
        d = q.json()
        emu.add_fail_rule(
            int(d.get("count", 1)), int(d.get("code", 503)), str(d.get("match", "")), str(d.get("message", ""))
        )
        return emu.status()

    def delays(q: Request) -> Any:
        emu.config.delays.update_from(q.json())
        return emu.status()

    def capacity(q: Request) -> Any:
        from tpurun.emulator.model import Capacity

        d = q.json()
        with emu.lock:
            if d.get("clear"):
                emu.config.capacity.limits.clear()
            for spec in d.get("specs", []):
                k, v = Capacity.parse(str(spec))
                emu.config.capacity.limits[k] = v
            if "maxWorkersPerNode" in d:
                emu.config.max_workers_per_node = int(d["maxWorkersPerNode"])
        return emu.status()

    def kill_worker(q: Request) -> Any:
        emu.kill_worker(unquote(q.groups["node"]), int(q.groups["i"]), q.json().get("zone") or None)
        return {}

    def kill_sshd(q: Request) -> Any:
        emu.kill_sshd(unquote(q.groups["node"]), int(q.groups["i"]), q.json().get("zone") or None)
        return {}

    def iap(q: Request) -> Any:
        d = q.json()
        emu.org.iap.set(bool(d.get("allow", True)), str(d.get("project") or ""))
        return emu.org.iap.describe()

    _add_oslogin_admin(r, emu)
    r.add("GET", f"{A}/requests", log)
    r.add("POST", f"{A}/reset", reset)
    r.add("POST", f"{A}/shutdown", shutdown)
    r.add("POST", f"{A}/fail-api", fail_api)
    r.add("POST", f"{A}/delays", delays)
    r.add("POST", f"{A}/capacity", capacity)
    r.add("POST", f"{A}/iap", iap)
    r.add("GET", f"{A}/nodes/(?P<node>.+)", lambda q: emu.node_info(unquote(q.groups["node"])))
    _host_event_routes(r, emu)
    r.add("POST", f"{A}/nodes/(?P<node>.+)/workers/(?P<i>\\d+):kill", kill_worker)
    r.add("POST", f"{A}/nodes/(?P<node>.+)/workers/(?P<i>\\d+):kill-sshd", kill_sshd)
    return r


def _host_event_routes(r: Router, emu: Emulator) -> None:
    """Admin: preempt a spot node or VM (after a notice), announce maintenance of a worker."""
    A = ADMIN_PREFIX

    def preempt(q: Request, instance: bool = False) -> Any:
        d = q.json()
        ref = unquote(q.groups["ref"])
        emu.preempt_after(ref, float(d.get("notice", 0)), force=bool(d.get("force")), instance=instance)
        return emu.get_instance(emu.find_instance(ref).path) if instance else emu.node_json(emu.find_node(ref))

    def maintenance(q: Request) -> Any:
        d = q.json()
        kind = str(d.get("type", UNSCHEDULED))
        window = emu.announce_maintenance(
            unquote(q.groups["node"]),
            int(q.groups["i"]),
            float(d.get("notice", 0)),
            float(d.get("duration", emu.config.delays.maintenance)),
            kind,
            bool(d.get("canReschedule", kind == SCHEDULED)),
            d.get("zone") or None,
        )
        return window.api()

    r.add("POST", f"{A}/nodes/(?P<ref>.+):preempt", preempt)
    r.add("POST", f"{A}/instances/(?P<ref>.+):preempt", lambda q: preempt(q, instance=True))
    r.add("POST", f"{A}/nodes/(?P<node>.+)/workers/(?P<i>\\d+):maintenance", maintenance)


def _pid() -> int:
    import os

    return os.getpid()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as google-auth's requests session expects
    # an answer is two writes (head, then body): with Nagle the body waits for the client's delayed ACK of the head,
    # 40 ms a call on Linux (measured: an OS Login import took 45 ms, 2.5 ms without)
    disable_nagle_algorithm = True
    server: EmulatorServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # the request log replaces the stderr access log

    def _dispatch(self) -> None:
        srv = self.server
        if self.command == "GET" and self.path.startswith(TUNNEL_PREFIX):
            srv.tunnels.serve(self, srv.emu)  # the connection is the tunnel's from now on
            return
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        query = parse_qs(parts.query, keep_blank_values=True)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        is_api = not path.startswith(ADMIN_PREFIX)
        is_compute = path.startswith(COMPUTE_PREFIX)
        status: int = 200
        payload: Any = {}
        caller = "user"  # the emulator's own user: a call without credentials
        try:
            if is_api:
                fault = srv.emu.take_fault(self.command, path)
                if fault is not None:
                    raise fault
                if self.headers.get("Authorization"):
                    caller = srv.emu.check_caller(self.headers["Authorization"], path)
            router = srv.api if is_api else srv.admin
            hit = router.match(self.command, path)
            if hit is None:
                raise ApiError(
                    404, f"The requested URL {self.command} {path} was not found on this server.", "NOT_FOUND"
                )
            handler, groups, params = hit
            req = Request(self.command, path, query, body, groups)
            if is_api:
                for key in query:
                    if key not in params and key not in SYSTEM_PARAMS and not key.startswith("$"):
                        raise invalid(
                            f'Invalid JSON payload received. Unknown name "{key}": Cannot bind query parameter.'
                        )
            result = handler(req)
            payload = {} if result is None else result
            data = render(payload, req if is_api else None)
        except ApiError as e:
            status, payload = e.http, compute_body(e) if is_compute else e.body()
            data = json.dumps(payload, indent=2).encode()
        except Exception as e:  # a bug here must still answer like a server, not hang the client
            status = 500
            err = ApiError(500, f"Internal error in the tpurun emulator: {type(e).__name__}: {e}")
            payload = compute_body(err) if is_compute else err.body()
            data = json.dumps(payload).encode()
        if is_api:  # logged before it is answered: a caller that got its answer finds it in the log
            detail = parts.query
            if status >= 400:
                detail = (detail + " " if detail else "") + str(payload.get("error", {}).get("message", ""))
            srv.emu.log_request(self.command, path, status, detail, caller)
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _dispatch


class EmulatorServer(ThreadingHTTPServer):
    """The HTTP server; `port` is the one it bound (pass 0 to let the OS pick)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # a pod's tunnels open at once (socketserver's 5 made the rest wait a SYN retry)

    def __init__(self, emu: Emulator, port: int = 0, host: str = "127.0.0.1") -> None:
        super().__init__((host, port), _Handler)
        self.emu = emu
        self.api = build_api_router(emu)
        self.admin = build_admin_router(emu, self)
        self.tunnels = Tunnels()
        self.port = int(self.server_address[1])
        self.stopped = threading.Event()  # no longer answering
        self.closed = threading.Event()  # and every node torn down
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_thread(self) -> None:
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.1}, name="emulator-http", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop answering, then tear every node down (idempotent)."""
        if self.stopped.is_set():
            self.closed.wait()
            return
        self.stopped.set()
        self.shutdown()
        self.tunnels.close_all()
        try:
            self.emu.close()
        finally:
            self.server_close()
            self.closed.set()

    def wait(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.time() + timeout
        while not self.closed.wait(0.2):
            if end is not None and time.time() > end:
                return False
        return True
