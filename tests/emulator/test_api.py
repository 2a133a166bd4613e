"""The emulated Cloud TPU API, driven only through the real google-cloud-tpu REST client."""

from __future__ import annotations

import re
import time

import pytest
from google.api_core import exceptions as gx
from google.cloud import tpu_v2
from google.cloud.location import locations_pb2
from google.longrunning import operations_pb2
from google.protobuf import field_mask_pb2

from tests.helpers import delete_every_tpu
from tpurun.emulator.pytest_plugin import fast_polling
from tpurun.topology import all_accelerator_types

pytestmark = pytest.mark.integration
RUNTIME = "tpu-ubuntu2204-base"
OP_NAME = re.compile(r"^projects/[^/]+/locations/[^/]+/operations/operation-[\w-]+$")


def node_msg(accel: str = "v4-8", **kw):
    return tpu_v2.Node(accelerator_type=accel, runtime_version=RUNTIME, **kw)


def create(client, emulator, node_id: str, accel: str = "v4-8", **kw):
    return client.create_node(parent=emulator.parent, node_id=node_id, node=node_msg(accel, **kw))


def delete(client, name: str) -> None:
    client.delete_node(request={"name": name}).result(polling=fast_polling())


def test_node_lifecycle_and_lro_shapes(emulator, tpu_client):
    emulator.set_delays(create=0.4)
    op = create(tpu_client, emulator, "life", "v4-8", labels={"team": "ml"})
    assert OP_NAME.match(op.operation.name)
    assert not op.done()
    meta = tpu_v2.OperationMetadata.deserialize(op.operation.metadata.value)
    assert meta.verb == "create" and meta.target == emulator.node_name("life")
    assert tpu_client.get_node(name=emulator.node_name("life")).state == tpu_v2.Node.State.CREATING

    node = op.result(polling=fast_polling())
    assert node.state == tpu_v2.Node.State.READY
    assert node.health == tpu_v2.Node.Health.HEALTHY
    assert node.accelerator_config.type_ == tpu_v2.AcceleratorConfig.Type.V4
    assert node.accelerator_config.topology == "2x2x1"
    assert node.api_version == tpu_v2.Node.ApiVersion.V2
    assert node.labels["team"] == "ml" and node.id and node.create_time
    (ep,) = node.network_endpoints
    assert re.match(r"^127\.77\.\d+\.1$", ep.ip_address) and ep.port == 8470
    assert not ep.access_config.external_ip  # enableExternalIps was not set

    got = tpu_client.get_node(name=node.name)
    assert got.name == node.name and got.state == tpu_v2.Node.State.READY
    assert node.name in [n.name for n in tpu_client.list_nodes(parent=emulator.parent)]

    op = tpu_client.delete_node(request={"name": node.name})
    assert tpu_client.get_node(name=node.name).state == tpu_v2.Node.State.DELETING
    op.result(polling=fast_polling())
    assert op.operation.done and op.operation.response.type_url == "type.googleapis.com/google.protobuf.Empty"
    with pytest.raises(gx.NotFound, match="was not found"):
        tpu_client.get_node(name=node.name)


def test_external_ips_and_accelerator_config(emulator, tpu_client):
    node = tpu_v2.Node(
        runtime_version=RUNTIME,
        accelerator_config=tpu_v2.AcceleratorConfig(type_=tpu_v2.AcceleratorConfig.Type.V4, topology="2x2x2"),
        network_config=tpu_v2.NetworkConfig(enable_external_ips=True),
    )
    n = tpu_client.create_node(parent=emulator.parent, node_id="cfg", node=node).result(polling=fast_polling())
    try:
        assert n.accelerator_type == "v4-16" and len(n.network_endpoints) == 2
        assert [e.access_config.external_ip for e in n.network_endpoints] == [e.ip_address for e in n.network_endpoints]
    finally:
        delete(tpu_client, n.name)


def test_paging(emulator, tpu_client):
    ops = [create(tpu_client, emulator, f"page-{i}") for i in range(3)]
    names = [op.result(polling=fast_polling()).name for op in ops]
    try:
        pager = tpu_client.list_nodes(request={"parent": emulator.parent, "page_size": 2})
        pages = list(pager.pages)
        assert [len(p.nodes) for p in pages][:2] == [2, 1] or len(pages) >= 2
        assert sorted(n.name for p in pages for n in p.nodes if n.name in names) == sorted(names)
        assert pages[0].next_page_token and not pages[-1].next_page_token
        types = [
            t.type_ for t in tpu_client.list_accelerator_types(request={"parent": emulator.parent, "page_size": 7})
        ]
        assert types == all_accelerator_types("tpu-api")  # TPU7x: Compute Engine only
    finally:
        for n in names:
            delete(tpu_client, n)


