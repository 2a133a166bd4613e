"""Compute Engine's calls, a part of tpurun's Compute backend: a client per kind of resource on the configured
endpoint, each call with tpurun's retries and error messages, and the long-running operations they wait on.

Long-running calls use each method's `_unary` form and wait with the operations client of the
operation's scope, on the same endpoint: the client's own `ExtendedOperation.result()` would poll
Google's public host whatever endpoint it was given.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TypeVar

from google.api_core import exceptions as gexc
from google.cloud import compute_v1

from tpurun.cloud.client import Cloud, short_name
from tpurun.cloud.services import COMPUTE_API, compute_endpoint, credentials
from tpurun.errors import ApiError

T = TypeVar("T")
DONE = compute_v1.Operation.Status.DONE
# how Compute Engine refuses to delete what it is deleting already
BEING_DELETED = ("being deleted", "not ready")


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


class ComputeCalls:
    """Compute Engine's clients in the configured project, zone and region, and the calls made with them."""

    def __init__(self, cloud: Cloud) -> None:
        self.cloud = cloud
        self.project, self.zone, self.region = cloud.project, cloud.zone, region_of(cloud.zone)
        options = {"api_endpoint": compute_endpoint(cloud.endpoint)}
        creds = credentials(cloud.endpoint)

        def client(cls: Callable[..., T]) -> T:
            return cls(transport="rest", client_options=options, credentials=creds)

        self.instances = client(compute_v1.InstancesClient)
        self.managers = client(compute_v1.InstanceGroupManagersClient)
        self.templates = client(compute_v1.RegionInstanceTemplatesClient)
        self.global_templates = client(compute_v1.InstanceTemplatesClient)
        self.policies = client(compute_v1.ResourcePoliciesClient)
        self.zone_ops = client(compute_v1.ZoneOperationsClient)
        self.region_ops = client(compute_v1.RegionOperationsClient)
        self.global_ops = client(compute_v1.GlobalOperationsClient)

    def call(self, what: str, fn: Callable[[], T], *, tpu: str | None = None) -> T:
        return self.cloud.call(what, fn, node=tpu, api=COMPUTE_API)

    def find(self, what: str, fn: Callable[[], T]) -> T | None:
        return self.cloud.find(what, fn, api=COMPUTE_API)

    # ------------------------------------------------------------------ operations

    def operate(
        self,
        what: str,
        call: Callable[[], compute_v1.Operation],
        timeout: float,
        on_poll: Callable[[], None] | None = None,
        *,
        tpu: str | None = None,
        wait: bool = True,
        started: Callable[[], None] | None = None,
    ) -> None:
        """CALL, a long-running method's `_unary` form; unless WAIT is off, until its operation is done.
        STARTED is told once the API took the call (what it makes may then need taking back)."""
        op = self.call(what, call, tpu=tpu)
        if started is not None:
            started()
        if wait:
            self.wait(what, op, timeout, on_poll)

    def wait(
        self, what: str, op: compute_v1.Operation, timeout: float, on_poll: Callable[[], None] | None = None
    ) -> None:
        """Until OP is DONE (the API's own `wait` holds each call until then or for a while), then raise
        its error as the API would have answered it."""
        deadline = time.monotonic() + timeout
        while op.status != DONE:
            if time.monotonic() > deadline:
                raise ApiError(f"{what}: still not done after {timeout:.0f} s", hint="check `tpurun list`")
            if on_poll is not None:
                on_poll()
            op = self.call(what, functools.partial(self._poll, op))
        if op.http_error_status_code or op.error.errors:
            first = op.error.errors[0] if op.error.errors else None
            message = first.message if first else op.http_error_message
            code = first.code if first else ""
            # the error's own code first: Compute Engine answers a quota with 403, not a permission problem
            if "RESOURCE_POOL_EXHAUSTED" in code or "QUOTA" in code:
                raise ApiError(
                    f"{what}: out of {'quota' if 'QUOTA' in code else 'capacity'} in project {self.project}, "
                    f"zone {self.zone}: {message} ({code})",
                    hint="retry with --spot, try another zone, or ask for quota",
                )
            exc = gexc.from_http_status(op.http_error_status_code or 400, message, errors=list(op.error.errors))
            raise self.cloud.explain(what, exc, api=COMPUTE_API)

    def ask_delete(
        self, what: str, call: Callable[[], compute_v1.Operation], *, tpu: str | None = None
    ) -> compute_v1.Operation | None:
        """CALL, a deletion's `_unary` form: its operation; None when the API refuses because it is deleting that
        resource already (a deletion that was interrupted, which the API goes on with: `deleted` waits for it)."""
        try:
            return self.call(what, call, tpu=tpu)
        except ApiError as exc:
            if any(words in exc.message for words in BEING_DELETED):
                return None
            raise

    def deleted(
        self,
        what: str,
        op: compute_v1.Operation | None,
        get: Callable[[], object | None],
        on_poll: Callable[[], None] | None = None,
    ) -> None:
        """Until the deletion `ask_delete` asked for is done: OP, else until GET finds nothing."""
        if op is not None:
            self.wait(what, op, 1800, on_poll)
            return
        self.cloud.wait_gone(what, lambda: get() is None, on_poll=on_poll)

    def _poll(self, op: compute_v1.Operation) -> compute_v1.Operation:
        if op.zone:
            return self.zone_ops.wait(project=self.project, zone=short_name(op.zone), operation=op.name)
        if op.region:
            return self.region_ops.wait(project=self.project, region=short_name(op.region), operation=op.name)
        return self.global_ops.wait(project=self.project, operation=op.name)
