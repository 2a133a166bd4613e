"""Which backend (tpurun.cloud.backend) a TPU is made by: the one that made a TPU of a name (`locate`), every
TPU of both (`list_all`), and the one that makes a new TPU (`backend_for`). Above the interface and both
backends; each backend's module is imported only when it is asked for (Compute Engine's client takes a
second or two to import, and a command that finds its TPU through the Cloud TPU API never needs it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from tpurun.cloud.backend import Backend, Kind
from tpurun.cloud.client import EVERY_ZONE, Cloud
from tpurun.cloud.views import NodeView
from tpurun.errors import ApiError, UsageError
from tpurun.topology import Topology

log = logging.getLogger(__name__)


def backend_class(kind: Kind) -> type[Backend]:
    """The backend of KIND, its module imported now (and its API's client with it)."""
    if kind is Kind.TPU_API:
        from tpurun.cloud.tpu_api import TpuApi

        return TpuApi
    from tpurun.cloud.compute import Compute

    return Compute


def backends(cloud: Cloud) -> Iterator[Backend]:
    """Both backends, the Cloud TPU API's first; each made (and its client imported, Compute Engine's
    taking a second or two) only when the caller goes on to it, and once per Cloud."""
    for kind in Kind:
        if kind not in cloud.backends:
            cloud.backends[kind] = backend_class(kind)(cloud)
        yield cloud.backends[kind]


def of_kind(cloud: Cloud, kind: Kind) -> Backend:
    return next(b for b in backends(cloud) if b.kind is kind)


def maker_of(cloud: Cloud, view: NodeView) -> Backend:
    """The backend that made the TPU VIEW."""
    return of_kind(cloud, Kind(view.backend))


def backend_for(topo: Topology, asked: str | None) -> Kind:
    """Who makes TOPO: ASKED when it can, else the Cloud TPU API where it offers the type (v5p and v6e
    too: there every command works, multislice, queued resources and stop included), else Compute Engine."""
    kinds = [Kind(b) for b in topo.backends]
    if asked is None:
        return kinds[0]
    try:
        kind = Kind(asked)
    except ValueError:
        raise UsageError(f"--backend {asked}: choose compute or tpu-api") from None
    if kind not in kinds:
        makers = " and ".join(k.api_name for k in kinds)
        raise UsageError(f"--backend {asked}: {kind.api_name} does not make {topo.name}; {makers} does")
    return kind


def locate(cloud: Cloud, name: str, *, strict: bool = False) -> tuple[Backend, NodeView] | None:
    """The TPU NAME and the API that made it; None when neither has one. An API that cannot be asked (not
    enabled in the project, no permission) is passed over with a warning when the other says it has no
    such TPU; its failure is raised only when no API could answer, or, STRICT (a name to be taken), at all.
    Compute Engine's client is imported (a second) only when Compute Engine has something NAME could be: a
    name it does not know is answered fast."""
    failures: list[ApiError] = []
    answered = False
    for kind in Kind:
        try:
            if kind is Kind.COMPUTE and kind not in cloud.backends and not _compute_may_have(cloud, name):
                answered = True
                continue
            backend = of_kind(cloud, kind)
            view = backend.find(name)
        except ApiError as exc:
            failures.append(exc)
            continue
        if view is not None:
            return backend, view
        answered = True
    if failures and (strict or not answered):
        raise failures[0]
    for failure in failures:
        log.warning("%s (looking for %s there too)", failure.message, name)
    return None


def _compute_may_have(cloud: Cloud, name: str) -> bool:
    """Whether Compute Engine has what `Compute.find` would take for the TPU NAME: the instance group NAME, the
    VM NAME or the group of a first slice, NAME-0; asked by plain REST, without its client."""
    if cloud.zone == EVERY_ZONE:
        return False  # Compute.find finds none there either
    where = f"zones/{cloud.zone}"
    looks = (f"instanceGroupManagers/{name}", f"instances/{name}", f"instanceGroupManagers/{name}-0")
    return any(cloud.compute_has(f"{where}/{look}") for look in looks)


def _compute_has_any(cloud: Cloud) -> bool:
    """Whether the zone has any VM or instance group at all (what `Compute.all_tpus` would sort through): one
    item of each asked for by plain REST, so that a zone without any lists its TPUs without Compute Engine's
    client. Every zone at once is left to the client."""
    if cloud.zone == EVERY_ZONE:
        return True
    looks = (f"zones/{cloud.zone}/instances?maxResults=1", f"zones/{cloud.zone}/instanceGroupManagers?maxResults=1")
    return any((cloud.compute_get(look) or {}).get("items") for look in looks)


def list_all(cloud: Cloud) -> tuple[list[NodeView], bool]:
    """Every TPU of the zone, both APIs asked at once (Compute Engine's client takes a second to import,
    while the Cloud TPU API answers), and whether both answered. An API that cannot be asked is passed over
    with a warning, unless neither can."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(kind: Kind) -> list[NodeView] | ApiError:
        try:
            if kind is Kind.COMPUTE and kind not in cloud.backends and not _compute_has_any(cloud):
                return []
            return of_kind(cloud, kind).all_tpus()
        except ApiError as exc:
            return exc

    of_kind(cloud, Kind.TPU_API)  # made here: the threads then share the cached backends
    with ThreadPoolExecutor(max_workers=len(Kind)) as pool:
        answers = list(pool.map(ask, Kind))
    failures = [a for a in answers if isinstance(a, ApiError)]
    if len(failures) == len(answers):
        raise failures[0]
    for failure in failures:
        log.warning("%s; listing the other API's TPUs only", failure.message)
    return [v for a in answers if not isinstance(a, ApiError) for v in a], not failures
