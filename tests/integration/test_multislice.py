"""Multislice TPUs through the real CLI, the real google-cloud-tpu client and real sshd workers: one
queued resource with multisliceParams makes the slices, and the name stands for all of them. The tests that
train on two v4-16 slices share them; those that make, delete, preempt or take down a TPU make their own."""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.helpers import assert_clean_error, by_tag, finish, job_pids, popen, read_until
from tests.integration.conftest import one_pod_per_file

pytestmark = pytest.mark.integration

SHARED = "two"  # two v4-16 slices, two-0 and two-1: each shared test's default TPU
shared_pod, cli = one_pod_per_file(SHARED, "v4-16", "--slices", "2")

TPU_ENV = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/tpu-env"


def _leftovers(emulator) -> tuple[list[str], list[str]]:
    """The nodes and queued resources there, but the shared slices'."""
    client = emulator.client()
    shared = {emulator.node_name(f"{SHARED}-{i}") for i in range(2)} | {f"{emulator.parent}/queuedResources/{SHARED}"}
    nodes = [n.name for n in client.list_nodes(parent=emulator.parent) if n.name not in shared]
    qrs = [q.name for q in client.list_queued_resources(parent=emulator.parent) if q.name not in shared]
    return nodes, qrs


def test_two_slices_of_v4_16_create_exec_describe_delete(own_cli, emulator):
    cli = own_cli
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

    # attach (another machine would): every slice's host keys pinned again, ssh key already there
    r = cli("attach", "ms", "--json")
    assert r.code == 0, r.err
    assert [w["name"] for w in json.loads(r.out)["workerEndpoints"]] == ["s0/w0", "s0/w1", "s1/w0", "s1/w1"]

    desc = json.loads(cli("describe", "ms", "--json").out)
    assert [w["name"] for w in desc["workerEndpoints"]] == ["s0/w0", "s0/w1", "s1/w0", "s1/w1"]
    listed = {n["name"]: n.get("multislice") for n in json.loads(cli("list", "--json").out) if n["name"].startswith("ms")}
    assert listed == {"ms-0": {"tpu": "ms", "slice": 0}, "ms-1": {"tpu": "ms", "slice": 1}}

    r = cli("delete", "ms-1", "--yes")  # one slice alone: refused, the slices go together
    assert_clean_error(r, 2)
    assert "tpurun delete ms" in r.err
    r = cli("delete", "ms", "--yes")
    assert r.code == 0, r.err
    assert "queued resource" in r.err
    assert _leftovers(emulator) == ([], [])
    assert "tpu" not in (cli.cwd / "tpurun.toml").read_text() if (cli.cwd / "tpurun.toml").exists() else True


def test_slices_with_a_name_that_exists_creates_nothing(own_cli, emulator):
    cli = own_cli
    # the TPU's name taken by a plain node, then a slice's: refused the same way, before anything is asked for
    for existing, said in (
        ("taken", "taken: the Cloud TPU API already has a TPU of that name"),
        ("taken-1", "taken-1"),
    ):
        assert cli("create", existing, "-t", "v4-8").code == 0
        before = _leftovers(emulator)
        r = cli("create", "taken", "-t", "v4-16", "--slices", "2")
        assert_clean_error(r, 2)
        assert said in r.err
        assert _leftovers(emulator) == before
        assert cli("delete", existing, "--yes").code == 0


# ---------------------------------------------------------------------------- training across slices

EXAMPLES = Path(__file__).parents[2] / "examples"
TAGS = ["s0/w0", "s0/w1", "s1/w0", "s1/w1"]


def test_jax_example_trains_across_two_slices_with_real_collectives(cli):
    """The JAX example, unmodified, once per host on 2 slices x 2 workers: jax.distributed.initialize()
    with no arguments joins all 4 processes and gloo all-reduces across every slice."""
    shutil.copy(EXAMPLES / "digits_jax.py", cli.cwd / "digits_jax.py")
    r = cli("train", "digits_jax.py", "--runtime", "cpu", "--launch", "host", timeout=600)
    assert r.code == 0, r.err[-3000:]
    tagged = by_tag(r.out)
    assert sorted(tagged) == TAGS, sorted(tagged)
    finals = {}
    for i, tag in enumerate(TAGS):
        lines = tagged[tag]
        # jax numbers the processes slice by slice; the sum of every process's index + 1 is 10
        assert f"[process {i}/4] all-reduce check: 10.0 (expected 10.0)" in lines, lines[:4]
        finals[tag] = [line.split("] ", 1)[1] for line in lines if " step 300 " in line]
    assert len({tuple(v) for v in finals.values()}) == 1, finals  # the same model everywhere: one loss
    accuracy = [line for line in tagged["s0/w0"] if line.startswith("final test accuracy")]
    assert accuracy and float(accuracy[0].split()[-1]) >= 0.9


