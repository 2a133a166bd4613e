"""`list` and `describe`: what the APIs say of the zone's TPUs (of every zone) and of one, with what each
announces of maintenance, what its watchdogs report, its startup reports and its spend so far."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tpurun.cloud import autostop, identity, routing, spend, startup
from tpurun.cloud.backend import Backend
from tpurun.cloud.client import EVERY_ZONE, Cloud
from tpurun.cloud.provision import locate
from tpurun.cloud.views import READY, NodeView
from tpurun.errors import ApiError, TpurunError

log = logging.getLogger(__name__)


@dataclass
class Listed:
    """`tpurun list`: the TPUs of the zone (of every zone), and those tpurun knows in the project's other zones."""

    views: list[NodeView]
    elsewhere: list[tuple[str, str]] = field(default_factory=list)  # (name, zone), outside the zone listed

    def to_dict(self) -> list[dict[str, object]]:
        """`list --json`: each TPU listed (those of other zones only named, on stderr)."""
        return [v.to_dict() for v in self.views]


def list_tpus(cloud: Cloud) -> Listed:
    """The TPUs of the zone (of every zone), whoever made them, in name order; listing one zone, the TPUs tpurun
    remembers (as not deleted) in the project's other zones."""
    views = _listed(cloud)
    if cloud.zone == EVERY_ZONE:
        return Listed(views)
    return Listed(views, identity.elsewhere(cloud.settings.home_path, cloud.project, cloud.zone))


def _listed(cloud: Cloud) -> list[NodeView]:
    found, complete = routing.list_all(cloud)
    views = sorted(found, key=lambda v: (v.zone, v.name))
    makers = [routing.maker_of(cloud, v) for v in views]
    for maker in {id(m): m for m in makers}.values():
        _read_maintenance(maker, [v for v, m in zip(views, makers, strict=True) if m is maker])
    for v, act in zip(views, autostop.activities(list(zip(makers, views, strict=True))), strict=True):
        v.activity = act
    zones = None if cloud.zone == EVERY_ZONE else {cloud.zone}
    spend.price_listing(cloud.settings.home_path, cloud.project, zones, cloud.endpoint, views, complete=complete)
    return views


def describe(cloud: Cloud, name: str) -> NodeView:
    maker, view = locate(cloud, name)
    if view.gone and not view.slices:
        raise ApiError(f"{name}: the queued resource is {view.state} and none of its slices exists yet")
    view.with_reports(startup_reports(maker, view))
    _read_maintenance(maker, [view])
    view.activity = autostop.activity(maker, view)
    spend.price_listing(cloud.settings.home_path, cloud.project, set(), cloud.endpoint, [view], complete=False)
    return view


def _read_maintenance(maker: Backend, views: list[NodeView]) -> None:
    """The maintenance MAKER's API announces for VIEWS; a failure to read it (v2alpha1 not allowed, say) leaves it
    unknown, with a warning, and the rest of the answer stands."""
    try:
        maker.read_maintenance(views)
    except TpurunError as exc:
        log.warning("the maintenance announced could not be read: %s", exc.message)


def startup_reports(maker: Backend, view: NodeView) -> list[startup.StartupReport] | None:
    """Each worker's startup report, in worker order; None when the TPU is not READY or they cannot be read."""
    if set(view.states) != {READY}:
        return None
    try:
        return [startup.parse_report(a) for a in maker.guest_attributes(view, startup.NAMESPACE + "/")]
    except TpurunError:
        return None


def read_startup_reports(cloud: Cloud, name: str) -> list[startup.StartupReport]:
    """Each worker's startup report as its VM published it, in worker order (whatever the TPU's state)."""
    maker, view = locate(cloud, name)
    return [startup.parse_report(a) for a in maker.guest_attributes(view, startup.NAMESPACE + "/")]


