"""The emulator's private VMs, Compute Engine firewall rules and IAP's TCP forwarding: a TPU without external IPs
refuses this machine and takes its own network; google-cloud-compute's FirewallsClient keeps rules as Compute Engine
does; the relay v4 endpoint, probed with a small client of the test's own (websockets' sync client, as gcloud's
`start-iap-tunnel` speaks) and paramiko through it, carries an SSH session once a rule lets IAP's range in, and
refuses with the close codes Google's clients know.

Everything happens in a project of its own, whose rules and tunnel switch no other test meets."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import socket
import struct
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import paramiko
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.api_core import exceptions as gx
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1, tpu_v2
from google.protobuf import field_mask_pb2
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from tests.helpers import tpurun
from tpurun.emulator.pytest_plugin import fast_polling
from tpurun.topology import default_runtime_version

pytestmark = pytest.mark.integration

PROJECT = "iap-org"
ZONE = "us-central2-b"
IAP_RANGE = "35.235.240.0/20"
SUBPROTOCOL = "relay.tunnel.cloudproxy.app"
DATA, ACK = 4, 7


# ------------------------------------------------------------------ the test's relay v4 client


@contextlib.contextmanager
def tunnel(
    endpoint: str, instance: str, *, token: str | None = "anonymous", path: str = "connect", **q: Any
) -> Iterator[ClientConnection]:
    """A tunnel to INSTANCE's port 22 opened as gcloud opens one, its CONNECT_SUCCESS_SID read. Refused, it raises
    InvalidStatus at the handshake, ConnectionClosed after it."""
    query = {"project": PROJECT, "port": 22, "newWebsocket": "True", "zone": ZONE, "instance": instance} | q
    query.setdefault("interface", "nic0")
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    url = f"{endpoint.replace('http://', 'ws://')}/v4/{path}?{urlencode(query)}"
    with connect(
        url,
        subprotocols=[SUBPROTOCOL],  # type: ignore[list-item]
        additional_headers=headers,
        origin="bot:iap-tunneler",  # type: ignore[arg-type]
        compression=None,
        ping_interval=None,
    ) as ws:
        assert ws.subprotocol == SUBPROTOCOL  # echoed: gcloud's client fails the handshake otherwise
        first = ws.recv()
        assert struct.unpack(">HI", first[:6]) == (1, len(first) - 6) and len(first) > 6  # CONNECT_SUCCESS_SID
        yield ws


def refusal(endpoint: str, instance: str, **kw: Any) -> int | tuple[int, str] | str:
    """What refuses a tunnel: the HTTP status at the handshake, the close code and reason after it ("open": none)."""
    try:
        with tunnel(endpoint, instance, **kw):
            return "open"
    except InvalidStatus as e:
        return e.response.status_code
    except ConnectionClosed as e:
        assert e.rcvd is not None
        return e.rcvd.code, e.rcvd.reason


def bridged(ws: ClientConnection, acks: list[int] | None = None) -> socket.socket:
    """A socket whose bytes travel through WS as DATA messages (acked as gcloud acks), for paramiko's `sock`; the
    server's ACKs go to ACKS."""
    mine, theirs = socket.socketpair()

    def up() -> None:
        with contextlib.suppress(OSError, ConnectionClosed):
            while data := mine.recv(16384):
                ws.send(struct.pack(">HI", DATA, len(data)) + data)
        ws.close()

    def down() -> None:
        got = acked = 0
        with contextlib.suppress(OSError, ConnectionClosed):
            for msg in ws:  # until the tunnel ends
                tag = int.from_bytes(msg[:2], "big")
                if tag == DATA:
                    mine.sendall(msg[6:])
                    got += len(msg) - 6
                    if got - acked > 2 * 16384:
                        ws.send(struct.pack(">HQ", ACK, got))
                        acked = got
                elif tag == ACK and acks is not None:
                    acks.append(int.from_bytes(msg[2:], "big"))
        with contextlib.suppress(OSError):
            mine.shutdown(socket.SHUT_RDWR)  # paramiko sees the end; `up` too

    for fn in (up, down):
        threading.Thread(target=fn, daemon=True).start()
    return theirs


# ------------------------------------------------------------------ two TPUs and the clients


@dataclass
class Worker:
    address: str
    hostname: str
    host_key: paramiko.PKey