def test_jax_finds_the_slices_from_the_emulated_vms_as_on_cloud_tpu(cli, shared_pod):
    """What a host launch gives a JAX program on a TPU: jax's own Cloud TPU cluster code, run on every
    worker, reads its slice from the VM (metadata server, tpu-env) and agrees with tpurun's variables."""
    d = shared_pod.node
    (cli.cwd / "probe.py").write_text(
        "import json, os\n"
        "from jax._src.clusters import cloud_tpu_cluster as c\n"
        "keys = ['MEGASCALE_COORDINATOR_ADDRESS', 'MEGASCALE_NUM_SLICES', 'MEGASCALE_SLICE_ID', 'MEGASCALE_PORT']\n"
        "vm = {k: c.get_tpu_env_value_from_metadata(k) for k in keys}\n"
        "env = {k: os.environ.get(k) for k in keys}\n"
        "g = c.GceTpuCluster\n"
        "print(json.dumps({'vm': vm, 'env': env, 'id': g.get_process_id(), 'count': g.get_process_count(),\n"
        "    'coordinator': g.get_coordinator_address(10, None), 'worker': os.environ['TPURUN_WORKER_ID'],\n"
        "    'jax_vars': sorted(k for k in os.environ if k.startswith('JAX_'))}))\n"
    )
    r = cli("train", "probe.py", "--runtime", "pjrt")
    assert r.code == 0, r.err[-3000:]
    tagged = by_tag(r.out)
    assert sorted(tagged) == TAGS
    first = d["workerEndpoints"][0]["internalIp"]
    for i, tag in enumerate(TAGS):
        seen = json.loads(tagged[tag][-1])
        assert seen["vm"] == seen["env"], seen  # tpurun says what the VM says
        assert seen["vm"]["MEGASCALE_SLICE_ID"] == str(i // 2)
        assert (seen["id"], seen["count"], seen["worker"]) == (i, 4, str(i))
        assert seen["coordinator"] == f"{first}:8482"
        assert seen["jax_vars"] == []  # on a TPU, nothing that would override jax's own detection


def test_detach_and_logs_across_slices(cli):
    (cli.cwd / "few.py").write_text(
        "import os, time\nfor i in range(3):\n    print('line', i, 'of', os.environ['TPURUN_WORKER_ID'], flush=True)\n"
        "    time.sleep(0.2)\n"
    )
    r = cli("train", "few.py", "--runtime", "cpu", "--launch", "host", "--detach")
    assert r.code == 0, r.err
    job = r.out.strip().splitlines()[-1]
    r = cli("logs", job, "--follow")
    assert r.code == 0, r.err
    tagged = by_tag(r.out)
    assert sorted(tagged) == TAGS
    for i, tag in enumerate(TAGS):
        assert tagged[tag] == [f"line {n} of {i}" for n in range(3)]
    (row,) = [j for j in json.loads(cli("jobs", "--json").out) if j["job_id"] == job]
    assert row["pricePerHour"] == pytest.approx(2 * 8 * 3.22)  # every slice's chips: two v4-16 are 16 chips
    assert row["end"] == "finished" and 0 < row["cost"] < row["pricePerHour"] * 60 / 3600


def test_dry_run_shows_every_slice(cli):
    (cli.cwd / "t.py").write_text("print(1)\n")
    r = cli("train", "t.py", "--runtime", "pjrt", "--dry-run", "--json")
    assert r.code == 0, r.err
    rows = json.loads(r.out)["processes"]
    assert [p["name"] for p in rows] == TAGS
    assert [p["env"]["MEGASCALE_SLICE_ID"] for p in rows] == ["0", "0", "1", "1"]
    r = cli("train", "t.py", "--runtime", "pjrt", "--dry-run")
    assert "[s1/w1]" in r.out and "MEGASCALE_NUM_SLICES=2" in r.out


def _every_worker(pattern: str):
    """A read_until predicate: every worker of both slices printed a line starting with PATTERN."""

    def seen(lines: list[str]) -> bool:
        tags = {m.group(1) for line in lines if (m := re.match(rf"^\[([^\]]+)\] {pattern}", line))}
        return tags == set(TAGS)

    return seen


def test_a_worker_killed_in_one_slice_stops_the_job_on_every_slice(own_cli, emulator):
    cli = own_cli  # it takes a worker down: slices of its own
    cli.env["TPURUN_PREEMPT_CHECK"] = "3"  # a lost worker on READY slices: look 3 s for a preemption
    assert cli("create", "kl", "-t", "v4-16", "--slices", "2").code == 0
    (cli.cwd / "tick.py").write_text("import time\nfor i in range(3000):\n    print('tick', i, flush=True)\n    time.sleep(0.1)\n")
    proc = popen(cli, "train", "tick.py", "--runtime", "cpu", "--launch", "host")
    read_until(proc, _every_worker(r"tick"), timeout=120)
    emulator.kill_worker(emulator.node_name("kl-1"), 0)
    out, err = finish(proc)
    assert proc.returncode == 75, err  # a worker lost: the job cut short by the infrastructure
    assert "lost worker s1/w0" in err and "Traceback" not in err, err
    for node in ("kl-0", "kl-1"):
        deadline = time.monotonic() + 30
        while job_pids(emulator, node, "tick.py") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert job_pids(emulator, node, "tick.py") == [], node


def test_a_preempted_slice_relaunches_the_job_on_every_slice(own_cli, emulator):
    cli = own_cli
    r = cli("create", "sp", "-t", "v4-16", "--slices", "2", "--spot")
    assert r.code == 0, r.err
    (cli.cwd / "resume.py").write_text(
        "import os, time\n"
        "n = os.environ['TPURUN_RESTART_COUNT']\n"
        "for i in range(3 if n != '0' else 3000):\n"
        "    print(f'n {i} restart {n} slice', os.environ['MEGASCALE_SLICE_ID'], flush=True); time.sleep(0.1)\n"
    )
    proc = popen(cli, "train", "resume.py", "--runtime", "cpu", "--launch", "host", "--max-restarts", "1")
    read_until(proc, _every_worker(r"n 2 restart 0"), timeout=120)
    emulator.preempt(emulator.node_name("sp-1"))
    out, err = finish(proc, 300)
    assert proc.returncode == 0, err
    assert "sp was preempted" in err and "restart 1/1" in err, err
    again = by_tag(out)
    for tag in TAGS:
        slice_id = tag[1]
        assert [x for x in again[tag] if "restart 1" in x] == [f"n {i} restart 1 slice {slice_id}" for i in range(3)]
    client = emulator.client()
    for i in range(2):  # both slices are the new queued resource's, READY
        node = client.get_node(name=emulator.node_name(f"sp-{i}"))
        assert node.state.name == "READY" and node.multislice_node


def test_sync_kill_stale_doctor_and_ssh_reach_every_slice(own_cli):
    cli = own_cli  # two single-host slices
    r = cli("create", "hs", "-t", "v4-8", "--slices", "2", "--json")
    assert r.code == 0, r.err
    names = ["s0/w0", "s1/w0"]
    (cli.cwd / "data.txt").write_text("x\n")
    r = cli("--plain", "sync")
    assert r.code == 0, r.err
    assert sorted(line.split("]")[0][1:] for line in r.out.splitlines() if line.startswith("[")) == names
    r = cli("kill-stale")
    assert r.code == 0, r.err
    assert all(f"{n}: nothing holds the TPU" in r.err for n in names), r.err
    r = cli("doctor", "--json")
    assert r.code == 0, r.err
    checks = json.loads(r.out)["checks"]
    startup = [c for c in checks if c["name"] == "startup script"]
    assert [c["worker"] for c in startup] == [0, 1] and {c["status"] for c in startup} == {"pass"}, startup
    r = cli("ssh", "--worker", "s1/w0", "--", "cat", "project/data.txt")
    assert r.code == 0 and r.out == "x\n", r.err
    r = cli("exec", "--worker", "s1", "--", "true")
    assert r.code == 0 and "s0/w0" not in r.err, r.err


def test_ctrl_c_stops_every_slice(cli, emulator):
    (cli.cwd / "tick.py").write_text("import time\nfor i in range(3000):\n    print('tick', i, flush=True)\n    time.sleep(0.1)\n")
    proc = popen(cli, "train", "tick.py", "--runtime", "cpu", "--launch", "host")
    read_until(proc, _every_worker(r"tick"), timeout=120)
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == 130, err
    for node in (f"{SHARED}-0", f"{SHARED}-1"):  # tpurun exits only once every remote process is gone
        assert job_pids(emulator, node, "tick.py") == [], node


def test_no_wait_returns_the_queued_request(own_cli, emulator):
    cli = own_cli
    r = cli("create", "nw", "-t", "v4-8", "--slices", "2", "--no-wait", "--json")
    assert r.code == 0, r.err
    d = json.loads(r.out)
    assert d["name"] == "nw" and d["acceleratorType"] == "v4-8" and d["queuedResource"].endswith("/nw")
    assert cli("delete", "nw", "--yes").code == 0
    deadline = time.monotonic() + 60
    while _leftovers(emulator) != ([], []) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _leftovers(emulator) == ([], [])
