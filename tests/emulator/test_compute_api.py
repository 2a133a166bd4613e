"""The emulated Compute Engine API, driven only through the real google-cloud-compute REST clients (and, for the
request shapes of discovery-based clients, googleapiclient). Every test leaves no Compute Engine resource."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from google.api_core import exceptions as gx
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1

pytestmark = pytest.mark.integration
PROJECT = "emulated-project"
ZONE = "us-central1-c"
REGION = "us-central1"
IMAGE = "projects/ubuntu-os-accelerator-images/global/images/family/ubuntu-accel-2404-amd64-tpu-tpu7x"


class Compute:
    """The clients tpurun uses, every one (and every operations client) pointed at the emulator."""

    def __init__(self, endpoint: str) -> None:
        kw = {"credentials": AnonymousCredentials(), "client_options": ClientOptions(api_endpoint=endpoint)}
        self.instances = compute_v1.InstancesClient(**kw)
        self.templates = compute_v1.InstanceTemplatesClient(**kw)
        self.policies = compute_v1.ResourcePoliciesClient(**kw)
        self.migs = compute_v1.InstanceGroupManagersClient(**kw)
        self.region_migs = compute_v1.RegionInstanceGroupManagersClient(**kw)
        self.resize_requests = compute_v1.InstanceGroupManagerResizeRequestsClient(**kw)
        self.zone_ops = compute_v1.ZoneOperationsClient(**kw)
        self.region_ops = compute_v1.RegionOperationsClient(**kw)
        self.global_ops = compute_v1.GlobalOperationsClient(**kw)

    def done(self, op: compute_v1.Operation) -> compute_v1.Operation:
        """Wait for a raw operation with the operations service of its scope; raise what the client would."""
        name = op.name
        for _ in range(50):
            if op.zone:
                op = self.zone_ops.wait(project=PROJECT, zone=op.zone.rsplit("/", 1)[-1], operation=name)
            elif op.region:
                op = self.region_ops.wait(project=PROJECT, region=op.region.rsplit("/", 1)[-1], operation=name)
            else:
                op = self.global_ops.wait(project=PROJECT, operation=name)
            if op.status == compute_v1.Operation.Status.DONE:
                break
        assert op.status == compute_v1.Operation.Status.DONE
        if op.error.errors:
            raise gx.from_http_status(op.http_error_status_code, op.http_error_message, errors=list(op.error.errors))
        return op


@pytest.fixture
def gce(emulator):
    c = Compute(emulator.endpoint)
    try:
        yield c
    finally:
        emulator.restore()
        status = emulator.admin.status()
        leftovers = {
            k: status[k] for k in ("instances", "instanceGroupManagers", "instanceTemplates", "resourcePolicies")
        }
        emulator.emu.compute_teardown()
        assert not any(leftovers.values()), f"left behind: {leftovers}"


def template(
    name: str, machine: str = "tpu7x-standard-4t", *, model: str = "STANDARD", **extra
) -> compute_v1.InstanceTemplate:
    scheduling = compute_v1.Scheduling(on_host_maintenance="TERMINATE", provisioning_model=model, **extra)
    props = compute_v1.InstanceProperties(
        machine_type=machine,
        disks=[compute_v1.AttachedDisk(boot=True, auto_delete=True, initialize_params={"source_image": IMAGE})],
        network_interfaces=[
            compute_v1.NetworkInterface(network="global/networks/default", access_configs=[{"name": "External NAT"}])
        ],
        scheduling=scheduling,
        metadata=compute_v1.Metadata(items=[{"key": "enable-guest-attributes", "value": "TRUE"}]),
    )
    return compute_v1.InstanceTemplate(name=name, properties=props)


def policy(name: str, topology: str) -> compute_v1.ResourcePolicy:
    return compute_v1.ResourcePolicy(
        name=name, workload_policy={"type_": "HIGH_THROUGHPUT", "accelerator_topology": topology}
    )


def mig(name: str, size: int, policy_name: str = "", **extra) -> compute_v1.InstanceGroupManager:
    m = compute_v1.InstanceGroupManager(
        name=name,
        base_instance_name=name,
        instance_template=f"global/instanceTemplates/{name}",
        target_size=size,
        **extra,
    )
    if policy_name:
        m.resource_policies = {"workload_policy": f"projects/{PROJECT}/regions/{REGION}/resourcePolicies/{policy_name}"}
    return m


def make_slice(gce: Compute, name: str, topology: str, size: int, **mig_extra) -> None:
    gce.done(gce.policies.insert_unary(project=PROJECT, region=REGION, resource_policy_resource=policy(name, topology)))
    gce.done(gce.templates.insert_unary(project=PROJECT, instance_template_resource=template(name)))
    gce.done(
        gce.migs.insert_unary(
            project=PROJECT, zone=ZONE, instance_group_manager_resource=mig(name, size, name, **mig_extra)
        )
    )


def remove_slice(gce: Compute, name: str) -> None:
    gce.done(gce.migs.delete_unary(project=PROJECT, zone=ZONE, instance_group_manager=name))
    gce.done(gce.templates.delete_unary(project=PROJECT, instance_template=name))
    gce.done(gce.policies.delete_unary(project=PROJECT, region=REGION, resource_policy=name))


def wait_stable(gce: Compute, name: str, timeout: float = 60) -> compute_v1.InstanceGroupManager:
    deadline = time.time() + timeout
    while True:
        got = gce.migs.get(project=PROJECT, zone=ZONE, instance_group_manager=name)
        if got.status.is_stable:
            return got
        assert time.time() < deadline, f"{name} not stable: {got.status}"
        time.sleep(0.05)


def test_tpu7x_slice_as_a_mig_with_a_workload_policy(emulator, gce):
    """A 2-VM TPU7x slice (2x2x2): the group is DONE before its VMs, then stable with every VM RUNNING, each a
    worker host with its instance name, 4 TPU7x chips on PCI and its host key in guest attributes; delete in
    the order MIG, template, policy leaves nothing."""
    make_slice(gce, "ironwood", "2x2x2", 2)
    got = wait_stable(gce, "ironwood")
    assert got.target_size == 2 and got.current_actions.none == 2 and got.status.current_instance_statuses.running == 2
    assert got.status.applied_accelerator_topologies[0].accelerator_topology == "2x2x2"
    managed = list(gce.migs.list_managed_instances(project=PROJECT, zone=ZONE, instance_group_manager="ironwood"))
    assert [m.instance_status for m in managed] == ["RUNNING", "RUNNING"]
    assert all(m.current_action == "NONE" and m.name.startswith("ironwood-") for m in managed)
    for m in managed:
        inst = gce.instances.get(project=PROJECT, zone=ZONE, instance=m.name)
        assert inst.self_link == m.instance and inst.status == "RUNNING"
        assert inst.machine_type.endswith(f"/zones/{ZONE}/machineTypes/tpu7x-standard-4t")
        assert inst.scheduling.on_host_maintenance == "TERMINATE"
        md = {i.key: i.value for i in inst.metadata.items}
        assert md["created-by"].endswith(f"/zones/{ZONE}/instanceGroupManagers/ironwood")
        assert "tpu-env" not in md and "agent-worker-number" not in md
        ip = inst.network_interfaces[0].network_i_p
        assert ip.startswith("127.77.") and inst.network_interfaces[0].access_configs[0].nat_i_p == ip
        ga = gce.instances.get_guest_attributes(
            request={"project": PROJECT, "zone": ZONE, "instance": m.name, "query_path": "hostkeys/"}
        )
        items = {(i.namespace, i.key): i.value for i in ga.query_value.items}
        assert not items[("hostkeys", "ssh-ed25519")].startswith("ssh-")  # the base64 key alone, as the guest agent
    hosts = emulator.emu.hosts
    key = f"projects/{PROJECT}/zones/{ZONE}/instanceGroupManagers/ironwood"
    assert [w.hostname for w in hosts.workers(key)] == [m.name for m in managed]
    remove_slice(gce, "ironwood")
    with pytest.raises(gx.NotFound):
        gce.instances.get(project=PROJECT, zone=ZONE, instance=managed[0].name)


def test_refusals_in_compute_engines_words(gce):
    with pytest.raises(
        gx.NotFound, match=f"The resource 'projects/{PROJECT}/zones/{ZONE}/instances/nope' was not found"
    ):
        gce.instances.get(project=PROJECT, zone=ZONE, instance="nope")
    with pytest.raises(gx.BadRequest, match="onHostMaintenance"):
        t = template("migrate")
        t.properties.scheduling.on_host_maintenance = "MIGRATE"
        gce.templates.insert_unary(project=PROJECT, instance_template_resource=t)
    with pytest.raises(gx.BadRequest, match="machineType"):
        gce.templates.insert_unary(project=PROJECT, instance_template_resource=template("n2", "n2-standard-8"))
    gce.done(gce.policies.insert_unary(project=PROJECT, region=REGION, resource_policy_resource=policy("wp", "2x2x4")))
    with pytest.raises(gx.Conflict, match="already exists"):
        gce.policies.insert_unary(project=PROJECT, region=REGION, resource_policy_resource=policy("wp", "2x2x4"))
    gce.done(gce.templates.insert_unary(project=PROJECT, instance_template_resource=template("wp")))
    with pytest.raises(gx.BadRequest, match="takes 4 VMs"):
        gce.migs.insert_unary(project=PROJECT, zone=ZONE, instance_group_manager_resource=mig("wp", 3, "wp"))
    with pytest.raises(gx.BadRequest, match="region us-central1; the group's VMs are in region europe-west4"):
        gce.migs.insert_unary(
            project=PROJECT, zone="europe-west4-a", instance_group_manager_resource=mig("wp", 4, "wp")
        )
    with pytest.raises(gx.BadRequest, match="BULK"):
        gce.migs.insert_unary(
            project=PROJECT,
            zone=ZONE,
            instance_group_manager_resource=mig("wp", 4, "wp", target_size_policy={"mode": "BULK"}),
        )
    gce.done(gce.migs.insert_unary(project=PROJECT, zone=ZONE, instance_group_manager_resource=mig("wp", 0, "wp")))
    with pytest.raises(gx.BadRequest, match="already being used by") as used:
        gce.templates.delete_unary(project=PROJECT, instance_template="wp")
    assert used.value.errors[0]["reason"] == "resourceInUseByAnotherResource"
    with pytest.raises(gx.BadRequest, match="already being used by"):
        gce.policies.delete_unary(project=PROJECT, region=REGION, resource_policy="wp")
    remove_slice(gce, "wp")


def test_no_capacity_fails_the_instance_operation_as_compute_engine_does(emulator, gce):
    emulator.set_capacity(f"{ZONE}/tpu7x=0")
    inst = compute_v1.Instance(
        name="lonely",
        machine_type=f"zones/{ZONE}/machineTypes/tpu7x-standard-4t",
        scheduling={"on_host_maintenance": "TERMINATE"},
    )
    op = gce.instances.insert_unary(project=PROJECT, zone=ZONE, instance_resource=inst)
    with pytest.raises(gx.ServiceUnavailable) as exc:
        gce.done(op)
    assert exc.value.errors[0].code == "ZONE_RESOURCE_POOL_EXHAUSTED"
    with pytest.raises(gx.NotFound):
        gce.instances.get(project=PROJECT, zone=ZONE, instance="lonely")


def test_extended_operations_poll_the_endpoint_they_are_given(emulator, gce):
    """The client's own ExtendedOperation polls compute.googleapis.com whatever endpoint it was given; with the
    operations clients pointed at the emulator (what tpurun does), `result()` waits here and raises the
    operation's failure."""
    inst = compute_v1.Instance(
        name="single",
        machine_type=f"zones/{ZONE}/machineTypes/ct6e-standard-1t",
        scheduling={"on_host_maintenance": "TERMINATE", "provisioning_model": "SPOT"},
        metadata={"items": [{"key": "enable-guest-attributes", "value": "TRUE"}]},
    )
    gce.instances._transport._extended_operations_services["zone_operations"] = gce.zone_ops
    gce.instances.insert(project=PROJECT, zone=ZONE, instance_resource=inst).result(timeout=60)
    got = gce.instances.get(project=PROJECT, zone=ZONE, instance="single")
    assert got.status == "RUNNING" and got.name == "single"
    # a spot VM preempted: its worker dies, the VM is TERMINATED
    emulator.admin.preempt_instance("single")
    assert gce.instances.get(project=PROJECT, zone=ZONE, instance="single").status == "TERMINATED"
    old = got.metadata
    op = gce.instances.set_metadata(
        project=PROJECT,
        zone=ZONE,
        instance="single",
        metadata_resource={"fingerprint": old.fingerprint, "items": [{"key": "team", "value": "ml"}]},
    )
    op.result(timeout=30)
    with pytest.raises(gx.PreconditionFailed, match="fingerprint"):
        gce.instances.set_metadata(
            project=PROJECT, zone=ZONE, instance="single", metadata_resource={"fingerprint": old.fingerprint}
        )
    gce.instances.delete(project=PROJECT, zone=ZONE, instance="single").result(timeout=30)


