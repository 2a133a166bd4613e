"""TPUs without external IPs, reached through IAP's TCP forwarding: one private 8-host pod made by
`tpurun create --internal-ips`, whose workers take SSH only from their network and from IAP's range (the
emulator's workers, its IAP endpoint at /v4/connect, its Compute Engine firewall rules, set up as a user's gcloud
would set them, through Google's own client). Straight from this machine it cannot be reached; through IAP a
missing firewall rule is said in one line within seconds; with the rule, exec, sync, train, the job and health
commands and download go through IAP (with relays and without) and print what they print on a public pod;
`tpurun ssh` goes through it with the system ssh; autostop starts the watchdogs and `maintenance --now` asks the
agents through it; a worker whose host key changed is refused through the tunnel, in words naming what the tunnel
(or a ProxyCommand) reached; a tunnel lost mid-job is a lost
connection, and Ctrl-C leaves nothing behind."""

from __future__ import annotations

import json
import signal
import socket
import sys
import time

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1

from tests.helpers import (
    assert_clean_error,
    autostop_starts_the_watchdogs,
    create_node,
    detached_loop,
    finish,
    pids_in,
    popen,
    read_until,
)
from tpurun.emulator.pytest_plugin import global_client
from tpurun.worker import bundle_name

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROJECT = "private-project"  # a project of its own: its firewall rules are this file's
RULE = "allow-ssh-ingress-from-iap"
WORKERS = 8
ROOTS = 4  # TPURUN_RELAY_ROOTS' default: the workers of a slice this machine reaches itself through relays
BUNDLE = f"bin/{bundle_name()}/"  # the worker bundle's programs: agents, supervisors, relays, the watchdog
TICKS = """import os, time
w = os.environ["TPURUN_WORKER_ID"]
for i in range(10**6):
    print("tick", i, "of worker", w, "-" * 200, flush=True)
    time.sleep(0.05)
"""


def _tunnels_since(emulator, before: int) -> int:
    """The tunnels IAP opened since the request log's entry BEFORE."""
    return sum(r["path"] == "/v4/connect" and r["detail"].endswith("connected") for r in emulator.requests(before))


def _node(emulator) -> str:
    return f"projects/{PROJECT}/locations/{emulator.zone}/nodes/private"


def _firewalls(emulator) -> compute_v1.FirewallsClient:
    return global_client(emulator.endpoint, compute_v1.FirewallsClient)


def _allow_iap(emulator) -> None:
    """The rule Google's docs give for IAP (gcloud compute firewall-rules create allow-ssh-ingress-from-iap
    --direction=INGRESS --action=allow --rules=tcp:22 --source-ranges=35.235.240.0/20)."""
    rule = compute_v1.Firewall(
        name=RULE,
        direction="INGRESS",
        allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=["22"])],
        source_ranges=["35.235.240.0/20"],
    )
    _firewalls(emulator).insert(project=PROJECT, firewall_resource=rule).result(timeout=30)


def _drop_rule(emulator) -> None:
    client = _firewalls(emulator)
    if any(r.name == RULE for r in client.list(project=PROJECT)):
        client.delete(project=PROJECT, firewall=RULE).result(timeout=30)


@pytest.fixture(scope="module")
def private(emulator, tmp_path_factory):
    """An 8-host pod (v4-64) without external addresses, made by tpurun in a project of its own, without the rule
    that lets IAP in (each test that needs it inserts it: `allowed`)."""
    from tests.integration.conftest import Cli

    cli = Cli.under(tmp_path_factory.mktemp("iap"), emulator)
    cli.env["TPURUN_PROJECT"] = PROJECT
    node = create_node(cli, "private", "v4-64", "--internal-ips")
    yield cli, node
    _drop_rule(emulator)
    cli("delete", "private", "--yes")


@pytest.fixture
def allowed(private, emulator):
    """The pod, with the rule that lets IAP's range in to tcp:22."""
    cli, node = private
    _drop_rule(emulator)
    _allow_iap(emulator)
    return cli, node