@dataclass
class Net:
    endpoint: str
    tpu: Any  # tpu_v2.TpuClient
    firewalls: Any  # compute_v1.FirewallsClient
    instances: Any  # compute_v1.InstancesClient
    ops: Any  # (global, zonal) operations clients
    pem: str  # the private key both TPUs' ssh-keys list for root
    pkey: paramiko.PKey
    private: list[Worker]
    public: list[Worker]
    names: dict[str, str]  # each node's full name by its id

    def done(self, op: Any) -> None:
        """Wait for a raw Compute Engine operation (insert_unary, delete_unary) with its scope's wait."""
        global_ops, zone_ops = self.ops
        while op.status != compute_v1.Operation.Status.DONE:
            if op.zone:
                op = zone_ops.wait(project=PROJECT, zone=op.zone.rsplit("/", 1)[-1], operation=op.name)
            else:
                op = global_ops.wait(project=PROJECT, operation=op.name)
        assert not op.error.errors, op.error

    def insert(self, name: str, **fields: Any) -> None:
        self.done(
            self.firewalls.insert_unary(project=PROJECT, firewall_resource=compute_v1.Firewall(name=name, **fields))
        )

    def allow_iap(self, name: str, **extra: Any) -> None:
        """The rule Google's IAP page asks for: ingress from IAP's range to tcp:22."""
        self.insert(name, allowed=[{"I_p_protocol": "tcp", "ports": ["22"]}], source_ranges=[IAP_RANGE], **extra)

    def drop(self, name: str) -> None:
        self.done(self.firewalls.delete_unary(project=PROJECT, firewall=name))

    def login(self, sock: socket.socket | tuple[str, int], worker: Worker) -> paramiko.Transport:
        t = paramiko.Transport(sock)
        t.start_client(timeout=10)
        assert t.get_remote_server_key() == worker.host_key
        t.auth_publickey("root", self.pkey)
        return t


def run(t: paramiko.Transport, command: str, stdin: str = "") -> tuple[int, str]:
    chan = t.open_session()
    chan.exec_command(command)
    if stdin:
        chan.sendall(stdin.encode())
    chan.shutdown_write()
    out = chan.makefile("rb").read().decode()
    return chan.recv_exit_status(), out


def _workers(tpu: Any, node: Any) -> list[Worker]:
    """Each worker's address, and its hostname and host key as getGuestAttributes publishes them."""
    attrs = tpu.get_guest_attributes(request={"name": node.name}).guest_attributes
    out = []
    for ep, ga in zip(node.network_endpoints, attrs, strict=True):
        items = {i.key: i.value for i in ga.query_value.items}
        host_key = paramiko.Ed25519Key(data=base64.b64decode(items["ssh-ed25519"]))
        out.append(Worker(ep.ip_address, items["hostname"], host_key))
    return out


@pytest.fixture(scope="module")
def net(emulator) -> Iterator[Net]:
    """A private v4-16 (two workers, no external IPs) and a public v4-8 in PROJECT, root's key on both."""
    kw = {"credentials": AnonymousCredentials(), "client_options": ClientOptions(api_endpoint=emulator.endpoint)}
    tpu = emulator.client()
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    ).decode()
    line = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    parent = f"projects/{PROJECT}/locations/{ZONE}"

    def node(accel: str, external: bool) -> tpu_v2.Node:
        return tpu_v2.Node(
            accelerator_type=accel,
            runtime_version=default_runtime_version("v4"),
            metadata={"ssh-keys": f"root:{line} iap-test"},
            network_config=tpu_v2.NetworkConfig(enable_external_ips=external),
        )

    ops = [
        tpu.create_node(parent=parent, node_id="hidden", node=node("v4-16", False)),
        tpu.create_node(parent=parent, node_id="open", node=node("v4-8", True)),
    ]
    hidden, opened = (op.result(polling=fast_polling()) for op in ops)
    n = Net(
        emulator.endpoint,
        tpu,
        compute_v1.FirewallsClient(**kw),
        compute_v1.InstancesClient(**kw),
        (compute_v1.GlobalOperationsClient(**kw), compute_v1.ZoneOperationsClient(**kw)),
        pem,
        paramiko.Ed25519Key.from_private_key(io.StringIO(pem)),
        _workers(tpu, hidden),
        _workers(tpu, opened),
        {"hidden": hidden.name, "open": opened.name},
    )
    try:
        yield n
    finally:
        emulator.emu.org.iap.set(True)
        for rule in n.firewalls.list(project=PROJECT):
            n.drop(rule.name)
        for op in [tpu.delete_node(name=hidden.name), tpu.delete_node(name=opened.name)]:
            op.result(polling=fast_polling())