def test_bulk_flex_start_group_waits_for_capacity(emulator, gce):
    """A BULK group of flex-start VMs makes none of them while the zone lacks capacity for all, and says why."""
    emulator.set_capacity(f"{ZONE}/tpu7x=4")  # one VM's worth: the slice needs two
    gce.done(
        gce.policies.insert_unary(project=PROJECT, region=REGION, resource_policy_resource=policy("flex", "2x2x2"))
    )
    t = template("flex", model="FLEX_START", instance_termination_action="DELETE", max_run_duration={"seconds": 3600})
    gce.done(gce.templates.insert_unary(project=PROJECT, instance_template_resource=t))
    body = mig("flex", 2, "flex", target_size_policy={"mode": "BULK"})
    gce.done(gce.migs.insert_unary(project=PROJECT, zone=ZONE, instance_group_manager_resource=body))
    time.sleep(0.5)
    got = gce.migs.get(project=PROJECT, zone=ZONE, instance_group_manager="flex")
    assert not got.status.is_stable and got.status.bulk_instance_operation.in_progress
    assert got.status.bulk_instance_operation.last_progress_check.error.errors[0].code == "ZONE_RESOURCE_POOL_EXHAUSTED"
    managed = list(gce.migs.list_managed_instances(project=PROJECT, zone=ZONE, instance_group_manager="flex"))
    assert len(managed) == 2 and all(not m.instance and m.current_action == "CREATING" for m in managed)
    assert managed[0].last_attempt.errors.errors[0].code == "ZONE_RESOURCE_POOL_EXHAUSTED"
    emulator.set_capacity(clear=True)
    assert wait_stable(gce, "flex").status.current_instance_statuses.running == 2
    remove_slice(gce, "flex")


