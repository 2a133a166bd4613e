"""The control plane's way to Google's APIs: the Cloud TPU API (google-cloud-tpu, v2, REST) here, and
the retries and error messages Compute Engine's client (tpurun.cloud.compute) shares.

Every command goes through `Cloud`: it never knows whether the endpoint is Google or the local
emulator (which serves both APIs on one endpoint). Transient failures (429, 503, timeouts, dropped
connections) are retried with backoff and shown; everything else becomes an `ApiError` with a
message that says what to do.
"""

from __future__ import annotations

import concurrent.futures
import difflib
import functools
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from google.api_core import exceptions as gexc
from google.api_core import retry as gretry
from google.api_core.future import polling as gpolling
from google.cloud import tpu_v2

from tpurun import config
from tpurun.cloud import identity
from tpurun.cloud.services import (
    COMPUTE_API,
    TPU_API,
    Service,
    compute_endpoint,
    credentials,
)
from tpurun.errors import ApiError, NoSuchTpu
from tpurun.naming import validate_zone
from tpurun.settings import Layer, Setting, Settings

T = TypeVar("T")

log = logging.getLogger(__name__)

# the location that stands for every zone of a project when listing (AIP-159's "-" wildcard; the list's
# `unreachable` field names the zones that did not answer)
EVERY_ZONE = "-"

TRANSIENT = (
    gexc.TooManyRequests,
    gexc.ServiceUnavailable,
    gexc.DeadlineExceeded,
    gexc.InternalServerError,
    gexc.BadGateway,
    gexc.GatewayTimeout,
)


@dataclass(frozen=True)
class Backoff:
    """How `Cloud.call` retries a transient failure (google-api-core's Retry does the waiting, with jitter)."""

    attempts: int = 6
    first_delay: float = 1.0
    multiplier: float = 2.0
    max_delay: float = 20.0


def _transient(exc: Exception) -> bool:
    # requests' ConnectionError is an OSError: the endpoint is down or unreachable
    return isinstance(exc, TRANSIENT) or (isinstance(exc, OSError) and not isinstance(exc, gexc.GoogleAPIError))


def short_name(name: str) -> str:
    return name.rsplit("/", 1)[-1]