# ------------------------------------------------------------------ private VMs


def test_a_private_worker_refuses_this_machine_and_a_public_one_takes_it(net):
    nodes = {n.name.rsplit("/", 1)[-1]: n for n in net.tpu.list_nodes(parent=f"projects/{PROJECT}/locations/{ZONE}")}
    assert [ep.access_config.external_ip for ep in nodes["hidden"].network_endpoints] == ["", ""]
    assert [ep.access_config.external_ip for ep in nodes["open"].network_endpoints] == [net.public[0].address]
    with pytest.raises((paramiko.SSHException, OSError, EOFError)):  # reset at once: sshd never greets
        net.login((net.private[1].address, 22), net.private[1])
    t = net.login((net.public[0].address, 22), net.public[0])
    assert run(t, "hostname") == (0, net.public[0].hostname + "\n")
    t.close()


def test_a_worker_that_loses_its_external_ips_refuses_this_machine(net):
    def external(on: bool) -> None:
        node = tpu_v2.Node(name=net.names["open"], network_config=tpu_v2.NetworkConfig(enable_external_ips=on))
        mask = field_mask_pb2.FieldMask(paths=["network_config.enable_external_ips"])
        got = net.tpu.update_node(node=node, update_mask=mask).result(polling=fast_polling())
        assert bool(got.network_endpoints[0].access_config.external_ip) == on

    external(False)
    try:
        with pytest.raises((paramiko.SSHException, OSError, EOFError)):
            net.login((net.public[0].address, 22), net.public[0])
    finally:
        external(True)
    net.login((net.public[0].address, 22), net.public[0]).close()


# ------------------------------------------------------------------ the tunnel


def test_the_tunnel_needs_a_firewall_rule_then_carries_ssh_and_workers_reach_each_other(net):
    w0, w1 = net.private
    assert refusal(net.endpoint, w0.hostname) == (4003, "failed to connect to backend")
    net.allow_iap("allow-ssh-ingress-from-iap")
    try:
        with tunnel(net.endpoint, w0.hostname) as ws:
            acks: list[int] = []
            t = net.login(bridged(ws, acks), w0)  # its host key checked: the guest attribute's
            assert run(t, "hostname") == (0, w0.hostname + "\n")
            assert run(t, "wc -c", "x" * 100_000) == (0, "100000\n")
            assert acks == sorted(acks) and acks[-1] > 2 * 32768  # what it received, acked past 32 KiB at once
            # from worker 0, worker 1 takes ssh from worker 0's own address (-b), not from 127.0.0.1 (ssh's choice)
            blob = base64.b64encode(w1.host_key.asbytes()).decode()
            assert run(t, f"umask 077; cat > /tmp/k; echo '{w1.address} ssh-ed25519 {blob}' > /tmp/kh", net.pem)[0] == 0
            ssh = (
                "ssh -i /tmp/k -o IdentitiesOnly=yes -o BatchMode=yes -o UserKnownHostsFile=/tmp/kh -o ConnectTimeout=5"
            )
            assert run(t, f"{ssh} -b {w0.address} root@{w1.address} hostname") == (0, w1.hostname + "\n")
            assert run(t, f"{ssh} root@{w1.address} hostname 2>/dev/null")[0] == 255
            t.close()
    finally:
        net.drop("allow-ssh-ingress-from-iap")
    assert refusal(net.endpoint, w0.hostname) == (4003, "failed to connect to backend")