def test_resize_request_brings_a_whole_slice(emulator, gce):
    make_slice(gce, "queued", "2x2x2", 0)
    rr = compute_v1.InstanceGroupManagerResizeRequest(name="go", resize_by=2, requested_run_duration={"seconds": 3600})
    gce.done(
        gce.resize_requests.insert_unary(
            project=PROJECT,
            zone=ZONE,
            instance_group_manager="queued",
            instance_group_manager_resize_request_resource=rr,
        )
    )
    wait_stable(gce, "queued")
    got = gce.resize_requests.get(project=PROJECT, zone=ZONE, instance_group_manager="queued", resize_request="go")
    assert got.state == "SUCCEEDED"
    with pytest.raises(gx.BadRequest, match="emulator resizes a TPU group only"):
        gce.migs.resize_unary(project=PROJECT, zone=ZONE, instance_group_manager="queued", size=1)
    remove_slice(gce, "queued")


def test_system_parameters_on_both_fronts(emulator, gce):
    """What every Google API accepts on any method: alt, fields, prettyPrint, quotaUser, $.xgafv."""
    gce.done(gce.policies.insert_unary(project=PROJECT, region=REGION, resource_policy_resource=policy("sys", "2x2x1")))
    base = f"{emulator.endpoint}/compute/v1/projects/{PROJECT}/regions/{REGION}/resourcePolicies"
    raw = urllib.request.urlopen(
        f"{base}?alt=json&fields=items(name,status),kind&prettyPrint=false&quotaUser=me&%24.xgafv=2"
    ).read()
    assert json.loads(raw) == {"kind": "compute#resourcePolicyList", "items": [{"name": "sys", "status": "READY"}]}
    assert b"\n" not in raw
    pretty = urllib.request.urlopen(f"{base}/sys?fields=workloadPolicy/acceleratorTopology").read()
    assert json.loads(pretty) == {"workloadPolicy": {"acceleratorTopology": "2x2x1"}} and b"\n" in pretty
    # list filters, through the client: the forms docs/emulator.md names
    names = lambda f: [p.name for p in gce.policies.list(request={"project": PROJECT, "region": REGION, "filter": f})]  # noqa: E731
    assert names('name = "sys"') == ["sys"] and names("name != sys") == []
    assert names("name eq s.s AND status = READY") == ["sys"] and names("name ne s.*") == []
    with pytest.raises(gx.BadRequest, match="filter"):
        names("name ~ sys")
    tpu = urllib.request.urlopen(
        f"{emulator.endpoint}/v2/{emulator.parent}/nodes?alt=json&prettyPrint=false&quotaUser=x"
    )
    assert json.loads(tpu.read()) == {}
    with pytest.raises(urllib.error.HTTPError) as bad:
        urllib.request.urlopen(f"{base}?alt=proto")
    assert bad.value.code == 400 and json.loads(bad.value.read())["error"]["errors"][0]["reason"] == "invalid"
    gce.done(gce.policies.delete_unary(project=PROJECT, region=REGION, resource_policy="sys"))