def test_a_private_pod_is_made_without_external_addresses(private):
    cli, node = private
    r = cli("describe", "private", "--json")
    assert r.code == 0, r.err
    d = json.loads(r.out)
    assert d["externalIps"] is False, d
    assert [ep["externalIp"] for ep in d["workerEndpoints"]] == [""] * 8, d["workerEndpoints"]
    listed = json.loads(cli("list", "--json").out)
    assert [t["externalIps"] for t in listed if t["name"] == "private"] == [False], listed


def test_straight_from_here_it_cannot_be_reached(private):
    cli, _ = private
    r = cli("--plain", "exec", "--via", "direct", "--worker", "0", "--", "true", timeout=120)
    assert_clean_error(r, 4)
    assert "no external address" in r.err and "--via iap" in r.err, r.err


def test_without_the_firewall_rule_iap_says_which_rule_in_one_line(private, emulator):
    cli, _ = private
    _drop_rule(emulator)
    r = cli("--plain", "exec", "--", "true", timeout=120)  # auto: IAP for workers without an external address
    assert_clean_error(r, 4)
    said = r.err.splitlines()[0]  # the first worker's as it came; the others alike said once at the end
    assert said.startswith("error: IAP cannot reach port 22 of worker w0"), r.err
    assert "35.235.240.0/20" in said and "tcp:22" in said and "gcloud compute firewall-rules create" in said, r.err
    assert r.err.splitlines()[-1].endswith("(and 6 more workers alike: w[2-7])"), r.err
    rows = [line for line in r.err.splitlines() if line.startswith("w")]
    assert len(rows) == WORKERS and all("IAP cannot reach port 22" in row for row in rows), r.err
    assert "timed out" not in r.err  # IAP's own answer, not a wait for a connection that never comes


def test_a_denied_tunnel_names_the_role(private, emulator):
    cli, _ = private
    emulator.admin.iap_access(False, PROJECT)
    try:
        r = cli("--plain", "exec", "--via", "iap", "--worker", "0", "--", "true", timeout=120)
    finally:
        emulator.admin.iap_access(True, PROJECT)
    assert_clean_error(r, 4)
    assert "IAP-secured Tunnel User (roles/iap.tunnelResourceAccessor)" in r.err and "4033" in r.err, r.err


# a ProxyCommand of the user's own: a small `nc` that connects from an address inside the VPC (as a jump host would)
INSIDE = """import os, socket, sys, threading
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), 10, ("127.77.0.1", 0))
def up():
    while (b := os.read(0, 65536)):
        s.sendall(b)
    s.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while (b := s.recv(65536)):
    os.write(1, b)
"""


def test_a_proxy_command_of_ones_own(private, emulator):
    cli, _ = private
    (cli.cwd.parent / "inside.py").write_text(INSIDE)
    via = f"{sys.executable} {cli.cwd.parent / 'inside.py'} %h %p"
    before = emulator.request_count()
    r = cli("exec", "--via", via, "--", "hostname")
    assert r.code == 0, r.err
    assert sorted(line.split()[0] for line in r.out.splitlines()) == sorted(f"[w{i}]" for i in range(WORKERS))
    r = cli("ssh", "--via", via, "--worker", "2", "--", "hostname")
    assert r.code == 0 and r.out.strip().endswith("-w-2"), r.err
    assert _tunnels_since(emulator, before) == 0
    r = cli("--plain", "exec", "--via", "sh -c 'echo no jump host here >&2' %h", "--worker", "0", "--", "true")
    assert_clean_error(r, 4)
    assert "through `sh -c 'echo no jump host here >&2' %h`: no jump host here" in r.err, r.err


