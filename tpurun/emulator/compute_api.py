"""The emulator's Compute Engine REST surface, under /compute/v1/ as the real API serves it: the paths
google-cloud-compute's REST transports call (each service's `transports/rest_base.py`) and discovery-based
clients build from the same API description. Bodies are parsed with compute_v1's own message types, so an
unknown field is a 400 where the real API would refuse it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from google.cloud import compute_v1

from tpurun.emulator import compute_catalogue
from tpurun.emulator.compute import ListQuery
from tpurun.emulator.compute_model import compute_error
from tpurun.emulator.routing import Request, Router, parse_message

if TYPE_CHECKING:
    from tpurun.emulator.state import Emulator

COMPUTE_PREFIX = "/compute/v1/"
_P = "/compute/v1/projects/(?P<project>[^/]+)"
_ID = "[^/]+"
_LIST = ("filter", "maxResults", "orderBy", "pageToken", "returnPartialSuccess")
_AGGREGATED = (*_LIST, "includeAllScopes", "serviceProjectNumber")
_SCOPES = {"zones": "zone", "regions": "region"}


def _query(q: Request) -> ListQuery:
    if q.q("orderBy"):
        raise compute_error(400, "The tpurun emulator lists in name order only (orderBy is not emulated).", "invalid")
    return ListQuery(q.q_int("maxResults"), q.q("pageToken"), q.q("filter"))


def add_compute_routes(r: Router, emu: Emulator) -> None:
    for add in (_projects, _operations, _policies, _templates, _instances, _groups, _resize_requests, _firewalls):
        add(r, emu)
    _catalogue(r)


def _catalogue(r: Router) -> None:
    """Regions, zones, machine types and accelerator types: list and get."""
    r.add("GET", f"{_P}/regions", lambda q: compute_catalogue.list_regions(_project(q), _query(q)), _LIST)
    r.add(
        "GET",
        f"{_P}/regions/(?P<region>{_ID})",
        lambda q: compute_catalogue.region_json(_project(q), q.groups["region"]),
    )
    r.add("GET", f"{_P}/zones", lambda q: compute_catalogue.list_zones(_project(q), _query(q)), _LIST)
    zone = f"{_P}/zones/(?P<zone>{_ID})"
    r.add("GET", zone, lambda q: compute_catalogue.zone_json(_project(q), q.groups["zone"]))
    per_zone = (
        ("machineTypes", compute_catalogue.list_machine_types, compute_catalogue.machine_type_json),
        ("acceleratorTypes", compute_catalogue.list_accelerator_types, compute_catalogue.accelerator_type_json),
    )
    for kind, list_them, get_one in per_zone:

        def listed(q: Request, list_them: Any = list_them) -> Any:
            return list_them(_project(q), q.groups["zone"], _query(q))

        def one(q: Request, get_one: Any = get_one) -> Any:
            return get_one(_project(q), q.groups["zone"], q.groups["name"])

        r.add("GET", f"{zone}/{kind}", listed, _LIST)
        r.add("GET", f"{zone}/{kind}/(?P<name>{_ID})", one)


def _projects(r: Router, emu: Emulator) -> None:
    """Projects: get, and their common instance metadata."""
    r.add("GET", _P, lambda q: emu.get_project(_project(q)))
    r.add(
        "POST",
        f"{_P}/setCommonInstanceMetadata",
        lambda q: emu.set_common_instance_metadata(_project(q), parse_message(compute_v1.Metadata, q, "resource")),
        ("requestId",),
    )


def _operations(r: Router, emu: Emulator) -> None:
    """Zonal, regional and global operations: get, list, delete, wait."""
    for scope in ("zones/[^/]+", "regions/[^/]+", "global"):
        base = f"/compute/v1/(?P<scope>projects/[^/]+/{scope})/operations"
        r.add("GET", f"{base}/(?P<op>{_ID})", lambda q: emu.get_compute_operation(q.groups["scope"], q.groups["op"]))
        r.add(
            "POST",
            f"{base}/(?P<op>{_ID})/wait",
            lambda q: emu.wait_compute_operation(q.groups["scope"], q.groups["op"]),
        )
        r.add(
            "DELETE", f"{base}/(?P<op>{_ID})", lambda q: emu.delete_compute_operation(q.groups["scope"], q.groups["op"])
        )
        r.add("GET", base, lambda q: emu.list_compute_operations(q.groups["scope"], _query(q)), _LIST)


def _firewalls(r: Router, emu: Emulator) -> None:
    """Firewall rules (global): insert, get, list, delete."""
    base = f"{_P}/global/firewalls"
    r.add(
        "POST",
        base,
        lambda q: emu.insert_firewall(_project(q), parse_message(compute_v1.Firewall, q, "resource")),
        ("requestId",),
    )
    r.add("GET", base, lambda q: emu.list_firewalls(_project(q), _query(q)), _LIST)
    r.add("GET", f"{base}/(?P<name>{_ID})", lambda q: emu.get_firewall(_project(q), q.groups["name"]))
    r.add("DELETE", f"{base}/(?P<name>{_ID})", lambda q: emu.delete_firewall(_project(q), q.groups["name"]), ("requestId",))


def _policies(r: Router, emu: Emulator) -> None:
    base = f"{_P}/regions/(?P<region>[^/]+)/resourcePolicies"
    r.add(
        "POST",
        base,
        lambda q: emu.insert_policy(
            _project(q), q.groups["region"], parse_message(compute_v1.ResourcePolicy, q, "resource")
        ),
        ("requestId",),
    )
    r.add("GET", base, lambda q: emu.list_policies(_project(q), q.groups["region"], _query(q)), _LIST)
    item = f"/compute/v1/(?P<path>projects/[^/]+/regions/[^/]+/resourcePolicies/{_ID})"
    r.add("GET", item, lambda q: emu.get_policy(q.groups["path"]))
    r.add("DELETE", item, lambda q: emu.delete_policy(q.groups["path"]), ("requestId",))


def _templates(r: Router, emu: Emulator) -> None:
    """Global and regional instance templates."""
    for scope, region in ((f"{_P}/global", ""), (f"{_P}/regions/(?P<region>[^/]+)", "region")):
        base = f"{scope}/instanceTemplates"

        def insert(q: Request, region: str = region) -> Any:
            return emu.insert_template(
                _project(q),
                q.groups[region] if region else "",
                parse_message(compute_v1.InstanceTemplate, q, "resource"),
            )

        def scope_of(q: Request, region: str = region) -> str:
            return f"projects/{_project(q)}/" + (f"regions/{q.groups[region]}" if region else "global")

        def list_them(q: Request, scope_of: Any = scope_of) -> Any:
            return emu.list_templates(scope_of(q), _query(q))

        r.add("POST", base, insert, ("requestId",))
        r.add("GET", base, list_them, _LIST)
        item = f"/compute/v1/(?P<path>projects/[^/]+/{'regions/[^/]+' if region else 'global'}/instanceTemplates/{_ID})"
        r.add("GET", item, lambda q: emu.get_template(q.groups["path"]))
        r.add("DELETE", item, lambda q: emu.delete_template(q.groups["path"]), ("requestId",))


def _instances(r: Router, emu: Emulator) -> None:
    base = f"{_P}/zones/(?P<zone>[^/]+)/instances"
    r.add(
        "POST",
        base,
        lambda q: emu.insert_instance(
            _project(q),
            q.groups["zone"],
            parse_message(compute_v1.Instance, q, "resource"),
            q.q("sourceInstanceTemplate"),
        ),
        ("requestId", "sourceInstanceTemplate"),
    )
    r.add("GET", base, lambda q: emu.list_instances(_project(q), q.groups["zone"], _query(q)), _LIST)
    r.add("GET", f"{_P}/aggregated/instances", lambda q: emu.aggregated_instances(_project(q), _query(q)), _AGGREGATED)
    item = f"/compute/v1/(?P<path>projects/[^/]+/zones/[^/]+/instances/{_ID})"
    r.add("GET", item, lambda q: emu.get_instance(q.groups["path"]))
    r.add("DELETE", item, lambda q: emu.delete_instance(q.groups["path"]), ("requestId",))
    r.add(
        "POST",
        f"{item}/setMetadata",
        lambda q: emu.set_metadata(q.groups["path"], parse_message(compute_v1.Metadata, q, "resource")),
        ("requestId",),
    )
    r.add(
        "GET",
        f"{item}/getGuestAttributes",
        lambda q: emu.instance_guest_attributes(q.groups["path"], q.q("queryPath"), q.q("variableKey")),
        ("queryPath", "variableKey"),
    )
    r.add(
        "POST",
        f"{item}/simulateMaintenanceEvent",
        lambda q: emu.simulate_instance_maintenance(q.groups["path"]),
        ("requestId", "withExtendedNotifications"),
    )
    r.add(
        "POST",
        f"{item}/performMaintenance",
        lambda q: emu.perform_instance_maintenance(q.groups["path"]),
        ("requestId",),
    )


def _groups(r: Router, emu: Emulator) -> None:
    """Zonal and regional managed instance groups."""
    r.add(
        "GET",
        f"{_P}/aggregated/instanceGroupManagers",
        lambda q: emu.aggregated_migs(_project(q), _query(q)),
        _AGGREGATED,
    )
    for kind in _SCOPES:
        scope = f"/compute/v1/(?P<scope>projects/[^/]+/{kind}/[^/]+)"
        base = f"{scope}/instanceGroupManagers"
        r.add(
            "POST",
            base,
            lambda q: emu.insert_mig(q.groups["scope"], parse_message(compute_v1.InstanceGroupManager, q, "resource")),
            ("requestId",),
        )
        r.add("GET", base, lambda q: emu.list_migs(q.groups["scope"], _query(q)), _LIST)
        item = f"/compute/v1/(?P<path>projects/[^/]+/{kind}/[^/]+/instanceGroupManagers/{_ID})"
        r.add("GET", item, lambda q: emu.get_mig(q.groups["path"]))
        r.add("DELETE", item, lambda q: emu.delete_mig(q.groups["path"]), ("requestId",))
        r.add(
            "POST",
            f"{item}/listManagedInstances",
            lambda q: emu.list_managed_instances(q.groups["path"], _query(q)),
            _LIST,
        )
        r.add("POST", f"{item}/resize", lambda q: emu.resize_mig(q.groups["path"], _size(q)), ("size", "requestId"))
        r.add(
            "POST",
            f"{item}/abandonInstances",
            lambda q: emu.abandon_instances(
                q.groups["path"],
                list(parse_message(compute_v1.InstanceGroupManagersAbandonInstancesRequest, q, "resource").instances),
            ),
            ("requestId",),
        )


def _resize_requests(r: Router, emu: Emulator) -> None:
    for kind in _SCOPES:
        mig = f"/compute/v1/(?P<mig>projects/[^/]+/{kind}/[^/]+/instanceGroupManagers/{_ID})/resizeRequests"
        r.add(
            "POST",
            mig,
            lambda q: emu.insert_resize_request(
                q.groups["mig"], parse_message(compute_v1.InstanceGroupManagerResizeRequest, q, "resource")
            ),
            ("requestId",),
        )
        r.add("GET", mig, lambda q: emu.list_resize_requests(q.groups["mig"], _query(q)), _LIST)
        item = f"/compute/v1/(?P<path>projects/[^/]+/{kind}/[^/]+/instanceGroupManagers/{_ID}/resizeRequests/{_ID})"
        r.add("GET", item, lambda q: emu.get_resize_request(q.groups["path"]))
        r.add("DELETE", item, lambda q: emu.delete_resize_request(q.groups["path"]), ("requestId",))
        r.add("POST", f"{item}/cancel", lambda q: emu.cancel_resize_request(q.groups["path"]), ("requestId",))


def _project(q: Request) -> str:
    return q.groups["project"]


def _size(q: Request) -> int:
    if not q.q("size"):
        raise compute_error(400, "Required field 'size' not specified", "required")
    return q.q_int("size")