def test_rules_that_do_not_let_iap_in_are_4003(net):
    w0 = net.private[0]
    tcp = {"I_p_protocol": "tcp"}
    rules: dict[str, dict[str, Any]] = {
        "wrong-port": {"allowed": [{**tcp, "ports": ["2222", "80-90"]}], "source_ranges": [IAP_RANGE]},
        "part-of-range": {"allowed": [tcp], "source_ranges": ["35.235.240.0/24"]},
        "disabled": {"allowed": [{"I_p_protocol": "all"}], "source_ranges": ["0.0.0.0/0"], "disabled": True},
        "other-tag": {"allowed": [tcp], "source_ranges": [IAP_RANGE], "target_tags": ["web"]},
        "egress": {"allowed": [tcp], "destination_ranges": ["0.0.0.0/0"], "direction": "EGRESS"},
        "other-network": {"allowed": [tcp], "source_ranges": [IAP_RANGE], "network": "global/networks/lab"},
        "deny-first": {"denied": [{**tcp, "ports": ["22"]}], "source_ranges": [IAP_RANGE], "priority": 900},
        "allow-after": {"allowed": [{**tcp, "ports": ["20-30"]}], "source_ranges": ["0.0.0.0/0"]},
    }
    for name, fields in rules.items():
        net.insert(name, **fields)
    try:
        assert refusal(net.endpoint, w0.hostname) == (4003, "failed to connect to backend")
        net.drop("deny-first")  # the allow of priority 1000 now decides
        with tunnel(net.endpoint, w0.hostname) as ws:
            assert ws.recv()[6:14] == b"SSH-2.0-"  # sshd's greeting, as a DATA message
    finally:
        for name in rules:
            if name != "deny-first":
                net.drop(name)


def test_the_tunnel_holds_its_client_to_the_protocol(net):
    net.allow_iap("protocol")
    try:
        for message, close in [
            (struct.pack(">HQ", ACK, 10**6), (4006, "invalid ack")),  # beyond what it was sent
            (struct.pack(">HI", 9, 0), (4008, "invalid tag")),
            (struct.pack(">HI", DATA, 0), (4013, "invalid data")),
            ("text", (4007, "invalid websocket opcode")),
        ]:
            with tunnel(net.endpoint, net.private[0].hostname) as ws:
                greeting = len(ws.recv()) - 6  # sshd speaks first
                ws.send(struct.pack(">HQ", ACK, greeting))  # taken
                ws.send(message)
                with pytest.raises(ConnectionClosed) as closed:
                    while True:
                        ws.recv()
                assert closed.value.rcvd is not None
                assert (closed.value.rcvd.code, closed.value.rcvd.reason) == close
    finally:
        net.drop("protocol")


def test_a_compute_engine_vm_is_reached_by_its_name_where_a_rule_targets_its_tag(net):
    vm = compute_v1.Instance(
        name="hidden-vm",
        machine_type=f"zones/{ZONE}/machineTypes/ct6e-standard-1t",
        disks=[{"boot": True, "auto_delete": True, "initialize_params": {"source_image": "family/tpu"}}],
        network_interfaces=[{"network": "global/networks/default"}],  # no access config: no external address
        scheduling={"on_host_maintenance": "TERMINATE"},
        tags={"items": ["iap-ssh"]},
    )
    net.done(net.instances.insert_unary(project=PROJECT, zone=ZONE, instance_resource=vm))
    try:
        address = net.instances.get(project=PROJECT, zone=ZONE, instance="hidden-vm").network_interfaces[0]
        assert not address.access_configs
        with pytest.raises(OSError), socket.create_connection((address.network_i_p, 22), 5) as s:
            s.recv(4)  # reset at once
        net.allow_iap("iap-to-tagged", target_tags=["iap-ssh"])
        try:
            with tunnel(net.endpoint, "hidden-vm") as ws:
                assert ws.recv()[6:14] == b"SSH-2.0-"
            assert refusal(net.endpoint, net.private[0].hostname) == (4003, "failed to connect to backend")  # untagged
        finally:
            net.drop("iap-to-tagged")
    finally:
        net.done(net.instances.delete_unary(project=PROJECT, zone=ZONE, instance="hidden-vm"))


def test_denied_tunnels_are_4033_and_an_unknown_instance_4047(net, emulator):
    env = emulator.env
    assert tpurun("emulator", "iap", "deny", "--project", PROJECT, env=env).code == 0
    try:
        assert refusal(net.endpoint, net.private[0].hostname) == (4033, "not authorized")
        assert refusal(net.endpoint, "nobody") == (4033, "not authorized")  # who may, before what there is
    finally:
        assert tpurun("emulator", "iap", "allow", "--project", PROJECT, env=env).code == 0
    bad = tpurun("emulator", "iap", "maybe", env=env)
    assert bad.code == 2 and "deny or allow" in bad.err and "Traceback" not in bad.err
    lookup = (4047, "Failed to lookup instance")
    assert refusal(net.endpoint, "t1v-n-00000000-w-0") == lookup
    assert refusal(net.endpoint, net.private[0].hostname, zone="us-central1-a") == lookup
    assert refusal(net.endpoint, net.private[0].hostname, project="another") == lookup
    assert refusal(net.endpoint, net.private[0].hostname, interface="nic1") == lookup