def test_invalid_requests(emulator, tpu_client):
    start = emulator.request_count()
    cases = [
        ("v4-7", RUNTIME, "ok-id", "not a valid v4 size"),
        ("v9-8", RUNTIME, "ok-id", "unknown TPU generation"),
        ("v4-8", "", "ok-id", "runtime_version"),
        ("v4-8", "tpu-vm-bogus", "ok-id", "Unsupported TPU runtime version"),
        ("v4-8", RUNTIME, "Upper", "node_id"),
        ("v4-8", RUNTIME, "1abc", "node_id"),
        ("v4-8", RUNTIME, "ends-", "node_id"),
        ("v4-8", RUNTIME, "a" * 64, "node_id"),
    ]
    for accel, runtime, nid, msg in cases:
        with pytest.raises(gx.BadRequest, match=msg):
            tpu_client.create_node(
                parent=emulator.parent, node_id=nid, node=tpu_v2.Node(accelerator_type=accel, runtime_version=runtime)
            )
    with pytest.raises(gx.BadRequest, match="metadata"):
        create(tpu_client, emulator, "badmd", metadata={"bad key!": "x"})
    # every rejected create was answered 400 and no node came to exist
    # (only this test's creates: a previous test's background polls may also land in the log)
    log = [r for r in emulator.requests(start) if r["method"] == "POST" and r["path"].endswith("/nodes")]
    assert len(log) == len(cases) + 1 and all(r["status"] == 400 for r in log)
    assert not [n for n in tpu_client.list_nodes(parent=emulator.parent) if n.name.endswith("/ok-id")]


def test_unknown_field_is_invalid_argument(emulator):
    # No client can send a field its proto does not have, so this one request is made by hand:
    # it checks that bodies are parsed strictly, as Google's front end does.
    import json
    import urllib.error
    import urllib.request

    body = json.dumps({"acceleratorType": "v4-8", "runtimeVersion": RUNTIME, "acceleratorTypo": "x"}).encode()
    req = urllib.request.Request(
        f"{emulator.endpoint}/v2/{emulator.parent}/nodes?nodeId=typo",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=10)
    err = json.loads(ei.value.read())["error"]
    assert ei.value.code == 400 and err["status"] == "INVALID_ARGUMENT"
    assert 'Unknown name "acceleratorTypo"' in err["message"]


def test_duplicate_and_not_found(emulator, tpu_client):
    n = create(tpu_client, emulator, "dup").result(polling=fast_polling())
    try:
        with pytest.raises(gx.Conflict, match="already exists"):
            create(tpu_client, emulator, "dup")
    finally:
        delete(tpu_client, n.name)
    for call in (
        lambda: tpu_client.get_node(name=emulator.node_name("nope")),
        lambda: tpu_client.delete_node(request={"name": emulator.node_name("nope")}),
        lambda: tpu_client.stop_node(request={"name": emulator.node_name("nope")}),
        lambda: tpu_client.get_operation(
            operations_pb2.GetOperationRequest(name=f"{emulator.parent}/operations/operation-nope")
        ),
        lambda: tpu_client.get_accelerator_type(name=f"{emulator.parent}/acceleratorTypes/v4-7"),
        lambda: tpu_client.get_runtime_version(name=f"{emulator.parent}/runtimeVersions/nope"),
        lambda: tpu_client.get_queued_resource(name=f"{emulator.parent}/queuedResources/nope"),
    ):
        with pytest.raises(gx.NotFound):
            call()


def test_stop_start_single_host(emulator, tpu_client):
    n = create(tpu_client, emulator, "stopper").result(polling=fast_polling())
    try:
        key_before = emulator.node_info(n.name)["workers"][0]["hostKey"]
        stopped = tpu_client.stop_node(request={"name": n.name}).result(polling=fast_polling())
        assert stopped.state == tpu_v2.Node.State.STOPPED
        assert emulator.node_info(n.name)["workers"] == []  # the worker is down
        with pytest.raises(gx.BadRequest, match="READY"):
            tpu_client.stop_node(request={"name": n.name})
        started = tpu_client.start_node(request={"name": n.name}).result(polling=fast_polling())
        assert started.state == tpu_v2.Node.State.READY
        info = emulator.node_info(n.name)["workers"][0]
        assert info["initPid"] and info["hostKey"] == key_before  # same VM disk, same host key
    finally:
        delete(tpu_client, n.name)