def test_injected_faults_answer_in_compute_engines_shape(emulator, gce):
    emulator.fail_api(1, 429, "/compute/v1/")
    with pytest.raises(gx.TooManyRequests) as exc:
        gce.policies.list(project=PROJECT, region=REGION)
    assert exc.value.errors[0]["reason"] == "rateLimitExceeded"
    assert list(gce.policies.list(project=PROJECT, region=REGION)) == []


def test_discovery_based_client_shapes(emulator, gce):
    """googleapiclient (SkyPilot's and Ray's GCP code) builds requests from the API description: `alt=json` on
    every call, bodies as plain JSON; both fronts answer it."""
    from googleapiclient import discovery

    compute = discovery.build(
        "compute",
        "v1",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": f"{emulator.endpoint}/compute/v1/"},
        static_discovery=True,
        cache_discovery=False,
    )
    op = (
        compute.resourcePolicies()
        .insert(
            project=PROJECT,
            region=REGION,
            body={"name": "disc", "workloadPolicy": {"type": "HIGH_THROUGHPUT", "acceleratorTopology": "2x2x1"}},
        )
        .execute()
    )
    done = compute.regionOperations().wait(project=PROJECT, region=REGION, operation=op["name"]).execute()
    assert done["status"] == "DONE"
    got = compute.resourcePolicies().list(project=PROJECT, region=REGION).execute()
    assert [p["name"] for p in got["items"]] == ["disc"]
    gone = compute.resourcePolicies().delete(project=PROJECT, region=REGION, resourcePolicy="disc").execute()
    compute.regionOperations().wait(project=PROJECT, region=REGION, operation=gone["name"]).execute()
    tpu = discovery.build(
        "tpu",
        "v2",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": emulator.endpoint},
        static_discovery=True,
        cache_discovery=False,
    )
    assert tpu.projects().locations().nodes().list(parent=emulator.parent).execute() == {}
