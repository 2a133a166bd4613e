"""Workers reach each other at their internal addresses, as on a real slice: the system `ssh` on one worker logs
into another at the address the Cloud TPU API reports (`networkEndpoints[].ipAddress`), with a key authorized
through the node's `ssh-keys` metadata and the host key its guest attributes publish, under
StrictHostKeyChecking=yes; a wrong pinned key is refused."""

from __future__ import annotations

import subprocess
import time

import pytest
from google.cloud import tpu_v2
from google.protobuf import field_mask_pb2

from tests.helpers import create_node

pytestmark = pytest.mark.integration

MESH = ".mesh"  # on worker 0: the key and known_hosts of its ssh to worker 1


def _ssh_from_worker0(cli, address0: str, address1: str, known: str) -> subprocess.CompletedProcess[str]:
    """Write KNOWN as worker 0's known_hosts, then run `ssh ADDRESS1 hostname` there (through tpurun exec)."""
    put = subprocess.run(cli.ssh(address0, f"cat > {MESH}/known_hosts"), input=known, capture_output=True, text=True)
    assert put.returncode == 0, put.stderr
    argv = [
        "ssh", "-i", f"{MESH}/id_ed25519", "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={MESH}/known_hosts",
        "-o", "ConnectTimeout=10", f"root@{address1}", "hostname",
    ]  # fmt: skip
    r = cli("exec", "--tpu", "mesh", "--worker", "0", "--", *argv)
    return subprocess.CompletedProcess(argv, r.code, r.out, r.err)


def test_a_worker_logs_into_another_at_its_internal_address(cli, emulator, tmp_path):
    create_node(cli, "mesh", "v4-16")  # two workers
    client = emulator.client()
    name = emulator.node_name("mesh")
    node = client.get_node(name=name)
    address0, address1 = (ep.ip_address for ep in node.network_endpoints)
    hostname1 = emulator.node_info(name)["workers"][1]["hostname"]

    # a key of worker 0's own, authorized on the node through its metadata (beside tpurun's)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "id")], check=True)
    pub = (tmp_path / "id.pub").read_text().strip()
    made = subprocess.run(
        cli.ssh(address0, f"umask 077; mkdir -p {MESH} && cat > {MESH}/id_ed25519"),
        input=(tmp_path / "id").read_text(),
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr
    metadata = dict(node.metadata)
    metadata["ssh-keys"] = metadata.get("ssh-keys", "").rstrip("\n") + f"\nroot:{pub}"
    client.update_node(
        node=tpu_v2.Node(name=name, metadata=metadata), update_mask=field_mask_pb2.FieldMask(paths=["metadata"])
    ).result()

    # worker 1's host key as its guest attributes publish it
    attrs = client.get_guest_attributes(request={"name": name, "query_path": "hostkeys/"}).guest_attributes
    key0, key1 = (next(it.value for it in a.query_value.items if it.key == "ssh-ed25519") for a in attrs)
    pinned = f"{address1} ssh-ed25519 {key1}\n"

    deadline = time.monotonic() + 30
    while True:  # the key reaches the workers after the metadata's propagation delay
        r = _ssh_from_worker0(cli, address0, address1, pinned)
        if r.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert r.stdout.strip() == f"[w0] {hostname1}", r.stdout

    # another host's key pinned for that address: refused, never trusted on first use
    refused = _ssh_from_worker0(cli, address0, address1, f"{address1} ssh-ed25519 {key0}\n")
    assert refused.returncode == 1 and "Host key verification failed" in refused.stdout + refused.stderr, refused
