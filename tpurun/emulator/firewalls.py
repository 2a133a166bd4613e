"""Compute Engine's firewall rules and what they let in: the `firewalls` resource as google-cloud-compute's
FirewallsClient drives it over REST (insert, get, list, delete; global operations), the VMs of both APIs as their
network sees them (`NetworkVm`: a Cloud TPU worker by its hostname, a Compute Engine VM by its name), and whether a
connection from a source range to a port of one passes its project's rules.

A rule is decided as Compute Engine's "Firewall rules overview" describes it: among the enabled rules of the VM's
network and direction that apply to it (no target, or one of its tags or service accounts) and match the traffic
(its source in one of `sourceRanges`, its protocol and port in an `allowed` or `denied` entry), the one of the
lowest priority number wins, a deny before an allow of the same priority; nothing matching is the implied deny of
ingress. Every network a caller names exists (as every project does): a rule's `network` is only compared by name.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from google.cloud import compute_v1

from tpurun.emulator.compute import ListQuery, check_name, listing
from tpurun.emulator.compute_model import compute_error, full_path, invalid_field, link, path_of
from tpurun.emulator.compute_projects import Projects
from tpurun.emulator.model import EmulatorConfig, HostsLike, to_json

DEFAULT_NETWORK = "global/networks/default"
DEFAULT_PRIORITY = 1000
DIRECTIONS = ("INGRESS", "EGRESS")
# the protocols a rule may name (`all`, or one by name or IP protocol number), and those that have ports
PROTOCOLS = {"tcp": "6", "udp": "17", "icmp": "1", "esp": "50", "ah": "51", "sctp": "132", "ipip": "94"}
_WITH_PORTS = {"all", "tcp", "6", "udp", "17", "sctp", "132"}
_PORTS = re.compile(r"^(\d{1,5})(?:-(\d{1,5}))?$")


@dataclass(frozen=True)
class NetworkVm:
    """A VM as its network and its firewall rules see it."""

    name: str  # its instance name: a Cloud TPU worker's hostname, a Compute Engine VM's name
    project: str
    network: str  # its network's name
    address: str  # its internal address
    running: bool
    tags: tuple[str, ...]
    service_accounts: tuple[str, ...]


class Firewalls(Projects):
    def __init__(self, hosts: HostsLike, config: EmulatorConfig) -> None:
        self.firewalls: dict[str, compute_v1.Firewall] = {}  # by path: projects/P/global/firewalls/NAME
        super().__init__(hosts, config)

    # ------------------------------------------------------------------ the resource

    def insert_firewall(self, project: str, rule: compute_v1.Firewall) -> dict[str, Any]:
        """A rule as the API keeps it (its defaults and output fields filled in), made at once; a global operation."""
        check_name(rule.name)
        stored = compute_v1.Firewall(rule)
        stored.network = link(full_path(rule.network or DEFAULT_NETWORK, project, "global/networks"))
        if "priority" not in rule:
            stored.priority = DEFAULT_PRIORITY
        elif not 0 <= rule.priority <= 65535:
            raise invalid_field("resource.priority", rule.priority, "Must be between 0 and 65535.")
        stored.direction = rule.direction or "INGRESS"
        if stored.direction not in DIRECTIONS:
            raise invalid_field("resource.direction", rule.direction, f"Must be one of [{', '.join(DIRECTIONS)}].")
        stored.disabled = bool(rule.disabled)
        if "log_config" not in rule:
            stored.log_config = compute_v1.FirewallLogConfig(enable=False)
        if bool(rule.allowed) == bool(rule.denied):
            raise compute_error(400, "Exactly one of 'allowed' or 'denied' must be specified.", "invalid")
        for i, allowed in enumerate(rule.allowed):
            _check_entry(f"resource.allowed[{i}]", allowed.I_p_protocol, list(allowed.ports))
        for i, denied in enumerate(rule.denied):
            _check_entry(f"resource.denied[{i}]", denied.I_p_protocol, list(denied.ports))
        for kind in ("source_ranges", "destination_ranges"):
            for i, text in enumerate(getattr(rule, kind)):
                try:
                    ipaddress.ip_network(text, strict=False)
                except ValueError:
                    camel = re.sub(r"_(\w)", lambda m: m.group(1).upper(), kind)
                    raise invalid_field(f"resource.{camel}[{i}]", text, "Must be a CIDR address range.") from None
        scope = f"projects/{project}/global"
        return self._insert_at_once(self.firewalls, scope, f"{scope}/firewalls/{rule.name}", stored, "firewall")

    def get_firewall(self, project: str, name: str) -> dict[str, Any]:
        return to_json(self._lookup(self.firewalls, f"projects/{project}/global/firewalls/{name}"))

    def list_firewalls(self, project: str, query: ListQuery) -> dict[str, Any]:
        scope = f"projects/{project}/global/firewalls"
        with self.lock:
            items = [to_json(r) for k, r in sorted(self.firewalls.items()) if k.startswith(scope + "/")]
        return listing("compute#firewallList", scope, items, query)

    def delete_firewall(self, project: str, name: str) -> dict[str, Any]:
        path = f"projects/{project}/global/firewalls/{name}"
        return self._delete_unused(self.firewalls, path, "firewall", lambda _: "")  # nothing holds a rule

    # ------------------------------------------------------------------ what the rules let in

    def network_vm(self, project: str, zone: str, name: str) -> NetworkVm | None:
        """The VM named NAME in PROJECT's ZONE: a Cloud TPU worker (its hostname) or a Compute Engine VM; None when
        there is none (a node's workers have names once it first booted)."""
        with self.lock:
            inst = self.instances.get(f"projects/{project}/zones/{zone}/instances/{name}")
            if inst is not None:
                vm = inst.inst
                nics = list(vm.network_interfaces)
                return NetworkVm(
                    name,
                    project,
                    path_of(nics[0].network).rsplit("/", 1)[-1] if nics else "default",
                    nics[0].network_i_p if nics else "",
                    vm.status == "RUNNING" and inst.group.booted,
                    tuple(vm.tags.items),
                    tuple(sa.email for sa in vm.service_accounts),
                )
            nodes = [r for r in self.nodes.values() if r.project == project and r.zone == zone and r.ever_booted]
        for rec in nodes:
            try:
                workers = self.hosts.workers(rec.key)
            except KeyError:  # deleted meanwhile
                continue
            for w in workers:
                if w.hostname == name:
                    with self.lock:
                        node = rec.node
                        return NetworkVm(
                            name,
                            project,
                            node.network_config.network.rsplit("/", 1)[-1] or "default",
                            w.address,
                            rec.booted and w.init_pid is not None,
                            tuple(node.tags),
                            (node.service_account.email,) if node.service_account.email else (),
                        )
        return None

    def ingress_allowed(self, vm: NetworkVm, protocol: str, port: int, source: str) -> bool:
        """Whether VM's project's rules let a connection from every address of SOURCE (a range) to PROTOCOL:PORT of
        VM in."""
        scope = f"projects/{vm.project}/global/firewalls/"
        with self.lock:
            rules = [compute_v1.Firewall(r) for k, r in self.firewalls.items() if k.startswith(scope)]
        winner: tuple[int, bool] | None = None  # (priority, allows)
        for r in rules:
            if r.disabled or r.direction != "INGRESS" or path_of(r.network).rsplit("/", 1)[-1] != vm.network:
                continue
            targets = [*r.target_tags, *r.target_service_accounts]
            if targets and not set(targets) & {*vm.tags, *vm.service_accounts}:
                continue
            if not _covers(list(r.source_ranges), source):
                continue
            allows = bool(r.allowed)
            entries = r.allowed if allows else r.denied
            if not any(_matches(e.I_p_protocol, list(e.ports), protocol, port) for e in entries):
                continue
            key = (r.priority, allows)  # deny (False) sorts before allow at the same priority
            if winner is None or key < winner:
                winner = key
        return winner is not None and winner[1]


def _check_entry(where: str, protocol: str, ports: list[str]) -> None:
    """An allowed or denied entry: a protocol by name or number, and port ranges where the protocol has ports."""
    if not protocol:
        raise compute_error(400, f"Required field '{where}.IPProtocol' not specified", "required")
    name = protocol.lower()
    if name != "all" and name not in PROTOCOLS and not (name.isdigit() and 0 <= int(name) <= 255):
        raise invalid_field(f"{where}.IPProtocol", protocol, "Must be one of the protocol names or a number.")
    if ports and name not in _WITH_PORTS:
        raise invalid_field(f"{where}.ports", ",".join(ports), "Ports are allowed only for tcp, udp, sctp and all.")
    for text in ports:
        m = _PORTS.match(text)
        if m is None or not all(0 <= int(p) <= 65535 for p in m.groups() if p) or int(m[2] or m[1]) < int(m[1]):
            raise invalid_field(f"{where}.ports", text, "Must be a port or a range of ports such as 12345-12349.")


def _covers(ranges: list[str], source: str) -> bool:
    """Whether one of RANGES holds every address of SOURCE."""
    wanted = ipaddress.ip_network(source)
    for text in ranges:
        net = ipaddress.ip_network(text, strict=False)
        if net.version == wanted.version and wanted.subnet_of(net):  # type: ignore[arg-type]
            return True
    return False


def _matches(rule_protocol: str, rule_ports: list[str], protocol: str, port: int) -> bool:
    """Whether an entry of a rule (its protocol, by name or number, and its ports; none: all) takes PROTOCOL:PORT."""
    name = rule_protocol.lower()
    if name not in ("all", protocol, PROTOCOLS[protocol]):
        return False
    if not rule_ports:
        return True
    for text in rule_ports:
        low, _, high = text.partition("-")
        if int(low) <= port <= int(high or low):
            return True
    return False
