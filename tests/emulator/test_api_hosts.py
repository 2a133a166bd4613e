"""Emulated nodes are real hosts: ssh in with keys from metadata and host keys from guest attributes."""

from __future__ import annotations

import os
import shlex
import subprocess
import time

import pytest
from google.api_core import exceptions as gx
from google.cloud import tpu_v2
from google.protobuf import field_mask_pb2

from tpurun.emulator.pytest_plugin import _ssh_key, fast_polling

pytestmark = pytest.mark.integration

STARTUP = """#!/bin/bash
echo "startup on $(hostname)"
sleep 600 &
echo $! > /tmp/sleeper.pid
curl -s -X PUT -H 'Metadata-Flavor: Google' --data "$(hostname)" \\
  http://metadata.google.internal/computeMetadata/v1/instance/guest-attributes/startup/ran
"""


def run(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def test_v4_32_workers_are_separate_hosts(emulator, tpu_client, tpu_node):
    node = tpu_node("v4-32", startup_script=STARTUP, spot=True)
    assert len(node.workers) == 4
    hostnames, sleepers = [], []
    for w in node.workers:
        r = run(
            node.ssh(
                w.index,
                "hostname; cat /tmp/sleeper.pid; ps -e -o comm= | grep -c '^sleep$'; "
                "touch ~/mine-$(hostname); ls ~ | grep -c '^mine-'",
            )
        )
        assert r.returncode == 0, r.stderr
        name, pid, nsleep, nmine = r.stdout.split()
        hostnames.append(name)
        sleepers.append(pid)
        assert nsleep == "1"  # only its own startup sleeper: process tables differ
        assert nmine == "1"  # only its own file: homes differ
        assert name == w.hostname
    assert len(set(hostnames)) == 4

    # the startup script's guest-attribute write is readable through the API, per worker
    ga = tpu_client.get_guest_attributes(request={"name": node.name, "query_path": "startup/ran"})
    assert [e.query_value.items[0].value for e in ga.guest_attributes] == hostnames

    # a wrong host key is refused under StrictHostKeyChecking=yes
    node.known_hosts_path.write_text(f"{node.workers[0].address} {node.workers[1].host_key}\n")
    r = run(node.ssh(0, "true"))
    assert r.returncode == 255 and "Host key verification failed" in r.stderr

    # preemption kills every process of every worker
    pids = [p for w in node.workers for p in emulator.node_info(node.name)["workers"][w.index]["rootPids"]]
    assert len(pids) >= 8
    emulator.preempt(node.node_id)
    assert tpu_client.get_node(name=node.name).state == tpu_v2.Node.State.PREEMPTED
    deadline = time.time() + 5
    while [p for p in pids if os.path.exists(f"/proc/{p}")] and time.time() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]
    assert run(node.ssh(1, "true"), timeout=20).returncode == 255


def test_ssh_key_update_propagates(emulator, tpu_client, tpu_node, tmp_path):
    node = tpu_node("v4-8")
    assert run(node.ssh(0, "true")).returncode == 0
    new_key, new_pub = _ssh_key(tmp_path / "second")
    md = dict(tpu_client.get_node(name=node.name).metadata)
    md["ssh-keys"] += f"\nsecond:{new_pub}"
    tpu_client.update_node(
        node=tpu_v2.Node(name=node.name, metadata=md), update_mask=field_mask_pb2.FieldMask(paths=["metadata"])
    ).result(polling=fast_polling())
    argv = node.ssh(0, "whoami")
    argv[argv.index(str(node.key_path))] = str(new_key)
    argv[-2] = f"second@{node.workers[0].address}"
    for _ in range(50):  # keys propagate after a short delay, as on Cloud TPU
        r = run(argv)
        if r.returncode == 0:
            break
        time.sleep(0.1)
    assert r.returncode == 0, r.stderr


def test_kill_sshd_and_kill_worker(emulator, tpu_client, tpu_node):
    node = tpu_node("v4-16")
    emulator.kill_sshd(node.node_id, 1)
    assert run(node.ssh(1, "true"), timeout=20).returncode == 255
    assert run(node.ssh(0, "true")).returncode == 0
    pids = emulator.node_info(node.name)["workers"][0]["rootPids"]
    emulator.kill_worker(node.node_id, 0)
    deadline = time.time() + 5
    while [p for p in pids if os.path.exists(f"/proc/{p}")] and time.time() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]
    assert run(node.ssh(0, "true"), timeout=20).returncode == 255


def test_delete_leaves_no_processes(emulator, tpu_client, tpu_node):
    node = tpu_node("v4-16", startup_script="sleep 600 &")
    pids = [p for w in emulator.node_info(node.name)["workers"] for p in w["rootPids"]]
    assert pids
    tpu_client.delete_node(request={"name": node.name}).result(polling=fast_polling())
    with pytest.raises(gx.NotFound):
        tpu_client.get_node(name=node.name)
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]


VM_CALLS = r"""
import sys
import google.auth.compute_engine
import requests
from google.api_core import exceptions as gx
from google.cloud import tpu_v2

endpoint, own, other_parent = sys.argv[1:4]

def client(creds):
    return tpu_v2.TpuClient(transport="rest", client_options={"api_endpoint": endpoint}, credentials=creds)

vm = client(google.auth.compute_engine.Credentials())  # the VM's service account, from its metadata server
print("own", vm.get_node(name=own).state.name)
print("email", vm._transport._credentials.service_account_email)
try:
    list(vm.list_nodes(parent=other_parent))
    print("other-project allowed")
except gx.GoogleAPICallError as e:
    print("other-project", e.code)
# a made-up token (google-auth would refresh on 401 and fail: ask plainly)
print("bogus-token", requests.get(f"{endpoint}/v2/{own}", headers={"Authorization": "Bearer ya29.bogus"}).status_code)
"""


def test_vm_service_account_token_calls_the_api_for_its_own_project(emulator, tpu_client, tpu_node):
    """A worker's own credentials, as google-auth gets them on a TPU VM (metadata server token), are
    accepted by the API within the node's project; a made-up token is not."""
    node = tpu_node("v4-8")
    other = node.name.replace(f"projects/{emulator.project}/", "projects/someone-else/").rsplit("/nodes/", 1)[0]
    r = run(node.ssh(0, "python3", "-c", shlex.quote(VM_CALLS), emulator.endpoint, node.name, other), timeout=60)
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert lines["own"] == "READY"
    assert lines["email"].endswith("-compute@developer.gserviceaccount.com")
    assert lines["other-project"] == "403" and lines["bogus-token"] == "401"
