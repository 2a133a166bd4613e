"""Ctrl-C during `tpurun create`, through the real CLI against the emulator: whatever the create asked for (a node,
a queued resource and its slices, a Compute Engine VM, or groups with their instance template and workload policy)
is deleted, while it is made or while it waits for capacity, before tpurun exits 130; a second Ctrl-C stops at once
and prints the command that deletes what is left, which then does. What is left is read through the real Google
clients."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout

import pytest
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1

from tests.helpers import finish, popen

pytestmark = pytest.mark.integration


def _left(emulator) -> list[str]:
    """Everything of either API in the emulator's project, zone and region, as the Google clients list it."""
    tpu = emulator.client()
    kw = {"credentials": AnonymousCredentials(), "client_options": ClientOptions(api_endpoint=emulator.endpoint)}
    project, zone = emulator.project, emulator.zone
    region = zone.rsplit("-", 1)[0]
    found = [f"node {n.name}" for n in tpu.list_nodes(parent=emulator.parent)]
    found += [f"queued resource {q.name}" for q in tpu.list_queued_resources(parent=emulator.parent)]
    found += [f"instance {i.name}" for i in compute_v1.InstancesClient(**kw).list(project=project, zone=zone)]
    groups = compute_v1.InstanceGroupManagersClient(**kw).list(project=project, zone=zone)
    found += [f"instance group {g.name}" for g in groups]
    templates = compute_v1.RegionInstanceTemplatesClient(**kw).list(project=project, region=region)
    found += [f"instance template {t.name}" for t in templates]
    policies = compute_v1.ResourcePoliciesClient(**kw).list(project=project, region=region)
    return found + [f"workload policy {p.name}" for p in policies]


@pytest.fixture
def clean(emulator):
    """Nothing of a test outlives it, whatever it asserted (each checks what it leaves itself)."""
    yield
    emulator.emu.compute_teardown()


def _stderr_until(proc: subprocess.Popen, needle: str, timeout: float = 60) -> list[str]:
    """PROC's stderr lines up to the first that holds NEEDLE."""
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    with ThreadPoolExecutor(max_workers=1) as pool:  # a line that never comes fails the test, not hangs it
        while not lines or needle not in lines[-1]:
            left = deadline - time.monotonic()
            assert left > 0, lines
            try:
                line = pool.submit(proc.stderr.readline).result(timeout=left)
            except FuturesTimeout:
                proc.kill()  # ends the readline too
                raise AssertionError(f"no {needle!r} within {timeout} s: {lines}") from None
            assert line, (lines, proc.poll())
            lines.append(line.rstrip("\n"))
    return lines


# what each create waits at when Ctrl-C comes: (the CLI's arguments, the emulator's setting, the progress line)
CASES = {
    "node": (["-t", "v4-8"], {"delays": {"create": 60}}, "CREATING"),
    "queued node": (["-t", "v4-8", "--queued"], {"delays": {"queue": 60}}, "WAITING_FOR_RESOURCES"),
    "multislice": (["-t", "v4-8", "--slices", "2"], {"delays": {"queue": 60}}, "WAITING_FOR_RESOURCES"),
    "compute flex vm": (
        ["-t", "tpu7x-8", "--flex-start", "--max-run-duration", "1h"],
        {"capacity": "tpu7x=0"},
        "WAITING_FOR_RESOURCES",
    ),
    "compute group": (["-t", "tpu7x-16"], {"capacity": "tpu7x=0"}, "CREATING"),
    "compute slices": (["-t", "tpu7x-16", "--slices", "2"], {"capacity": "tpu7x=0"}, "CREATING"),
}


def _interrupted_create(cli, emulator, case: str) -> tuple[subprocess.Popen, list[str]]:
    """`tpurun create cz` of CASE, started and then waiting where CASE says (Ctrl-C comes next); its stderr
    lines so far."""
    args, setting, waiting = CASES[case]
    emulator.set_delays(**setting.get("delays", {}))
    if "capacity" in setting:
        emulator.set_capacity(setting["capacity"])
    proc = popen(cli, "--plain", "create", "cz", *args)
    return proc, _stderr_until(proc, waiting)


@pytest.mark.parametrize("case", [c for c in CASES if c != "compute slices"])
def test_ctrl_c_deletes_what_create_asked_for(cli, emulator, clean, case):
    proc, before = _interrupted_create(cli, emulator, case)
    proc.send_signal(signal.SIGINT)
    _, err = finish(proc, timeout=60)
    assert proc.returncode == 130, err
    lines = before + err.splitlines()
    err = "\n".join(lines)
    said = [line for line in lines if line.startswith("interrupted: deleting what this create asked for")]
    assert len(said) == 1 and "cz" in said[0] and "Ctrl-C again stops at once" in said[0], err
    assert lines[-1].startswith("deleted cz"), err
    assert "Traceback" not in err and "tpurun delete" not in err, err
    assert _left(emulator) == []
    time.sleep(0.5)  # nothing comes back either (a create the API still ran)
    assert _left(emulator) == []


def _interrupted_twice(cli, emulator, case: str, deleting: list[str]) -> list[str]:
    """Ctrl-C on `tpurun create cz` of CASE, and again once the API took the deletions of DELETING (paths that
    end so): the command it printed, which deletes what is left."""
    proc, _ = _interrupted_create(cli, emulator, case)
    emulator.set_delays(delete=3)  # a deletion slow enough to be interrupted
    proc.send_signal(signal.SIGINT)
    _stderr_until(proc, "interrupted: deleting")
    deadline = time.monotonic() + 30
    while not all(
        any(r["method"] == "DELETE" and r["path"].endswith(d) for r in emulator.requests()) for d in deleting
    ):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stopped = time.monotonic()
    *between, last = _stderr_until(proc, "interrupted again")  # after any progress line of the deletions
    assert time.monotonic() - stopped < 1, last  # it waits for nothing more
    assert all(not line.startswith("error:") for line in between), between
    _, err = finish(proc, timeout=60)
    assert proc.returncode == 130, err
    assert last.startswith("error: interrupted again: stopped before cz was deleted") and not err.strip(), err
    found = re.search(r"`(tpurun delete [^`]+)` deletes what is left of it", last)
    assert found, last
    command = shlex.split(found.group(1))
    assert command == ["tpurun", "delete", "cz", "--yes", "--project", emulator.project, "--zone", emulator.zone]
    assert _left(emulator), "what is being deleted is still there"
    return command


def test_ctrl_c_twice_leaves_a_node_being_deleted_to_the_command(cli, emulator, clean):
    command = _interrupted_twice(cli, emulator, "node", ["/nodes/cz"])
    r = cli(*command[1:], timeout=60)  # the node is still DELETING: the command waits for it
    assert r.code == 0, r.err
    assert _left(emulator) == []


def test_ctrl_c_twice_leaves_a_template_and_policy_to_the_command(cli, emulator, clean):
    command = _interrupted_twice(cli, emulator, "compute slices", ["/cz-0", "/cz-1"])
    deadline = time.monotonic() + 30
    while any(kind.startswith("instance group") for kind in _left(emulator)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert _left(emulator) == ["instance template cz", "workload policy cz"]  # no TPU of that name any more
    r = cli(*command[1:], timeout=60)
    assert r.code == 0, r.err
    assert r.err.splitlines()[-1] == "deleted cz and its instance template and its workload policy", r.err
    assert _left(emulator) == []