def test_the_handshake_wants_a_bearer_token_its_arguments_and_the_subprotocol(net):
    w0 = net.private[0].hostname
    assert refusal(net.endpoint, w0, token=None) == 401
    assert refusal(net.endpoint, w0, token="") == 401
    assert refusal(net.endpoint, "") == 400  # a missing tunnel argument
    query = urlencode({"project": PROJECT, "port": 22, "zone": ZONE, "instance": w0, "interface": "nic0"})
    with pytest.raises(InvalidStatus) as refused:  # no subprotocol offered
        connect(
            f"{net.endpoint.replace('http', 'ws')}/v4/connect?{query}", additional_headers={"Authorization": "Bearer x"}
        )
    assert refused.value.response.status_code == 400
    assert refusal(net.endpoint, w0, path="reconnect", sid="x", ack=0) == (4001, "unknown session")


# ------------------------------------------------------------------ the firewalls resource


def test_firewall_rules_are_kept_with_compute_engines_defaults(net):
    rule = compute_v1.Firewall(
        name="from-iap", allowed=[{"I_p_protocol": "tcp", "ports": ["22"]}], source_ranges=[IAP_RANGE]
    )
    net.firewalls._transport._extended_operations_services["global_operations"] = net.ops[0]  # it polls Google else
    net.firewalls.insert(project=PROJECT, firewall_resource=rule).result(timeout=30)  # the client's own operation
    got = net.firewalls.get(project=PROJECT, firewall="from-iap")
    base = f"https://www.googleapis.com/compute/v1/projects/{PROJECT}/global/"
    assert (got.kind, got.network, got.priority, got.direction) == (
        "compute#firewall",
        f"{base}networks/default",
        1000,
        "INGRESS",
    )
    assert got.self_link == f"{base}firewalls/from-iap" and got.id > 0 and got.creation_timestamp
    url = f"{net.endpoint}/compute/v1/projects/{PROJECT}/global/firewalls/from-iap"
    with urllib.request.urlopen(url) as r:
        wire = json.loads(r.read())
    assert wire["disabled"] is False and wire["logConfig"] == {"enable": False} and isinstance(wire["id"], str)
    net.allow_iap("second", priority=10, network=f"projects/{PROJECT}/global/networks/default")
    try:
        listed = net.firewalls.list(request={"project": PROJECT, "max_results": 1})
        assert [r.name for r in listed] == ["from-iap", "second"]  # two pages, followed by the pager
        only = net.firewalls.list(request={"project": PROJECT, "filter": "priority = 10"})
        assert [r.name for r in only] == ["second"]
        with pytest.raises(gx.Conflict, match="already exists"):
            net.firewalls.insert_unary(project=PROJECT, firewall_resource=rule)
        bad: list[dict[str, Any]] = [
            {"name": "Bad_Name"},
            {"source_ranges": ["35.235.240.0/33"]},
            {"allowed": [{"I_p_protocol": "tcp", "ports": ["99999"]}]},
            {"priority": 70000},
        ]
        for fields in bad:
            with pytest.raises(gx.BadRequest):
                net.firewalls.insert_unary(project=PROJECT, firewall_resource=compute_v1.Firewall(rule, **fields))
    finally:
        net.drop("second")
        net.drop("from-iap")
    with pytest.raises(gx.NotFound, match="projects/iap-org/global/firewalls/from-iap"):
        net.firewalls.get(project=PROJECT, firewall="from-iap")
    with pytest.raises(gx.NotFound):
        net.firewalls.delete_unary(project=PROJECT, firewall="from-iap")


def test_each_worker_publishes_its_hostname_as_gcloud_reads_it(net):
    """gcloud asks one worker's attributes (workerIds) and takes the item whose key is `hostname`."""
    one = net.tpu.get_guest_attributes(request={"name": net.names["hidden"], "worker_ids": ["1"]})
    (entry,) = one.guest_attributes
    assert {i.key: i.value for i in entry.query_value.items}["hostname"] == net.private[1].hostname
    assert [w.hostname.rsplit("-w-", 1)[-1] for w in net.private] == ["0", "1"]