def test_multi_host_cannot_stop(emulator, tpu_client):
    n = create(tpu_client, emulator, "podstop", "v4-16").result(polling=fast_polling())
    try:
        with pytest.raises(gx.BadRequest, match="multi-host"):
            tpu_client.stop_node(request={"name": n.name})
        assert tpu_client.get_node(name=n.name).state == tpu_v2.Node.State.READY
    finally:
        delete(tpu_client, n.name)


def test_update(emulator, tpu_client):
    n = create(tpu_client, emulator, "upd", metadata={"keep": "1"}).result(polling=fast_polling())
    try:
        changed = tpu_client.update_node(
            node=tpu_v2.Node(name=n.name, labels={"a": "b"}, description="hi", metadata={"keep": "1", "new": "2"}),
            update_mask=field_mask_pb2.FieldMask(paths=["labels", "description", "metadata"]),
        ).result(polling=fast_polling())
        assert dict(changed.labels) == {"a": "b"} and changed.description == "hi"
        assert dict(tpu_client.get_node(name=n.name).metadata) == {"keep": "1", "new": "2"}
        ext = tpu_client.update_node(
            node=tpu_v2.Node(name=n.name, network_config=tpu_v2.NetworkConfig(enable_external_ips=True)),
            update_mask=field_mask_pb2.FieldMask(paths=["network_config.enable_external_ips"]),
        ).result(polling=fast_polling())
        assert ext.network_endpoints[0].access_config.external_ip == ext.network_endpoints[0].ip_address
        with pytest.raises(gx.BadRequest, match="update_mask"):
            tpu_client.update_node(
                node=tpu_v2.Node(name=n.name, runtime_version="x"),
                update_mask=field_mask_pb2.FieldMask(paths=["runtime_version"]),
            )
    finally:
        delete(tpu_client, n.name)


def test_guest_attributes_filters(emulator, tpu_client):
    n = create(tpu_client, emulator, "ga", "v4-16").result(polling=fast_polling())
    try:
        everything = tpu_client.get_guest_attributes(request={"name": n.name})
        assert len(everything.guest_attributes) == 2
        keys = tpu_client.get_guest_attributes(request={"name": n.name, "query_path": "hostkeys/"})
        for entry in keys.guest_attributes:
            assert entry.query_path == "hostkeys/"
            assert {(i.namespace, i.key) for i in entry.query_value.items} >= {("hostkeys", "ssh-ed25519")}
            assert all(i.namespace == "hostkeys" for i in entry.query_value.items)
        one = tpu_client.get_guest_attributes(
            request={"name": n.name, "query_path": "hostkeys/ssh-ed25519", "worker_ids": ["1"]}
        )
        (entry,) = one.guest_attributes
        # the guest agent's form: the key type is the attribute's key, its value the base64 key alone
        assert f"ssh-ed25519 {entry.query_value.items[0].value}" == emulator.node_info(n.name)["workers"][1]["hostKey"]
        with pytest.raises(gx.BadRequest, match="worker"):
            tpu_client.get_guest_attributes(request={"name": n.name, "worker_ids": ["5"]})
    finally:
        delete(tpu_client, n.name)


def test_operations_endpoints(emulator, tpu_client):
    # the zone's operations may include those of v2alpha1's methods (a file before ran maintenance through them): their
    # metadata is v2alpha1's message, which the listing decodes only where its descriptors are loaded
    from google.cloud import tpu_v2alpha1  # noqa: F401

    op = create(tpu_client, emulator, "opsn")
    node = op.result(polling=fast_polling())
    try:
        got = tpu_client.get_operation(operations_pb2.GetOperationRequest(name=op.operation.name))
        assert got.done and got.response.type_url == "type.googleapis.com/google.cloud.tpu.v2.Node"
        listed = tpu_client.list_operations(operations_pb2.ListOperationsRequest(name=emulator.parent))
        assert op.operation.name in [o.name for o in listed.operations]
        tpu_client.cancel_operation(operations_pb2.CancelOperationRequest(name=op.operation.name))
        tpu_client.delete_operation(operations_pb2.DeleteOperationRequest(name=op.operation.name))
        with pytest.raises(gx.NotFound):
            tpu_client.get_operation(operations_pb2.GetOperationRequest(name=op.operation.name))
    finally:
        delete(tpu_client, node.name)


