"""Cloud TPU v2alpha1 in the emulator, through googleapiclient's client built from Google's own v2alpha1
discovery document (what `gcloud alpha compute tpus` and v2alpha1 clients call): nodes, guest attributes,
operations, accelerator types, runtime versions, reservations and queued resources, in v2alpha1's shapes."""

from __future__ import annotations

import pytest
from google.cloud import tpu_v2alpha1
from google.longrunning import operations_pb2
from googleapiclient.errors import HttpError

from tests.emulator.test_maintenance import Alpha, until
from tpurun.emulator.pytest_plugin import DEFAULT_PROJECT, DEFAULT_ZONE

pytestmark = pytest.mark.integration

PARENT = f"projects/{DEFAULT_PROJECT}/locations/{DEFAULT_ZONE}"
ALPHA = "type.googleapis.com/google.cloud.tpu.v2alpha1."


@pytest.fixture
def alpha(emulator):
    a = Alpha(emulator.endpoint)
    yield a
    for qr in a.api.queuedResources().list(parent=PARENT).execute().get("queuedResources", []):
        a.done(a.api.queuedResources().delete(name=qr["name"], force=True).execute())
    for node in a.api.nodes().list(parent=PARENT).execute().get("nodes", []):
        a.done(a.api.nodes().delete(name=node["name"]).execute())


def test_a_node_through_v2alpha1(alpha, tpu_client):
    """A node made, read, asked for guest attributes and deleted through v2alpha1; its operations typed
    v2alpha1; the catalogue and reservations answer; a v2-only field is refused as v2alpha1 refuses it."""
    nodes = alpha.api.nodes()
    body = {"acceleratorType": "v4-16", "runtimeVersion": "tpu-ubuntu2204-base",
            "schedulingConfig": {"provisioningModel": "SPOT"}, "autocheckpointEnabled": True}  # fmt: skip
    op = nodes.create(parent=PARENT, nodeId="alf", body=body).execute()
    assert op["metadata"]["@type"] == ALPHA + "OperationMetadata" and op["metadata"]["apiVersion"] == "v2alpha1"
    done = alpha.done(op)
    assert done["response"]["@type"] == ALPHA + "Node" and done["response"]["name"] == f"{PARENT}/nodes/alf"
    node = alpha.node(f"{PARENT}/nodes/alf")
    assert (node["state"], node["schedulingConfig"].get("spot")) == ("READY", True), node
    assert [n["name"] for n in nodes.list(parent=PARENT).execute()["nodes"]] == [node["name"]]

    until(lambda: nodes.getGuestAttributes(name=node["name"], body={"queryPath": "hostkeys/"}).execute())
    got = nodes.getGuestAttributes(name=node["name"], body={"queryPath": "hostkeys/", "workerIds": ["1"]}).execute()
    (one,) = got["guestAttributes"]  # worker 1's alone
    assert {i["namespace"] for i in one["queryValue"]["items"]} == {"hostkeys"}, got

    listed = alpha.api.operations().list(name=PARENT).execute()["operations"]
    assert op["name"] in [o["name"] for o in listed]
    assert all(o["metadata"]["@type"] == ALPHA + "OperationMetadata" for o in listed)
    # Google's v2 client lists it too, decoding its v2alpha1 Node (whose enum of API versions has no V2)
    v2_listed = tpu_client.list_operations(operations_pb2.ListOperationsRequest(name=PARENT)).operations
    (mine,) = [o for o in v2_listed if o.name == op["name"]]
    made = tpu_v2alpha1.Node.pb()()
    assert mine.response.Unpack(made) and made.name == node["name"], mine

    types = alpha.api.acceleratorTypes()
    assert "v4-16" in [t["type"] for t in types.list(parent=PARENT).execute()["acceleratorTypes"]]
    v5e = types.get(name=f"{PARENT}/acceleratorTypes/v5litepod-8").execute()
    assert v5e["acceleratorConfigs"][0]["topology"] == "2x4"
    versions = alpha.api.runtimeVersions()
    assert "tpu-ubuntu2204-base" in [v["version"] for v in versions.list(parent=PARENT).execute()["runtimeVersions"]]
    assert versions.get(name=f"{PARENT}/runtimeVersions/tpu-ubuntu2204-base").execute()["version"]
    assert alpha.api.reservations().list(parent=PARENT).execute() == {}

    with pytest.raises(HttpError, match='Unknown name "protectionTier"'):
        nodes.create(parent=PARENT, nodeId="v2only", body={**body, "protectionTier": "ALWAYS_ON"}).execute()
    alpha.done(nodes.delete(name=node["name"]).execute())
    with pytest.raises(HttpError) as e:
        alpha.node(node["name"])
    assert e.value.resp.status == 404


def test_a_queued_resource_in_v2alpha1s_shape(alpha):
    """A queued resource of two slices asks with v2alpha1's `multiNodeParams` and `bestEffort`; it answers in
    the same shape, makes its slices' nodes and goes with them; v2's `multisliceParams` is not v2alpha1's."""
    queued = alpha.api.queuedResources()
    node = {"acceleratorType": "v4-8", "runtimeVersion": "tpu-ubuntu2204-base"}
    spec = {"parent": PARENT, "node": node, "multiNodeParams": {"nodeCount": 2, "nodeIdPrefix": "qa"}}
    with pytest.raises(HttpError, match='Unknown name "multisliceParams"'):
        bad = {"tpu": {"nodeSpec": [{"parent": PARENT, "node": node, "multisliceParams": {"nodeCount": 2}}]}}
        queued.create(parent=PARENT, queuedResourceId="qa", body=bad).execute()
    op = queued.create(parent=PARENT, queuedResourceId="qa", body={"tpu": {"nodeSpec": [spec]}, "bestEffort": {}})
    done = alpha.done(op.execute())
    assert done["response"]["@type"] == ALPHA + "QueuedResource"
    name = f"{PARENT}/queuedResources/qa"
    until(lambda: queued.get(name=name).execute()["state"]["state"] == "ACTIVE", timeout=60)
    got = queued.get(name=name).execute()
    (shown,) = got["tpu"]["nodeSpec"]
    assert shown["multiNodeParams"] == {"nodeCount": 2, "nodeIdPrefix": "qa"} and "multisliceParams" not in shown
    assert "spot" in got, got
    assert [q["name"] for q in queued.list(parent=PARENT).execute()["queuedResources"]] == [name]
    slices = sorted(n["name"].rsplit("/", 1)[-1] for n in alpha.api.nodes().list(parent=PARENT).execute()["nodes"])
    assert slices == ["qa-0", "qa-1"]
    alpha.done(queued.delete(name=name, force=True).execute())
    assert alpha.api.nodes().list(parent=PARENT).execute().get("nodes", []) == []