@pytest.mark.parametrize("relay", ["--no-relay", "--relay"])
def test_exec_sync_and_train_go_through_iap(allowed, emulator, relay):
    """Through relays, only the roots are tunnelled to: each reaches the workers below it inside the network."""
    cli, _ = allowed
    tunnels = ROOTS if relay == "--relay" else WORKERS
    before = emulator.request_count()
    r = cli("exec", relay, "--", "hostname")
    assert r.code == 0, r.err
    lines = sorted(r.out.splitlines())
    assert [line.split()[0] for line in lines] == sorted(f"[w{i}]" for i in range(WORKERS)), r.out
    assert all(line.split()[1].endswith(line.split()[0][1:-1].replace("w", "-w-")) for line in lines), r.out
    assert _tunnels_since(emulator, before) == tunnels
    (cli.cwd / "t.py").write_text("import os\nprint('hello from', os.environ['TPURUN_WORKER_ID'])\n")
    r = cli("sync", relay)
    assert r.code == 0, r.err
    r = cli("train", relay, "t.py", "--runtime", "cpu", "--launch", "host")
    assert r.code == 0, r.err
    said = sorted(line for line in r.out.splitlines() if "hello from" in line)
    assert said == sorted(f"[w{i}] hello from {i}" for i in range(WORKERS)), r.out
    for command in (["jobs"], ["kill-stale", "--dry-run"], ["doctor"]):  # the job and health commands too
        r = cli(*command, relay)
        assert r.code == 0, (command, r.err)
    # a detached job's stacks and cancel, and download, each through as many tunnels as exec
    job = detached_loop(cli, WORKERS, relay)
    before = emulator.request_count()
    r = cli("stacks", relay, job)
    assert r.code == 0 and "loop.py" in r.out and "wait_here" in r.out, (r.out, r.err)
    assert _tunnels_since(emulator, before) == tunnels
    before = emulator.request_count()
    r = cli("cancel", relay, job)
    assert r.code == 0 and f"job {job} stopped on {WORKERS} worker(s)" in r.err, r.err
    assert _tunnels_since(emulator, before) == tunnels
    assert not pids_in(emulator, _node(emulator), list(range(WORKERS)), "loop.py")
    before = emulator.request_count()
    r = cli("download", relay, "loop.txt", f"back{relay}")  # what the job wrote on each worker
    assert r.code == 0, r.err
    got = {w: (cli.cwd / f"back{relay}" / f"w{w}" / "loop.txt").read_text().split()[-1] for w in range(WORKERS)}
    assert all(host.endswith(f"-w-{w}") for w, host in got.items()), got
    assert _tunnels_since(emulator, before) == tunnels


def _watchdog(pid: int) -> bool:
    """Whether PID is a TPU's watchdog (which stays: it belongs to no command)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"watchdog.py" in f.read()
    except OSError:
        return True  # gone meanwhile: not left either


def test_autostop_and_maintenance_reach_the_workers_through_iap(allowed, emulator):
    """autostop starts the watchdogs through IAP where the TPU's boot does not; `maintenance --now` asks every
    worker's agent through IAP (and through relays, tunnelled to the roots only) and refuses while a job runs."""
    cli, _ = allowed
    autostop_starts_the_watchdogs(cli, emulator, _node(emulator), WORKERS)
    job = detached_loop(cli, WORKERS)
    emulator.admin.maintenance(_node(emulator), 0, notice=7 * 86400, kind="SCHEDULED")  # nothing goes down
    for relay, tunnels in (("off", WORKERS), ("on", ROOTS)):
        cli.env["TPURUN_RELAY"] = relay
        before = emulator.request_count()
        try:
            r = cli("--plain", "maintenance", "private", "--now")
        finally:
            del cli.env["TPURUN_RELAY"]
        assert_clean_error(r, 2)
        assert f"job(s) {job} run on private" in r.err, r.err
        assert _tunnels_since(emulator, before) == tunnels
    assert cli("cancel", job).code == 0


