"""Multislice TPUs through the real CLI, the real google-cloud-tpu client and real sshd workers: one
queued resource with multisliceParams makes the slices, and the name stands for all of them."""

from __future__ import annotations

import json

import pytest

from tests.helpers import assert_clean_error

pytestmark = pytest.mark.integration

TPU_ENV = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/tpu-env"


def _leftovers(emulator) -> tuple[list[str], list[str]]:
    client = emulator.client()
    nodes = [n.name for n in client.list_nodes(parent=emulator.parent)]
    qrs = [q.name for q in client.list_queued_resources(parent=emulator.parent)]
    return nodes, qrs


def test_two_slices_of_v4_16_create_exec_describe_delete(cli, emulator):
    r = cli("create", "ms", "-t", "v4-16", "--slices", "2", "--json")
    assert r.code == 0, r.err
    d = json.loads(r.out)
    assert d["state"] == "ACTIVE" and d["acceleratorType"] == "v4-16"
    assert [w["name"] for w in d["workerEndpoints"]] == ["s0/w0", "s0/w1", "s1/w0", "s1/w1"]
    assert [w["startup"] for w in d["workerEndpoints"]] == ["done"] * 4
    assert [s["name"] for s in d["slices"]] == ["ms-0", "ms-1"]
    assert 'tpu = "ms"' in (cli.cwd / "tpurun.toml").read_text()

    # what Cloud TPU says about each slice, through the real client
    client = emulator.client()
    for i in range(2):
        node = client.get_node(name=emulator.node_name(f"ms-{i}"))
        assert node.multislice_node and node.queued_resource.endswith("/queuedResources/ms")
    spec = client.get_queued_resource(name=f"{emulator.parent}/queuedResources/ms").tpu.node_spec[0]
    assert (spec.multislice_params.node_count, spec.multislice_params.node_id_prefix) == (2, "ms")

    # every worker of every slice answers, named sS/wN
    r = cli("exec", "--", "hostname")
    assert r.code == 0, r.err
    tags = [line.split("]")[0] + "]" for line in r.out.splitlines()]
    assert sorted(tags) == ["[s0/w0]", "[s0/w1]", "[s1/w0]", "[s1/w1]"]
    assert len({line.split("] ", 1)[1] for line in r.out.splitlines()}) == 4
    assert "s1/w1" in r.err  # the summary table

    # each worker's own metadata server gives the MEGASCALE values that join the slices
    r = cli("exec", "--", "curl", "-sf", "-H", "Metadata-Flavor: Google", TPU_ENV)
    assert r.code == 0, r.err
    coordinator = d["workerEndpoints"][0]["internalIp"]
    for tag, slice_id in (("[s0/w0]", "0"), ("[s0/w1]", "0"), ("[s1/w0]", "1"), ("[s1/w1]", "1")):
        env = dict(
            line.split("] ", 1)[1].replace("'", "").split(": ", 1) for line in r.out.splitlines() if line.startswith(tag)
        )
        assert env["MEGASCALE_SLICE_ID"] == slice_id and env["MEGASCALE_NUM_SLICES"] == "2"
        assert env["MEGASCALE_COORDINATOR_ADDRESS"] == f"{coordinator}:{env['MEGASCALE_PORT']}"

    desc = json.loads(cli("describe", "ms", "--json").out)
    assert [w["name"] for w in desc["workerEndpoints"]] == ["s0/w0", "s0/w1", "s1/w0", "s1/w1"]
    listed = {n["name"]: n.get("multislice") for n in json.loads(cli("list", "--json").out)}
    assert listed == {"ms-0": {"tpu": "ms", "slice": 0}, "ms-1": {"tpu": "ms", "slice": 1}}

    r = cli("delete", "ms-1", "--yes")  # one slice alone: refused, the slices go together
    assert_clean_error(r, 2)
    assert "tpurun delete ms" in r.err
    r = cli("delete", "ms", "--yes")
    assert r.code == 0, r.err
    assert "queued resource" in r.err
    assert _leftovers(emulator) == ([], [])
    assert "tpu" not in (cli.cwd / "tpurun.toml").read_text() if (cli.cwd / "tpurun.toml").exists() else True


@pytest.mark.parametrize(
    "args,needle",
    [
        (["create", "z", "-t", "v4-16", "--slices", "0"], "--slices 0"),
        (["create", "z", "-t", "v3-32", "--slices", "2"], "v4 and newer"),
        (["create", "z", "-t", "v2-8", "--slices", "3"], "v4 and newer"),
    ],
)
def test_bad_slices_create_nothing(cli, emulator, args, needle):
    before = emulator.request_count()
    r = cli(*args)
    assert_clean_error(r, 2)
    assert needle in r.err
    assert emulator.requests(before) == [], "bad input must not reach the API"


def test_slices_with_a_name_that_exists_creates_nothing(cli, emulator):
    assert cli("create", "taken", "-t", "v4-8").code == 0
    before = _leftovers(emulator)
    r = cli("create", "taken", "-t", "v4-16", "--slices", "2")
    assert_clean_error(r, 2)
    assert "taken" in r.err and "already exist" in r.err
    assert _leftovers(emulator) == before
    # a slice's name taken by a plain node: refused the same way, before anything is asked for
    assert cli("delete", "taken", "--yes").code == 0
    assert cli("create", "taken-1", "-t", "v4-8").code == 0
    before = _leftovers(emulator)
    r = cli("create", "taken", "-t", "v4-16", "--slices", "2")
    assert_clean_error(r, 2)
    assert "taken-1" in r.err
    assert _leftovers(emulator) == before