class Cloud:
    """Nodes, queued resources and operations in one project and zone."""

    def __init__(self, s: Settings, *, retry: Backoff | None = None, every_zone: bool = False) -> None:
        """EVERY_ZONE: a Cloud that lists the nodes of every zone of the project (no zone needed)."""
        self.project, self.zone = s.require_location(zone=not every_zone)
        if every_zone:
            self.zone = EVERY_ZONE
        else:
            validate_zone(self.zone)  # every command judges a zone the same way, before the API sees it
        self.endpoint = s.endpoint
        self.settings = s
        self.backends: dict[Any, Any] = {}  # tpurun.cloud.backend's, made once each per Cloud
        self.parent = f"projects/{self.project}/locations/{self.zone}"
        self.retry = retry or Backoff(
            first_delay=config.RETRY_DELAY.number(),
            attempts=config.RETRY_ATTEMPTS.integer(),
        )
        self.credentials = credentials(self.endpoint)
        self.client = tpu_v2.TpuClient(
            transport="rest", client_options={"api_endpoint": self.endpoint}, credentials=self.credentials
        )

    # ------------------------------------------------------------------ plumbing

    def node_path(self, name: str) -> str:
        return name if name.startswith("projects/") else f"{self.parent}/nodes/{name}"

    def qr_path(self, name: str) -> str:
        return name if name.startswith("projects/") else f"{self.parent}/queuedResources/{name}"

    def call(self, what: str, fn: Callable[[], T], *, node: str | None = None, api: Service = TPU_API) -> T:
        """FN with transient errors retried (each retry logged as a warning), other API errors mapped to
        clear messages (NODE: the TPU a NotFound is about)."""
        try:
            return self._retry(what, api)(lambda: _unwrap_retry_error(what, fn))()
        except gexc.GoogleAPICallError as exc:
            raise self.explain(what, exc, node, api) from None

    def find(self, what: str, fn: Callable[[], T], *, api: Service = TPU_API) -> T | None:
        """FN's answer, or None when the API says it does not exist (other failures retried and explained
        like `call`)."""

        def get() -> T | None:
            try:
                return fn()
            except gexc.NotFound:
                return None

        return self.call(what, get, api=api)

    def _retry(self, what: str, api: Service = TPU_API) -> gretry.Retry:
        """google-api-core's Retry for transient failures of WHAT: each retry logged as a warning, an
        `ApiError` after the last attempt."""
        failures = 0

        def on_error(exc: Exception) -> None:
            nonlocal failures
            failures += 1
            if failures >= self.retry.attempts:
                raise self._gave_up(what, exc, failures, api) from None
            if isinstance(exc, gexc.GoogleAPICallError):
                why = f"{exc.code} {_api_message(exc)}"
            else:
                why = f"cannot reach {self.endpoint}"
            log.warning("%s: %s; retrying (%d/%d)", what, why, failures, self.retry.attempts - 1)

        return gretry.Retry(
            predicate=_transient,
            initial=self.retry.first_delay,
            maximum=self.retry.max_delay,
            multiplier=self.retry.multiplier,
            timeout=None,
            on_error=on_error,
        )

    def _gave_up(self, what: str, exc: Exception, attempts: int, api: Service) -> ApiError:
        if isinstance(exc, gexc.GoogleAPICallError):
            return ApiError(
                f"{what} failed: the {api.title} kept answering {exc.code} ({_api_message(exc)}) after {attempts} "
                "attempts",
                hint="try again in a minute",
            )
        endpoint = self.endpoint if api is TPU_API else compute_endpoint(self.endpoint)
        return ApiError(
            f"{what} failed: cannot reach the {api.title} at {endpoint} ({exc.__class__.__name__})",
            hint="check TPURUN_API_ENDPOINT and your network; `tpurun emulator status` for the emulator",
        )

    def explain(
        self, what: str, exc: gexc.GoogleAPICallError, node: str | None = None, api: Service = TPU_API
    ) -> ApiError:
        # REST errors arrive as HTTP classes (Forbidden, Conflict, ...), failed operations as gRPC ones
        msg = _api_message(exc)
        where = f"project {self.project}, zone {self.zone}"
        if isinstance(exc, gexc.PermissionDenied | gexc.Forbidden):
            return ApiError(
                f"{what}: permission denied in {where}: {msg}",
                hint=f"your account needs {api.roles} on the project, and the {api.title} enabled "
                f"(gcloud services enable {api.host})",
            )
        if isinstance(exc, gexc.NotFound):
            if node:
                return self.no_such_tpu(node)
            return ApiError(f"{what}: not found in {where}: {msg}", hint="`tpurun list` shows the TPUs that exist")
        if isinstance(exc, gexc.ResourceExhausted | gexc.TooManyRequests):
            return ApiError(
                f"{what}: out of capacity or quota in {where}: {msg}",
                hint="retry with --spot, wait in line with --queued, or try another zone",
            )
        if isinstance(exc, gexc.AlreadyExists | gexc.Conflict):
            return ApiError(
                f"{what}: already exists in {where}: {msg}",
                hint="choose another name, `tpurun attach` the existing node, or delete it first",
            )
        if isinstance(exc, gexc.InvalidArgument | gexc.FailedPrecondition | gexc.BadRequest):
            return ApiError(f"{what}: the {api.title} refused the request: {msg}")
        if isinstance(exc, gexc.Unauthenticated | gexc.Unauthorized):
            return ApiError(f"{what}: not authenticated: {msg}", hint="run `gcloud auth application-default login`")
        return ApiError(f"{what}: {api.title} error {exc.code}: {msg}")

    def no_such_tpu(self, name: str, named: Setting | None = None, *, local: bool = False) -> NoSuchTpu:
        """The one error every command gives for a TPU NAME that does not exist (exit code 3): with what tpurun
        remembers of it (deleted by tpurun, or since it last reached it), and what to do: the zone tpurun made it
        in, else what fits how NAME was given (NAMED: the TPU setting it came from, None for a command's
        argument; LOCAL: the command can run on this machine instead, with --local)."""
        known = identity.records(self.settings.home_path, self.project, name)
        message = f"no TPU named '{name}' in project {self.project}, zone {self.zone}" + identity.history(
            known, self.zone
        )
        others = [zone for zone, r in known.items() if zone != self.zone and r.endpoints is not None]
        if others:
            given = self.settings.zone
            hint = f"tpurun made {name} in zone {' and '.join(others)}: pass " + " or ".join(
                f"`--zone {z}`" for z in others
            )
            hint += f"; the zone here comes from {given.source}" if given.layer is Layer.ENV else ""
        elif named is not None and named.default:
            hint = (
                f"it is the default TPU here ({named.source}): `tpurun create {name} -t TYPE` makes it"
                f"{' again' if known else ''}, `tpurun attach NAME` makes another the default"
                + (", or pass --local" if local else "")
            )
        elif named is not None and named.layer is Layer.RECORD:
            hint = f"{named.source} names it; `tpurun jobs --prune` forgets the jobs whose TPU is gone"
        else:
            similar = self.similar_names(name)
            hint = f"did you mean {', '.join(similar)}?" if similar else "`tpurun list` shows the TPUs that exist"
        return NoSuchTpu(message, hint=hint)

    def compute_get(self, path: str) -> dict[str, Any] | None:
        """Compute Engine's resource PATH of the project (`zones/Z/instances/N`) as its REST JSON, None where it
        does not exist: one plain GET, retried and explained as `call` does, without Compute Engine's client
        (whose import costs two seconds of CPU, for commands that need one resource or none)."""
        url = f"{compute_endpoint(self.endpoint)}/compute/v1/projects/{self.project}{'/' if path else ''}{path}"

        def get() -> dict[str, Any]:
            response = self._compute_session.get(url, timeout=60)
            if response.status_code >= 400:
                raise gexc.from_http_response(response)
            return dict(response.json())

        return self.find(f"get {path or 'the project'}", get, api=COMPUTE_API)

    @functools.cached_property
    def _compute_session(self) -> Any:
        """The one authorized HTTP session of `compute_get`'s GETs: a command's few share one connection."""
        from google.auth.transport.requests import AuthorizedSession

        return AuthorizedSession(self.credentials)

    def compute_has(self, path: str) -> bool:
        """Whether Compute Engine has the resource PATH of the project (see `compute_get`)."""
        return self.compute_get(path) is not None

    def similar_names(self, name: str) -> list[str]:
        try:
            names = [short_name(n.name) for n in self.client.list_nodes(parent=self.parent)]
        except gexc.GoogleAPICallError:
            return []
        return difflib.get_close_matches(name, names, n=3, cutoff=0.5)

    # ------------------------------------------------------------------ nodes

    def get_node(self, name: str) -> tpu_v2.Node:
        return self.call(f"get {name}", lambda: self.client.get_node(name=self.node_path(name)), node=name)

    def find_node(self, name: str) -> tpu_v2.Node | None:
        """NAME's node, or None when there is none."""
        return self.find(f"get {name}", lambda: self.client.get_node(name=self.node_path(name)))

    def list_nodes(self) -> list[tpu_v2.Node]:
        """The nodes of the zone (of every zone, for a Cloud made with every_zone; zones the API could not
        reach then are logged as a warning)."""

        def pages() -> tuple[list[tpu_v2.Node], list[str]]:
            nodes: list[tpu_v2.Node] = []
            unreachable: list[str] = []
            for page in self.client.list_nodes(parent=self.parent).pages:
                nodes += page.nodes
                unreachable += page.unreachable
            return nodes, unreachable

        nodes, unreachable = self.call("list nodes", pages)
        if unreachable:
            log.warning("the Cloud TPU API could not list the nodes of %s", ", ".join(sorted(set(unreachable))))
        return nodes

    # ------------------------------------------------------------------ v2alpha1: maintenance

    @functools.cached_property
    def alpha(self) -> Any:
        """Cloud TPU v2alpha1, through Google's discovery-based client and the API description it ships
        (google-cloud-tpu's v2alpha1 client speaks gRPC only): the maintenance of nodes is read and started
        through it, the one API version that has those methods (imported on first use)."""
        from googleapiclient import discovery

        return discovery.build(
            "tpu",
            "v2alpha1",
            credentials=self.credentials,
            client_options={"api_endpoint": self.endpoint},
            static_discovery=True,
            cache_discovery=False,
        )

    @staticmethod
    def _execute(request: Any) -> Any:
        """A discovery request's answer; its HTTP error raised as google-api-core's exception for it (what
        `call` retries and explains)."""
        from googleapiclient.errors import HttpError

        try:
            return request.execute(num_retries=0)
        except HttpError as exc:
            raise gexc.from_http_status(exc.status_code, exc.reason or str(exc)) from None

    def get_node_maintenance(self, name: str) -> dict[str, Any] | None:
        """NAME's `upcomingMaintenance` (the REST resource's JSON), None when none is announced or NAME is gone."""
        request = self.alpha.projects().locations().nodes().get(name=self.node_path(name))
        node = self.find(f"read the maintenance of {name}", lambda: self._execute(request))
        return node.get("upcomingMaintenance") if node else None

    def list_node_maintenance(self) -> dict[str, dict[str, Any]]:
        """The `upcomingMaintenance` of every node of the zone that has one, by the node's short name."""
        nodes = self.alpha.projects().locations().nodes()

        def pages() -> list[dict[str, Any]]:
            found: list[dict[str, Any]] = []
            request = nodes.list(parent=self.parent)
            while request is not None:
                answer = self._execute(request)
                found += answer.get("nodes", [])
                request = nodes.list_next(request, answer)
            return found

        listed = self.call("list the maintenance of nodes", pages)
        return {short_name(n["name"]): n["upcomingMaintenance"] for n in listed if n.get("upcomingMaintenance")}

    def perform_maintenance(self, name: str) -> None:
        """Start NAME's pending maintenance now (nodes.performMaintenance) and wait for the API to take it."""
        request = self.alpha.projects().locations().nodes().performMaintenance(name=self.node_path(name), body={})
        self._alpha_wait(f"start the maintenance of {name}", request, name)

    def perform_queued_maintenance(self, name: str, node_names: list[str]) -> None:
        """Start the pending maintenance of the slices NODE_NAMES of queued resource NAME now."""
        request = (
            self.alpha.projects()
            .locations()
            .queuedResources()
            .performMaintenanceQueuedResource(name=self.qr_path(name), body={"nodeNames": node_names})
        )
        self._alpha_wait(f"start the maintenance of {name}", request, name)

    def _alpha_wait(self, what: str, request: Any, name: str, timeout: float = 1800) -> None:
        """REQUEST's operation, until it is done (ApiError after TIMEOUT, as `wait`); its error raised."""
        op = self.call(what, lambda: self._execute(request), node=name)
        get = functools.partial(self.alpha.projects().locations().operations().get, name=op["name"])
        deadline = time.monotonic() + timeout
        for _ in self.iter_poll():
            if op.get("done"):
                break
            if time.monotonic() > deadline:
                raise ApiError(f"{what}: not done after {timeout:.0f} s", hint=f"`tpurun describe {name}` shows it")
            op = self.call(what, lambda: self._execute(get()))
        if op.get("error"):
            raise ApiError(f"{what}: {op['error'].get('message', op['error'])}")

    def create_node(self, node_id: str, node: tpu_v2.Node) -> Any:
        return self.call(
            f"create {node_id}",
            lambda: self.client.create_node(parent=self.parent, node=node, node_id=node_id),
        )

    def delete_node(self, name: str) -> Any:
        return self.call(f"delete {name}", lambda: self.client.delete_node(name=self.node_path(name)), node=name)

    def stop_node(self, name: str) -> Any:
        return self.call(
            f"stop {name}", lambda: self.client.stop_node(request={"name": self.node_path(name)}), node=name
        )

    def start_node(self, name: str) -> Any:
        return self.call(
            f"start {name}", lambda: self.client.start_node(request={"name": self.node_path(name)}), node=name
        )

    def update_metadata(self, name: str, metadata: dict[str, str]) -> Any:
        """Replace the node's whole metadata map (callers merge first: the API replaces it all)."""
        node = tpu_v2.Node(name=self.node_path(name), metadata=metadata)
        return self.call(
            f"update metadata of {name}",
            lambda: self.client.update_node(node=node, update_mask={"paths": ["metadata"]}),
            node=name,
        )

    def guest_attributes(self, name: str, query_path: str = "") -> list[dict[tuple[str, str], str]]:
        """Per worker, {(namespace, key): value} under QUERY_PATH (e.g. "hostkeys/" or "tpurun/")."""
        resp = self.call(
            f"read guest attributes of {name}",
            lambda: self.client.get_guest_attributes(request={"name": self.node_path(name), "query_path": query_path}),
            node=name,
        )
        out: list[dict[tuple[str, str], str]] = []
        for ga in resp.guest_attributes:
            out.append({(item.namespace, item.key): item.value for item in ga.query_value.items})
        return out

    # ------------------------------------------------------------------ queued resources

    def create_queued_resource(self, qr_id: str, qr: tpu_v2.QueuedResource) -> Any:
        return self.call(
            f"create queued resource {qr_id}",
            lambda: self.client.create_queued_resource(
                parent=self.parent, queued_resource=qr, queued_resource_id=qr_id
            ),
        )

    def get_queued_resource(self, name: str) -> tpu_v2.QueuedResource:
        return self.call(
            f"get queued resource {name}", lambda: self.client.get_queued_resource(name=self.qr_path(name))
        )

    def find_queued_resource(self, name: str) -> tpu_v2.QueuedResource | None:
        """The queued resource NAME, or None when there is none."""
        return self.find(
            f"get queued resource {name}", lambda: self.client.get_queued_resource(name=self.qr_path(name))
        )

    def delete_queued_resource(self, name: str, *, force: bool = True) -> Any:
        return self.call(
            f"delete queued resource {name}",
            lambda: self.client.delete_queued_resource(request={"name": self.qr_path(name), "force": force}),
        )

    # ------------------------------------------------------------------ operations

    def wait(self, what: str, op: Any, *, timeout: float = 1800, on_poll: Callable[[], None] | None = None) -> Any:
        """The result of a long-running operation. google-api-core's operation polling does the waiting,
        every TPURUN_POLL_INTERVAL seconds (ON_POLL after each look that finds it running); each look is
        retried like `call` on a transient failure."""
        interval = config.POLL_INTERVAL.number()
        polling = gretry.Retry(
            predicate=gpolling.POLLING_PREDICATE,
            initial=interval,
            maximum=interval,
            multiplier=1.0,
            timeout=timeout,
            on_error=(lambda _exc: on_poll()) if on_poll else None,
        )
        try:
            # a fresh retry budget for each poll: transient errors spread over a long wait are not summed
            return op.result(retry=_PerCall(lambda: self._retry(what)), polling=polling)
        except concurrent.futures.TimeoutError:
            raise ApiError(f"{what}: still not done after {timeout:.0f} s", hint="check `tpurun list`") from None
        except gexc.GoogleAPICallError as exc:
            raise self.explain(what, exc) from None

    def wait_gone(
        self, what: str, gone: Callable[[], bool], *, on_poll: Callable[[], None] | None = None, timeout: float = 1800
    ) -> None:
        """Until GONE says a resource that is being deleted (by an operation tpurun does not hold: another
        command's, the TPU's watchdog's) is gone, looking every TPURUN_POLL_INTERVAL seconds (ON_POLL after
        each look that finds it still there); ApiError after TIMEOUT."""
        deadline = time.monotonic() + timeout
        for _ in self.iter_poll():
            if gone():
                return
            if on_poll is not None:
                on_poll()
            if time.monotonic() > deadline:
                raise ApiError(f"{what} is still being deleted after {timeout:.0f} s", hint="`tpurun list` shows it")

    def iter_poll(self, interval: float | None = None) -> Iterator[None]:
        interval = interval if interval is not None else config.POLL_INTERVAL.number()
        while True:
            yield None
            time.sleep(interval)


class _PerCall:
    """A retry policy made anew for each call it wraps (google-api-core applies `retry(func)` per poll)."""

    def __init__(self, make: Callable[[], gretry.Retry]) -> None:
        self.make = make

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:
        return self.make()(func)


def _unwrap_retry_error(what: str, fn: Callable[[], T]) -> T:
    """FN; when google-api-core's own retry inside it (operation polls: 10 s on 503) gave up, its last
    transient error counts as one failure of ours."""
    try:
        return fn()
    except gexc.RetryError as retry_error:
        if isinstance(retry_error.cause, TRANSIENT):
            raise retry_error.cause from None
        raise ApiError(f"{what} failed: {retry_error.message}", hint="try again in a minute") from None


def _api_message(exc: gexc.GoogleAPICallError) -> str:
    """The service's own words, without the "POST http://…: " prefix the REST transport adds."""
    return re.sub(r"^(GET|POST|PATCH|PUT|DELETE) \S+: ", "", _first_line(exc.message))


def _first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""