def test_a_worker_whose_host_key_changed_is_refused_through_iap(allowed, emulator):
    """Worker 2 (a root of the relay tree) answers with another host key than the one its TPU published: refused
    through the tunnel (with relays and without) as it is from inside the network (a ProxyCommand), also once
    the API is asked again; nothing runs there, the other workers run."""
    from tpurun.emulator.sshd import host_key

    cli, _ = allowed
    where = emulator.emu.hosts._worker(_node(emulator), 2).dir  # its sshd reads the key at each connection
    files = [where / "ssh_host_ed25519_key", where / "ssh_host_ed25519_key.pub"]
    kept = [f.read_bytes() for f in files]
    for f in files:
        f.unlink()
    host_key(where)  # a new one, as another VM (or a man in the middle) would present
    (cli.cwd.parent / "inside.py").write_text(INSIDE)
    inside = f"{sys.executable} {cli.cwd.parent / 'inside.py'} %h %p"
    try:
        runs = [cli("--plain", "exec", relay, "--", "hostname") for relay in ("--no-relay", "--relay")]
        runs.append(cli("--plain", "exec", "--no-relay", "--via", inside, "--", "hostname"))  # from inside
    finally:
        for f, data in zip(files, kept, strict=True):
            f.write_bytes(data)
    instance = emulator.emu.hosts._worker(_node(emulator), 2).hostname  # the VM IAP reaches by that name
    for r in runs:
        assert r.code == 4, (r.out, r.err)
        assert r.err.startswith("error: HOST KEY CHANGED for worker w2 ") and "Traceback" not in r.err, r.err
        assert "has the address" not in r.err, r.err  # an address is not what either way reached
        assert sorted(line.split()[0] for line in r.out.splitlines()) == [f"[w{i}]" for i in range(WORKERS) if i != 2]
    for r in runs[:2]:  # through IAP, with relays and without: the instance IAP reached by its name
        assert r.err.splitlines()[0] == runs[0].err.splitlines()[0], r.err
        assert f"the VM that IAP's tunnel reached as instance {instance} does not hold" in r.err, r.err
    assert f"what `{inside}` reached for it does not hold" in runs[2].err, runs[2].err
    r = cli("exec", "--", "hostname")
    assert r.code == 0 and len(r.out.splitlines()) == WORKERS, r.err


def _free_ports(n: int) -> list[int]:
    """N ports nothing listens on now (the kernel's choice)."""
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    ports = [sk.getsockname()[1] for sk in socks]
    for sk in socks:
        sk.close()
    return ports


def test_tpurun_ssh_goes_through_iap_and_forwards_a_port(allowed):
    cli, _ = allowed
    r = cli("ssh", "--worker", "1", "--", "hostname")
    assert r.code == 0, r.err
    assert r.out.strip().endswith("-w-1"), r.out
    # a port of this machine forwarded to a server of the worker's, through the tunnel
    server = (
        "import socket, sys; s = socket.create_server(('127.0.0.1', int(sys.argv[1]))); print('ready', flush=True); "
        "c, _ = s.accept(); c.sendall(socket.gethostname().encode()); c.close()"
    )
    here, there = _free_ports(2)
    proc = popen(
        cli, "ssh", "--worker", "1", "-L", f"{here}:127.0.0.1:{there}", "--", "python3", "-c", server, str(there)
    )  # fmt: skip
    read_until(proc, lambda seen: "ready" in seen, timeout=60)
    with socket.create_connection(("127.0.0.1", here), timeout=30) as conn:
        got = conn.recv(100).decode()
    finish(proc, timeout=60)
    assert got.endswith("-w-1"), got


def test_a_tunnel_lost_mid_job_is_a_lost_connection(allowed, emulator):
    """IAP's tunnels closed under a running job: the job ends as one whose workers were lost (75), each of its
    lines whole, and nothing of it stays on the workers."""
    cli, _ = allowed
    (cli.cwd / "ticks.py").write_text(TICKS)
    proc = popen(cli, "--plain", "train", "--no-relay", "ticks.py", "--runtime", "cpu", "--launch", "host")
    seen = read_until(proc, lambda ls: len({x.split()[0] for x in ls if " tick " in x}) == WORKERS, timeout=120)
    emulator.server.tunnels.close_all()
    out, err = finish(proc, timeout=120)
    assert proc.returncode == 75 and "ended (lost)" in err, err[-3000:]
    for line in seen + [x for x in out.splitlines() if " tick " in x]:
        assert line.endswith("-" * 200), line  # whole: none cut where the tunnel went
    assert not pids_in(emulator, _node(emulator), list(range(WORKERS)), "ticks.py")


