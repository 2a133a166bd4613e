"""Host events in the emulator, read through Google's real clients (tpu_v2, compute_v1, and for Cloud TPU v2alpha1,
whose google-cloud-tpu client speaks gRPC only, the discovery-based googleapiclient tpurun uses) and the
workers' own metadata servers: maintenance announced, carried out and over; started early and simulated through
the APIs' methods; spot preemption after its notice; Compute Engine's catalogue."""

from __future__ import annotations

import datetime as dt
import json
import time
import urllib.request
from collections.abc import Callable

import pytest
from google.api_core import exceptions as gx
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1, tpu_v2
from googleapiclient import discovery
from googleapiclient.errors import HttpError

from tests.emulator.test_compute_api import PROJECT, ZONE, Compute

pytestmark = pytest.mark.integration


def metadata(address: str, path: str) -> str:
    req = urllib.request.Request(
        f"http://{address}/computeMetadata/v1/instance/{path}", headers={"Metadata-Flavor": "Google"}
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read().decode()


def until(check: Callable[[], object], timeout: float = 30.0) -> object:
    deadline = time.time() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


class Alpha:
    """Cloud TPU v2alpha1 through googleapiclient (its own API description), against the emulator."""

    def __init__(self, endpoint: str) -> None:
        self.api = (
            discovery.build(
                "tpu",
                "v2alpha1",
                credentials=AnonymousCredentials(),
                client_options={"api_endpoint": endpoint},
                static_discovery=True,
                cache_discovery=False,
            )
            .projects()
            .locations()
        )

    def node(self, name: str) -> dict:
        return self.api.nodes().get(name=name).execute()

    def done(self, op: dict) -> dict:
        for _ in range(200):
            if op.get("done"):
                return op
            time.sleep(0.05)
            op = self.api.operations().get(name=op["name"]).execute()
        raise AssertionError(f"not done: {op}")


@pytest.fixture
def alpha(emulator):
    return Alpha(emulator.endpoint)


def test_maintenance_announced_carried_out_and_over(emulator, tpu_client, tpu_node, alpha):
    """Worker 1 of a v4-16 is announced for maintenance: v2's REST resource and v2alpha1's client show the
    window PENDING, worker 1's metadata server has it (worker 0's has none); at the window's start the node is
    REPAIRING and UNHEALTHY_MAINTENANCE, the metadata says TERMINATE_ON_HOST_MAINTENANCE and worker 1's processes
    are gone; at its end the slice is READY and HEALTHY again, ssh answers and nothing is announced."""
    node = tpu_node("v4-16")
    w0, w1 = (w.address for w in node.workers)
    assert metadata(w1, "maintenance-event") == "NONE" and metadata(w1, "preempted") == "FALSE"
    assert "error" in json.loads(metadata(w1, "upcoming-maintenance"))
    pids = emulator.node_info(node.name)["workers"][1]["rootPids"]
    emulator.admin.maintenance(node.node_id, 1, notice=2.0, duration=1.0)

    got = alpha.node(node.name)["upcomingMaintenance"]
    assert (got["maintenanceStatus"], got["type"], got["canReschedule"]) == ("PENDING", "UNSCHEDULED", False)
    start, end = (
        dt.datetime.fromisoformat(got[k].replace("Z", "+00:00")) for k in ("windowStartTime", "windowEndTime")
    )
    assert (end - start).total_seconds() == pytest.approx(1.0, abs=0.01)
    with urllib.request.urlopen(f"{emulator.endpoint}/v2/{node.name}") as r:
        assert json.loads(r.read())["upcomingMaintenance"]["maintenanceStatus"] == "PENDING"
    notice = json.loads(metadata(w1, "upcoming-maintenance"))
    assert notice["maintenance_status"] == "PENDING" and notice["type"] == "UNSCHEDULED"
    assert "window_start_time" in notice and "error" in json.loads(metadata(w0, "upcoming-maintenance"))
    assert tpu_client.get_node(name=node.name).state == tpu_v2.Node.State.READY

    until(lambda: tpu_client.get_node(name=node.name).state == tpu_v2.Node.State.REPAIRING, timeout=10)
    assert tpu_client.get_node(name=node.name).health == tpu_v2.Node.Health.UNHEALTHY_MAINTENANCE
    assert metadata(w1, "maintenance-event") == "TERMINATE_ON_HOST_MAINTENANCE"
    assert json.loads(metadata(w1, "upcoming-maintenance"))["maintenance_status"] == "ONGOING"
    until(lambda: not any(_alive(p) for p in pids), timeout=5)

    until(lambda: tpu_client.get_node(name=node.name).state == tpu_v2.Node.State.READY, timeout=30)
    back = alpha.node(node.name)
    assert back["health"] == "HEALTHY" and "upcomingMaintenance" not in back
    assert metadata(w1, "maintenance-event") == "NONE" and "error" in json.loads(metadata(w1, "upcoming-maintenance"))
    from tests.emulator.test_api_hosts import run

    assert run(node.ssh(1, "true"), timeout=30).returncode == 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat"):
            return True
    except OSError:
        return False


def test_v2alpha1_simulate_and_perform(emulator, tpu_node, alpha):
    """simulateMaintenanceEvent announces maintenance of the first worker listed after the emulator's notice;
    performMaintenance starts it at once; with nothing pending it is refused in the API's words."""
    node = tpu_node("v4-16")
    emulator.set_delays(notice=60, maintenance=0.5)
    nodes = alpha.api.nodes()
    with pytest.raises(HttpError, match="no pending maintenance"):
        nodes.performMaintenance(name=node.name, body={}).execute()
    alpha.done(nodes.simulateMaintenanceEvent(name=node.name, body={"workerIds": ["1"]}).execute())
    got = alpha.node(node.name)["upcomingMaintenance"]
    assert got["maintenanceStatus"] == "PENDING"
    start = dt.datetime.fromisoformat(got["windowStartTime"].replace("Z", "+00:00")).timestamp()
    assert start > time.time() + 50
    assert json.loads(metadata(node.workers[1].address, "upcoming-maintenance"))["maintenance_status"] == "PENDING"
    done = alpha.done(nodes.performMaintenance(name=node.name, body={}).execute())
    assert done["response"]["name"] == node.name
    assert done["response"]["@type"].endswith("google.cloud.tpu.v2alpha1.Node")
    until(lambda: alpha.node(node.name)["state"] == "REPAIRING", timeout=10)
    until(lambda: alpha.node(node.name)["state"] == "READY", timeout=30)


def test_spot_preemption_after_its_notice(emulator, tpu_client, tpu_node):
    """A spot node's workers read `preempted` TRUE while it still runs; after the notice it is PREEMPTED."""
    node = tpu_node("v4-16", spot=True)
    emulator.admin.preempt(node.node_id, notice=1.5)
    assert [metadata(w.address, "preempted") for w in node.workers] == ["TRUE", "TRUE"]
    assert tpu_client.get_node(name=node.name).state == tpu_v2.Node.State.READY
    until(lambda: tpu_client.get_node(name=node.name).state == tpu_v2.Node.State.PREEMPTED, timeout=10)


def test_compute_instance_maintenance_and_catalogue(emulator):
    """A TPU VM's `resourceStatus.upcomingMaintenance`, simulateMaintenanceEvent and performMaintenance through
    compute_v1's InstancesClient; regions, zones, machine types and accelerator types answer as catalogue."""
    gce = Compute(emulator.endpoint)
    kw = {"credentials": AnonymousCredentials(), "client_options": ClientOptions(api_endpoint=emulator.endpoint)}
    inst = compute_v1.Instance(
        name="maint",
        machine_type=f"zones/{ZONE}/machineTypes/ct6e-standard-1t",
        scheduling={"on_host_maintenance": "TERMINATE"},
    )
    gce.done(gce.instances.insert_unary(project=PROJECT, zone=ZONE, instance_resource=inst))
    try:
        until(lambda: gce.instances.get(project=PROJECT, zone=ZONE, instance="maint").status == "RUNNING")
        emulator.set_delays(notice=60, maintenance=0.5)
        gce.done(gce.instances.simulate_maintenance_event_unary(project=PROJECT, zone=ZONE, instance="maint"))
        got = gce.instances.get(project=PROJECT, zone=ZONE, instance="maint")
        up = got.resource_status.upcoming_maintenance
        assert up.maintenance_status == "PENDING" and up.type_ == "UNSCHEDULED" and up.window_start_time
        address = got.network_interfaces[0].network_i_p
        assert json.loads(metadata(address, "upcoming-maintenance"))["maintenance_status"] == "PENDING"
        gce.done(gce.instances.perform_maintenance_unary(project=PROJECT, zone=ZONE, instance="maint"))
        until(lambda: gce.instances.get(project=PROJECT, zone=ZONE, instance="maint").status == "REPAIRING")
        until(lambda: gce.instances.get(project=PROJECT, zone=ZONE, instance="maint").status == "RUNNING")
        after = gce.instances.get(project=PROJECT, zone=ZONE, instance="maint")
        assert not after.resource_status.upcoming_maintenance.maintenance_status
        with pytest.raises(gx.BadRequest, match="no pending maintenance"):
            gce.done(gce.instances.perform_maintenance_unary(project=PROJECT, zone=ZONE, instance="maint"))
    finally:
        emulator.restore()
        gce.done(gce.instances.delete_unary(project=PROJECT, zone=ZONE, instance="maint"))

    zones = [z.name for z in compute_v1.ZonesClient(**kw).list(project=PROJECT)]
    assert ZONE in zones
    zone = compute_v1.ZonesClient(**kw).get(project=PROJECT, zone=ZONE)
    assert zone.status == "UP" and zone.region.endswith("/regions/us-central1")
    region = compute_v1.RegionsClient(**kw).get(project=PROJECT, region="us-central1")
    assert any(z.endswith(f"/zones/{ZONE}") for z in region.zones)
    types = {m.name: m for m in compute_v1.MachineTypesClient(**kw).list(project=PROJECT, zone=ZONE)}
    assert types["tpu7x-standard-4t"].accelerators[0].guest_accelerator_count == 4
    one = compute_v1.MachineTypesClient(**kw).get(project=PROJECT, zone=ZONE, machine_type="ct5p-hightpu-4t")
    assert one.accelerators[0].guest_accelerator_type == "tpu-v5p"
    accels = [a.name for a in compute_v1.AcceleratorTypesClient(**kw).list(project=PROJECT, zone=ZONE)]
    assert "tpu7x" in accels
    with pytest.raises(gx.NotFound):
        compute_v1.MachineTypesClient(**kw).get(project=PROJECT, zone=ZONE, machine_type="n1-standard-1")