def test_catalogue_and_locations(emulator, tpu_client):
    at = tpu_client.get_accelerator_type(name=f"{emulator.parent}/acceleratorTypes/v4-32")
    assert at.type_ == "v4-32" and at.accelerator_configs[0].topology == "2x2x4"
    versions = [v.version for v in tpu_client.list_runtime_versions(parent=emulator.parent)]
    assert RUNTIME in versions and "v2-alpha-tpuv6e" in versions
    rv = tpu_client.get_runtime_version(name=f"{emulator.parent}/runtimeVersions/{RUNTIME}")
    assert rv.version == RUNTIME
    locs = tpu_client.list_locations(locations_pb2.ListLocationsRequest(name=f"projects/{emulator.project}"))
    assert emulator.zone in [loc.location_id for loc in locs.locations]
    assert tpu_client.get_location(locations_pb2.GetLocationRequest(name=emulator.parent)).location_id == emulator.zone
    ident = tpu_client.generate_service_identity(request={"parent": emulator.parent})
    assert ident.identity.email.endswith("gserviceaccount.com")


def _zone_emptied(emulator, tpu_client) -> None:
    """No TPU in any zone, so that a capacity counts this test's alone (the emulator is the test process's, a file
    before may have left a TPU deleting, and a capacity for any zone counts every zone's)."""
    delete_every_tpu(emulator)
    every_zone = emulator.parent.rsplit("/", 1)[0] + "/-"
    deadline = time.monotonic() + 120
    while list(tpu_client.list_nodes(parent=every_zone)) and time.monotonic() < deadline:
        time.sleep(0.2)
    with emulator.emu.lock:  # a file before may have left a TPU in a project of its own, which the list omits
        held = [(r.node.name, r.state) for r in emulator.emu.nodes.values() if r.holds]
    assert not held, f"TPUs hold capacity this test counts: {held}"


def test_capacity_exhausted_fails_the_operation(emulator, tpu_client):
    _zone_emptied(emulator, tpu_client)
    emulator.set_capacity("v4=8")  # chips, any zone
    first = create(tpu_client, emulator, "cap-a", "v4-8").result(polling=fast_polling())  # 4 chips
    try:
        op = create(tpu_client, emulator, "cap-b", "v4-16")  # 8 more chips: over
        with pytest.raises(gx.ResourceExhausted, match="no more capacity"):
            op.result(polling=fast_polling())
        assert op.operation.error.code == 8
        with pytest.raises(gx.NotFound):
            tpu_client.get_node(name=emulator.node_name("cap-b"))
        # another zone is not this zone's capacity... unless the limit is for any zone
        emulator.set_capacity("us-central1-a/v4=1h")
        other = tpu_client.create_node(
            parent=f"projects/{emulator.project}/locations/us-central1-a", node_id="cap-c", node=node_msg("v4-16")
        )
        with pytest.raises(gx.ResourceExhausted):
            other.result(polling=fast_polling())
    finally:
        delete(tpu_client, first.name)


def test_too_many_workers(emulator, tpu_client):
    emulator.emu.config.max_workers_per_node = 2
    with pytest.raises(gx.ResourceExhausted, match="emulator cannot host v4-32"):
        create(tpu_client, emulator, "huge", "v4-32").result(polling=fast_polling())


def _qr(emulator, node_id: str, accel: str = "v4-8", **kw) -> tpu_v2.QueuedResource:
    spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=emulator.parent, node_id=node_id, node=node_msg(accel))
    return tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]), **kw)


def _wait_qr(client, name: str, state: str, timeout: float = 30) -> tpu_v2.QueuedResource:
    want = tpu_v2.QueuedResourceState.State[state]
    deadline = time.time() + timeout
    while True:
        qr = client.get_queued_resource(name=name)
        if qr.state.state == want:
            return qr
        assert time.time() < deadline, f"{name} stuck in {qr.state.state.name}, wanted {state}"
        time.sleep(0.05)