@pytest.mark.parametrize("relay", ["--no-relay", "--relay"])
def test_ctrl_c_leaves_nothing(allowed, emulator, relay):
    """Ctrl-C on an attached job: its processes, its agents and supervisors and the relays all gone on every
    worker, and every tunnel closed."""
    cli, _ = allowed
    (cli.cwd / "ticks.py").write_text(TICKS)
    proc = popen(cli, "--plain", "train", relay, "ticks.py", "--runtime", "cpu", "--launch", "host")
    read_until(proc, lambda ls: len({x.split()[0] for x in ls if " tick " in x}) == WORKERS, timeout=120)
    proc.send_signal(signal.SIGINT)
    _, err = finish(proc, timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert not pids_in(emulator, _node(emulator), list(range(WORKERS)), "ticks.py")
    deadline = time.monotonic() + 30
    while left := [p for p in pids_in(emulator, _node(emulator), list(range(WORKERS)), BUNDLE) if not _watchdog(p)]:
        assert time.monotonic() < deadline, left  # the supervisors end once their job has
        time.sleep(0.1)
    deadline = time.monotonic() + 30
    while emulator.server.tunnels._open:  # each tunnel ends with the connection that closed it
        assert time.monotonic() < deadline, emulator.server.tunnels._open
        time.sleep(0.1)


def test_a_compute_engine_tpu_without_external_addresses(allowed, emulator):
    """Compute Engine's VMs without an access config, through IAP by their instance names."""
    cli, _ = allowed
    r = cli("create", "ironwood", "-t", "tpu7x-16", "--internal-ips", "--json")
    assert r.code == 0, r.err
    try:
        made = json.loads(r.out)
        assert made["backend"] == "compute" and made["externalIps"] is False, made
        before = emulator.request_count()
        r = cli("exec", "--tpu", "ironwood", "--", "hostname")
        assert r.code == 0, r.err
        assert sorted(line.split()[0] for line in r.out.splitlines()) == ["[w0]", "[w1]"], r.out
        assert _tunnels_since(emulator, before) == 2
        r = cli("--plain", "exec", "--tpu", "ironwood", "--via", "direct", "--", "true")
        assert_clean_error(r, 4)
    finally:
        assert cli("delete", "ironwood", "--yes").code == 0


def test_the_pod_made_public_prints_the_same(allowed, emulator):
    """The same commands, on the same pod once it has external addresses, straight from here: the same output."""
    cli, _ = allowed
    (cli.cwd / "t.py").write_text("import os\nprint('hello from', os.environ['TPURUN_WORKER_ID'])\n")
    through = [cli("exec", "--", "hostname"), cli("train", "t.py", "--runtime", "cpu", "--launch", "host")]
    from google.cloud import tpu_v2
    from google.protobuf import field_mask_pb2

    from tpurun.emulator.pytest_plugin import fast_polling

    client = tpu_v2.TpuClient(
        transport="rest", client_options={"api_endpoint": emulator.endpoint}, credentials=AnonymousCredentials()
    )
    node = tpu_v2.Node(name=_node(emulator), network_config=tpu_v2.NetworkConfig(enable_external_ips=True))
    client.update_node(node=node, update_mask=field_mask_pb2.FieldMask(paths=["network_config.enable_external_ips"])).result(polling=fast_polling())
    before = emulator.request_count()
    straight = [cli("exec", "--via", "direct", "--", "hostname"), cli("train", "--via", "direct", "t.py", "--runtime",
                "cpu", "--launch", "host")]  # fmt: skip
    assert _tunnels_since(emulator, before) == 0
    for a, b in zip(through, straight, strict=True):
        assert (a.code, sorted(a.out.splitlines())) == (b.code, sorted(b.out.splitlines())), (a, b)