def test_queued_resource_waits_for_capacity(emulator, tpu_client):
    _zone_emptied(emulator, tpu_client)
    emulator.set_capacity("v4=4")
    blocker = create(tpu_client, emulator, "qr-blocker").result(polling=fast_polling())
    qname = f"{emulator.parent}/queuedResources/qr1"
    op = tpu_client.create_queued_resource(
        parent=emulator.parent,
        queued_resource_id="qr1",
        queued_resource=_qr(emulator, "qr-node", spot=tpu_v2.QueuedResource.Spot()),
    )
    op.result(polling=fast_polling())
    time.sleep(0.5)
    assert tpu_client.get_queued_resource(name=qname).state.state.name == "WAITING_FOR_RESOURCES"
    assert qname in [q.name for q in tpu_client.list_queued_resources(parent=emulator.parent)]
    delete(tpu_client, blocker.name)  # frees the capacity
    _wait_qr(tpu_client, qname, "ACTIVE")
    node = tpu_client.get_node(name=emulator.node_name("qr-node"))
    assert node.queued_resource == qname and node.state == tpu_v2.Node.State.READY
    assert node.scheduling_config.spot
    with pytest.raises(gx.BadRequest, match="force"):
        tpu_client.delete_queued_resource(request={"name": qname})
    tpu_client.delete_queued_resource(request={"name": qname, "force": True}).result(polling=fast_polling())
    with pytest.raises(gx.NotFound):
        tpu_client.get_queued_resource(name=qname)
    with pytest.raises(gx.NotFound):
        tpu_client.get_node(name=emulator.node_name("qr-node"))


def test_queued_resource_failed_and_reset(emulator, tpu_client):
    emulator.set_capacity("v4=4")
    qname = f"{emulator.parent}/queuedResources/qr-big"
    tpu_client.create_queued_resource(
        parent=emulator.parent, queued_resource_id="qr-big", queued_resource=_qr(emulator, "qr-big-node", "v4-16")
    ).result(polling=fast_polling())
    failed = _wait_qr(tpu_client, qname, "FAILED")
    assert failed.state.failed_data.error.code == 8
    emulator.set_capacity(clear=True)
    tpu_client.reset_queued_resource(name=qname).result(polling=fast_polling())
    _wait_qr(tpu_client, qname, "ACTIVE")
    delete(tpu_client, emulator.node_name("qr-big-node"))
    assert _wait_qr(tpu_client, qname, "SUSPENDED")
    tpu_client.delete_queued_resource(request={"name": qname}).result(polling=fast_polling())


def test_injected_api_failures_and_request_log(emulator, tpu_client):
    start = emulator.request_count()
    emulator.fail_api(2, 503)
    for _ in range(2):
        with pytest.raises(gx.ServiceUnavailable):
            list(tpu_client.list_nodes(parent=emulator.parent))
    list(tpu_client.list_nodes(parent=emulator.parent))
    for code, exc in ((429, gx.TooManyRequests), (403, gx.Forbidden), (500, gx.InternalServerError)):
        emulator.fail_api(1, code, match="POST /v2/")
        tpu_client.get_accelerator_type(name=f"{emulator.parent}/acceleratorTypes/v4-8")  # GET: not matched
        with pytest.raises(exc):
            create(tpu_client, emulator, "never")
    # this test's own calls (an earlier test's background work may reach the API meanwhile)
    mine = (f"{emulator.parent}/nodes", f"{emulator.parent}/acceleratorTypes/v4-8")
    log = [r for r in emulator.requests(start) if r["path"].split("?")[0].endswith(mine)]
    assert [r["status"] for r in log] == [503, 503, 200, 200, 429, 200, 403, 200, 500], emulator.requests(start)
    # the log is what proves the create calls never got through
    assert not any(r["status"] == 200 and r["method"] == "POST" for r in log)


def test_preempt_spot_node(emulator, tpu_client):
    n = create(tpu_client, emulator, "spotty", scheduling_config=tpu_v2.SchedulingConfig(spot=True)).result(
        polling=fast_polling()
    )
    on_demand = create(tpu_client, emulator, "ondemand").result(polling=fast_polling())
    try:
        pids = emulator.node_info(n.name)["workers"][0]["rootPids"]
        assert pids
        emulator.preempt("spotty")
        assert tpu_client.get_node(name=n.name).state == tpu_v2.Node.State.PREEMPTED
        time.sleep(0.2)
        import os

        assert not [p for p in pids if os.path.exists(f"/proc/{p}")]
        with pytest.raises(Exception, match="not a spot"):
            emulator.preempt("ondemand")
    finally:
        delete(tpu_client, n.name)
        delete(tpu_client, on_demand.name)
