"""TPUs made through Compute Engine, by the real CLI against the emulator's Compute Engine front: a TPU7x
slice as a managed instance group with its workload policy and template, a single VM, and the same
commands as for a Cloud TPU node (list, describe, exec, attach, delete), leaving nothing behind."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.helpers import assert_clean_error, by_tag, finish, pids_in, popen, read_until
from tpurun import health
from tpurun.worker import probe

pytestmark = pytest.mark.integration

KINDS = ("instances", "instanceGroupManagers", "instanceTemplates", "resourcePolicies")


def _left(emulator) -> dict[str, list]:
    status = emulator.admin.status()
    return {k: status[k] for k in KINDS if status[k]}


@pytest.fixture
def clean(emulator):
    """Whatever a test leaves in Compute Engine goes when it ends (each test checks what it leaves itself)."""
    yield
    emulator.emu.compute_teardown()


EXAMPLES = Path(__file__).parents[2] / "examples"

# Run by `tpurun train --runtime pjrt` (a host launch) on every VM: what jax's own cluster detection and
# torch_xla's own `_internal/tpu.py` make of the VM and of what tpurun gave the process. libtpu is not on
# this machine, so TPU_LIBRARY_PATH names a file for jax's check that libtpu is there; the chips jax and
# torch_xla count are the emulated VM's PCI devices.
PROBE = r"""
import json, os, urllib.request, urllib.error
os.environ["TPU_LIBRARY_PATH"] = "/bin/true"
def metadata(key):
    url = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/" + key
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})).status
    except urllib.error.HTTPError as e:
        return e.code
import jax
from jax._src import clusters
found = [c for c in clusters.ClusterEnv._cluster_types if not c.opt_in_only_method and c.is_env_present()]
jx = found[0]
from torch_xla._internal import tpu
local = tpu.num_local_processes()
seen = {
    "metadata": {k: metadata(k) for k in ("tpu-env", "agent-worker-number", "worker-network-endpoints")},
    "cluster": jx.name, "id": jx.get_process_id(), "count": jx.get_process_count(),
    "coordinator": jx.get_coordinator_address(10, None),
    "chips": tpu.num_available_chips(), "local": local, "version": tpu.version(),
    "worker_id": tpu.worker_id(), "worker_ips": tpu.get_worker_ips(),
    "worker": os.environ["TPURUN_WORKER_ID"],
}
tpu.configure_topology(local - 1, local)
seen["last"] = {k: os.environ[k] for k in ("TPU_PROCESS_BOUNDS", "CLOUD_TPU_TASK_ID", "TPU_VISIBLE_CHIPS")}
print(json.dumps(seen))
"""


# Run on every worker of a Compute Engine TPU with no flags: torch_xla's own `import` (which asks for the
# slice where the VM has chips), its topology code and one computation on its device.
XLA_SEEN = r"""
import json, os
import torch, torch_xla
from torch_xla._internal import tpu
total = torch.ones(3, device=torch_xla.device()).sum().item()
print(json.dumps({
    "version": tpu.version(), "worker_id": tpu.worker_id(), "worker_ips": tpu.get_worker_ips(), "sum": total,
    "worker": os.environ.get("TPURUN_WORKER_ID"),
}))
"""


def _xla_seen(out: str) -> dict[str, dict]:
    """{tag: what XLA_SEEN printed there}."""
    return {tag: json.loads(lines[-1]) for tag, lines in by_tag(out).items() if lines[-1].startswith("{")}


def test_torch_xla_and_jax_work_by_default_on_compute_engine_vms(cli, emulator, clean):
    """A Compute Engine VM's metadata has no `tpu-env`, which `import torch_xla` reads where the VM has chips:
    every process tpurun starts there (train's chip and host launches, exec, --setup) is given the slice,
    one host or two; doctor says where the runtimes learn it; a JAX script runs once per host by default."""
    assert cli("create", "pair", "-t", "tpu7x-16").code == 0
    addresses = [w["internalIp"] for w in json.loads(cli("describe", "pair", "--json").out)["workerEndpoints"]]
    (cli.cwd / "seen.py").write_text(XLA_SEEN)
    expected = {"version": 7, "worker_ips": addresses, "sum": 3.0}
    for args, tags in (
        (["--cores", "1"], ["w0/c0", "w1/c0"]),  # the default: the cpu runtime's chip launch, one chip a host
        (["--launch", "host"], ["w0", "w1"]),
    ):
        r = cli("train", "seen.py", *args, timeout=300)
        assert r.code == 0, r.err[-3000:]
        seen = _xla_seen(r.out)
        assert sorted(seen) == tags, r.out[-2000:]
        for tag, got in seen.items():
            w = int(tag[1])
            assert got == {**expected, "worker_id": w, "worker": str(w)}, (tag, got)

    r = cli("exec", "--", "python3", "-c", XLA_SEEN, timeout=300)
    assert r.code == 0, r.err[-3000:]
    assert {t: (g["worker_id"], g["worker_ips"]) for t, g in _xla_seen(r.out).items()} == {
        "w0": (0, addresses),
        "w1": (1, addresses),
    }

    doc = json.loads(cli("doctor", "--json").out)
    rows = [c for c in doc["checks"] if c["name"] == "slice place"]
    assert [(c["worker"], c["status"]) for c in rows] == [(0, "pass"), (1, "pass")], rows
    assert all("given by tpurun" in c["detail"] for c in rows), rows
    # and what it would say of a process told nothing: the VM's own metadata server, asked from the VM
    ask = Path(probe.__file__).read_text() + "\nprint(json.dumps(runtime_place({}, ['/dev/vfio/0']).to_dict()))\n"
    r = cli("exec", "--", "python3", "-c", ask)
    assert r.code == 0, r.err
    for tag, lines in by_tag(r.out).items():
        answer = probe.DoctorAnswer.from_dict({"devices_present": ["/dev/vfio/0"], "runtime_place": json.loads(lines[-1])})
        row = health.check_runtime_place(0, answer)
        assert (row.status, "HTTP 404" in row.detail) == ("fail", True), (tag, row)

    # JAX's model is one process per host, whatever the runtime: two processes, not one per TensorCore
    shutil.copy(EXAMPLES / "digits_jax.py", cli.cwd / "digits_jax.py")
    r = cli("train", "digits_jax.py", "--", "--steps", "5", timeout=300)
    assert r.code == 0, r.err[-3000:]
    assert sorted(by_tag(r.out)) == ["w0", "w1"], r.out[-1000:]
    assert "default for a JAX script" in r.err and "spawner" not in r.err and "XLA worlds" not in r.err, r.err
    assert cli("delete", "pair", "--yes").code == 0

    # one VM: the single-host slice, through the default path
    assert cli("create", "single", "-t", "tpu7x-8").code == 0
    r = cli("train", "seen.py", "--cores", "1", timeout=300)
    assert r.code == 0, r.err[-3000:]
    (got,) = _xla_seen(r.out).values()
    assert (got["version"], got["worker_id"], got["sum"]) == (7, 0, 3.0), got
    assert cli("delete", "single", "--yes").code == 0
    assert not _left(emulator)


def _names(entries: list) -> list[str]:
    return [(e["name"] if isinstance(e, dict) else e).rsplit("/", 1)[-1] for e in entries]


def test_tpu7x_slice_through_a_managed_instance_group(cli, emulator, clean):
    r = cli("create", "ironwood", "-t", "tpu7x-32", "--json")
    assert r.code == 0, r.err
    d = json.loads(r.out)
    assert (d["backend"], d["acceleratorType"], d["state"], d["workers"]) == ("compute", "tpu7x-32", "READY", 4)
    assert [w["startup"] for w in d["workerEndpoints"]] == ["done"] * 4
    # what Compute Engine holds: a zonal MIG of 4 with a HIGH_THROUGHPUT 2x2x4 policy and a regional template
    status = emulator.admin.status()
    assert _names(status["instanceGroupManagers"]) == ["ironwood"]
    assert _names(status["resourcePolicies"]) == _names(status["instanceTemplates"]) == ["ironwood"]
    assert len(status["instances"]) == 4

    # every worker answers, as the VM the API named (its host key pinned under its instance id)
    r = cli("exec", "--", "hostname")
    assert r.code == 0, r.err
    names = {line.split("] ", 1)[1] for line in r.out.splitlines() if line.startswith("[w")}
    assert len(names) == 4 and all(n.startswith("ironwood-") for n in names), r.out
    assert all(line.startswith("compute.") for line in _aliases(cli))
    _runtimes_find_their_slice(cli, [w["internalIp"] for w in d["workerEndpoints"]])

    listed = json.loads(cli("list", "--json").out)
    assert [(t["name"], t["backend"], t["acceleratorType"]) for t in listed] == [("ironwood", "compute", "tpu7x-32")]
    plain = cli("--plain", "list").out
    assert "compute" in plain and "ironwood" in plain
    desc = json.loads(cli("describe", "ironwood", "--json").out)
    assert sorted(w["name"] for w in desc["workerEndpoints"]) == ["w0", "w1", "w2", "w3"]

    # attach from another machine (a fresh home): keys pinned from guest attributes, tpurun's key added
    other = cli.home.parent / "other"
    other.mkdir()
    env = dict(cli.env, HOME=str(other), TPURUN_HOME=str(other / ".tpurun"))
    from tests.helpers import tpurun

    work = other / "project"
    work.mkdir()
    assert tpurun("attach", "ironwood", cwd=work, env=env).code == 0
    r = tpurun("exec", "--worker", "3", "--", "true", cwd=work, env=env)
    assert r.code == 0, r.err

    # one name, one TPU: the Cloud TPU API is not asked for a node of a name Compute Engine has
    r = cli("create", "ironwood", "-t", "v4-8")
    assert_clean_error(r, 2)
    assert "ironwood: Compute Engine already has a TPU of that name" in r.err, r.err
    assert not list(emulator.client().list_nodes(parent=emulator.parent))

    for refused in (["stop", "ironwood"], ["autostop", "ironwood", "30m", "--action", "stop"]):
        r = cli(*refused)
        assert_clean_error(r, 2)
        assert "Compute Engine" in r.err

    r = cli("delete", "ironwood", "--yes")
    assert r.code == 0, r.err
    assert "its instance template" in r.err and "its workload policy" in r.err
    assert not _left(emulator)
    assert_clean_error(cli("describe", "ironwood"), 3)


def _runtimes_find_their_slice(cli, addresses: list[str]) -> None:
    """What a launch gives the runtimes on VMs that carry no Cloud TPU metadata."""
    tags = ["w0", "w1", "w2", "w3"]
    # the JAX example, unmodified, once per host: jax.distributed.initialize() joins the 4 VMs and gloo
    # all-reduces across them
    shutil.copy(EXAMPLES / "digits_jax.py", cli.cwd / "digits_jax.py")
    r = cli("train", "digits_jax.py", "--runtime", "cpu", "--launch", "host", "--", "--steps", "20", timeout=600)
    assert r.code == 0, r.err[-3000:]
    tagged = by_tag(r.out)
    assert sorted(tagged) == tags, sorted(tagged)
    for i, tag in enumerate(tags):
        assert f"[process {i}/4] all-reduce check: 10.0 (expected 10.0)" in tagged[tag], tagged[tag][:4]

    # on a TPU (host launch): jax's own cluster detection and torch_xla's own topology code agree with
    # tpurun's numbering, from what tpurun gave them, the VMs' metadata having none of it
    (cli.cwd / "probe.py").write_text(PROBE)
    r = cli("train", "probe.py", "--runtime", "pjrt", timeout=300)
    assert r.code == 0, r.err[-3000:]
    # (its last line is tagged as chip 7's: configure_topology gave the process that chip's variables)
    lines = {tag: [t for k, v in by_tag(r.out).items() if k.split("/")[0] == tag for t in v] for tag in tags}
    plan = json.loads(cli("train", "probe.py", "--runtime", "pjrt", "--launch", "chip", "--dry-run", "--json").out)
    chip_env = {p["name"]: p["env"] for p in plan["processes"]}
    for i, tag in enumerate(tags):
        seen = json.loads(next(t for t in lines[tag] if t.startswith("{")))
        assert seen["metadata"] == {"tpu-env": 404, "agent-worker-number": 404, "worker-network-endpoints": 404}
        assert (seen["cluster"], seen["id"], seen["count"], seen["worker"]) == ("gketpu", i, 4, str(i)), seen
        assert seen["coordinator"] == f"{addresses[0]}:8482"
        # a TPU7x VM's 4 chips are 8 PCI functions, one per chiplet: torch_xla counts 8 chips, 8 processes
        assert (seen["chips"], seen["local"], seen["version"], seen["worker_id"]) == (8, 8, 7, i)
        assert seen["worker_ips"] == addresses
        # the last chip process torch_xla's spawner would make is the one tpurun's chip launch makes
        mine = chip_env[f"{tag}/c7"]
        assert seen["last"] == {k: mine[k] for k in seen["last"]}, (seen["last"], mine)
        assert seen["last"]["CLOUD_TPU_TASK_ID"] == str(8 * i + 7)


def test_single_vm_in_compute_engines_spelling(cli, emulator, clean):
    r = cli("create", "solo", "--machine-type", "tpu7x-standard-4t", "--spot", "--json")
    assert r.code == 0, r.err
    d = json.loads(r.out)
    assert (d["backend"], d["acceleratorType"], d["workers"], d["spot"]) == ("compute", "tpu7x-8", 1, True)
    status = emulator.admin.status()
    assert _names(status["instances"]) == ["solo"] and not status["instanceGroupManagers"]
    r = cli("exec", "--", "hostname")
    assert (r.code, r.out.strip()) == (0, "[w0] solo"), r.err
    emulator.admin.preempt_instance("solo")
    assert json.loads(cli("describe", "solo", "--json").out)["state"] == "PREEMPTED"
    r = cli("exec", "--", "true")
    assert_clean_error(r, 4)
    assert "preempted" in r.err
    assert cli("delete", "solo", "--yes").code == 0


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["-t", "tpu7x-32", "--backend", "tpu-api"], "Cloud TPU API does not make tpu7x-32; Compute Engine does"),
        (["-t", "tpu7x-32", "--backend", "gce"], "choose compute or tpu-api"),
        (["--machine-type", "tpu7x-standard-4t", "--topology", "3x3x3"], "cannot make the topology '3x3x3'"),
        (["--topology", "2x2x4"], "--topology needs --machine-type"),
        (["-t", "tpu7x-32", "--machine-type", "tpu7x-standard-4t"], "either --accelerator-type, or --machine-type"),
        (["-t", "tpu7x-32", "--slices", "2", "--valid-until", "1h"], "--valid-until"),
        (["-t", "tpu7x-16", "--autostop", "1h", "--autostop-action", "stop"], "deletes but does not stop"),
        (["-t", "tpu7x-32", "--queued"], "--queued"),
        (["-t", "tpu7x-8", "--version", "v2-alpha-tpu7x"], "image family"),
        (["-t", "tpu7x-8", "--preemptible"], "--spot"),
        (["-t", "v4-8", "--backend", "compute"], "Compute Engine does not make v4-8"),
        ([], "give the TPU's type"),
        (["-t", "tpu7x-16", "--flex-start"], "needs --max-run-duration"),
        (["-t", "tpu7x-16", "--max-run-duration", "2h"], "needs --flex-start"),
        (["-t", "tpu7x-16", "--flex-start", "--max-run-duration", "5m"], "between 10m and 7d"),
        (["-t", "tpu7x-16", "--flex-start", "--max-run-duration", "2h", "--spot"], "one of --spot and --flex-start"),
        (["-t", "v6e-8", "--flex-start", "--max-run-duration", "2h"], "add --backend compute"),
    ],
)
def test_bad_requests_are_refused_before_anything_is_made(cli, emulator, clean, args, words):
    r = cli("create", "nope", *args)
    assert_clean_error(r, 2)
    assert words in r.err
    assert not _left(emulator)


def _aliases(cli) -> list[str]:
    return [line.split()[0] for line in cli.known_hosts.read_text().splitlines() if line.strip()]


TICK = "import os, time\nfor i in range(600):\n    print('tick', i, os.environ['TPURUN_WORKER_ID'], flush=True)\n    time.sleep(0.1)\n"
FAIL = (
    "import os, sys, time\n"
    "if os.environ['TPURUN_WORKER_ID'] == '1' and os.environ['TPURUN_CORE'] == '1':\n"
    "    print('giving up', flush=True); sys.exit(3)\n"
    "time.sleep(120)\n"
)
HOLD = (
    "setsid nohup python3 -c \"import time; f = open('/dev/vfio/0', 'rb'); open('/tmp/held', 'w').close(); "
    'time.sleep(999)" tag-holder >/dev/null 2>&1 </dev/null & '
    "for i in $(seq 100); do [ -e /tmp/held ] && exit 0; sleep 0.05; done; exit 1"
)


def _running(emulator, name: str, needle: str) -> list[int]:
    """Processes whose command line contains NEEDLE on the two VMs of the Compute Engine TPU NAME."""
    (key,) = [k for k in emulator.emu.hosts.node_keys() if k.rsplit("/", 1)[-1] == name]
    return pids_in(emulator, key, [0, 1], needle)


def test_every_worker_command_on_a_compute_engine_slice(cli, emulator, clean):
    """The commands that act on workers find nothing different on a two-VM Compute Engine slice: detach,
    jobs, logs, cancel, fail-fast, kill-stale and doctor, ending with nothing left anywhere."""
    assert cli("create", "duo", "-t", "tpu7x-16").code == 0
    (cli.cwd / "tick.py").write_text(TICK)
    r = cli("train", "tick.py", "--runtime", "cpu", "--launch", "host", "--detach")
    assert r.code == 0, r.err
    job = r.out.strip().splitlines()[-1]
    jobs = json.loads(cli("jobs", "--json").out)
    assert [(j["job_id"], j["status"]) for j in jobs] == [(job, "running")], jobs
    r = cli("logs", job)
    assert r.code == 0, r.err
    assert {"w0", "w1"} <= set(by_tag(r.out)), r.out[-500:]
    r = cli("cancel", job)
    assert r.code == 0, r.err
    assert not _running(emulator, "duo", "tick.py")

    # Ctrl-C on an attached job: exit 130 once nothing of it runs on either VM; ssh reaches one VM
    proc = popen(cli, "train", "tick.py", "--runtime", "cpu", "--launch", "host")
    read_until(proc, lambda lines: {"w0", "w1"} <= {ln[1:3] for ln in lines if ln.startswith("[w")})
    proc.send_signal(signal.SIGINT)
    _, err = finish(proc)
    assert proc.returncode == 130, err[-800:]
    assert not _running(emulator, "duo", "tick.py")
    r = cli("ssh", "--worker", "1", "--", "cat", "project/tick.py")
    assert r.code == 0 and r.out == TICK, r.err

    # fail-fast: one chip process of the second VM fails, the job stops everywhere with its code
    (cli.cwd / "fail.py").write_text(FAIL)
    r = cli("train", "fail.py", "--runtime", "cpu", "--cores", "2", timeout=120)
    assert r.code == 1 and "giving up" in r.out, (r.out[-800:], r.err[-800:])
    assert "w1/c1" in r.err and "(exit code 3)" in r.err, r.err[-800:]
    assert not _running(emulator, "duo", "fail.py")

    # a stale process holding a chip on every VM is found and stopped
    assert cli("exec", "--", "sh", "-c", HOLD).code == 0
    r = cli("kill-stale", "--grace", "1", "--json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert doc["free"] and [len(w["holders"]) for w in doc["workers"]] == [1, 1], doc
    assert not _running(emulator, "duo", "tag-holder")

    r = cli("doctor", "--json")
    assert r.code == 0, (r.out[-1500:], r.err[-800:])

    assert cli("delete", "duo", "--yes").code == 0
    assert not _left(emulator)


RESUME = (
    "import os, time\n"
    "n = os.environ['TPURUN_RESTART_COUNT']\n"
    "print('restart count', n, flush=True)\n"
    "time.sleep(600 if n == '0' else 0.1)\n"
    "print('finished', flush=True)\n"
)


@pytest.mark.parametrize(
    ("name", "args", "vms"), [("spotgroup", ["-t", "tpu7x-16"], 2), ("spotvm", ["-t", "v6e-4"], 1)]
)
def test_preempted_spot_tpu_is_remade_for_max_restarts(cli, emulator, clean, name, args, vms):
    """One spot VM of a group (or the one VM) preempted mid-job: `--max-restarts` deletes the VMs and
    makes them again as they were (the group with its template and policy), then runs the job again."""
    r = cli("create", name, *args, "--backend", "compute", "--spot", "--json")
    assert r.code == 0, r.err
    (cli.cwd / "resume.py").write_text(RESUME)
    proc = popen(cli, "train", "resume.py", "--runtime", "cpu", "--launch", "host", "--max-restarts", "1")
    read_until(proc, lambda lines: sum("restart count 0" in line for line in lines) == vms)
    victim = _names(emulator.admin.status()["instances"])[-1]
    emulator.admin.preempt_instance(victim)
    out, err = finish(proc, timeout=240)
    assert proc.returncode == 0, err[-2000:]
    assert f"restart 1/1: recreating {name}" in err
    assert out.count("restart count 1") == vms and out.count("finished") == vms, out
    d = json.loads(cli("describe", name, "--json").out)
    assert (d["state"], d["spot"], len(d["workerEndpoints"])) == ("READY", True, vms)
    now = _names(emulator.admin.status()["instances"])
    assert len(now) == vms and (vms == 1 or not set(now) & {victim}), now
    assert cli("delete", name, "--yes").code == 0
    assert not _left(emulator)


def test_list_all_zones_reads_compute_engines_aggregated_lists(cli, emulator, clean):
    far = "us-east5-a"
    assert cli("create", "east", "-t", "tpu7x-8", "--zone", far).code == 0
    assert cli("create", "west", "-t", "tpu7x-16").code == 0
    listed = json.loads(cli("list", "--all-zones", "--json").out)
    assert sorted((t["zone"], t["name"], t["backend"], t["workers"]) for t in listed) == sorted(
        [(far, "east", "compute", 1), (emulator.zone, "west", "compute", 2)]
    ), listed
    assert [t["name"] for t in json.loads(cli("list", "--json").out)] == ["west"]
    calls = [r["path"] for r in emulator.requests() if "/aggregated/" in r["path"]]
    assert any(p.endswith("/aggregated/instances") for p in calls), calls
    assert cli("delete", "east", "--zone", far, "--yes").code == 0
    assert cli("delete", "west", "--yes").code == 0
    assert not _left(emulator)


def _made_by_hand(emulator, name: str, template: str, policy: str) -> None:
    """A TPU7x 2x2x2 slice made without tpurun, as a user would with the Google clients: a group NAME of 2 VMs
    from its own global instance TEMPLATE, shaped by its own workload POLICY; once its VMs run."""
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import compute_v1

    kw = {"credentials": AnonymousCredentials(), "client_options": ClientOptions(api_endpoint=emulator.endpoint)}
    project, zone = emulator.project, emulator.zone
    region = zone.rsplit("-", 1)[0]
    image = "projects/ubuntu-os-accelerator-images/global/images/family/ubuntu-accel-2404-amd64-tpu-tpu7x"
    props = compute_v1.InstanceProperties(
        machine_type="tpu7x-standard-4t",
        disks=[compute_v1.AttachedDisk(boot=True, auto_delete=True, initialize_params={"source_image": image})],
        network_interfaces=[
            compute_v1.NetworkInterface(network="global/networks/default", access_configs=[{"name": "External NAT"}])
        ],
        scheduling=compute_v1.Scheduling(on_host_maintenance="TERMINATE"),
        metadata=compute_v1.Metadata(items=[{"key": "enable-guest-attributes", "value": "TRUE"}]),
    )

    def done(op: compute_v1.Operation) -> None:  # its own operations client: `result()` would ask Google's host
        while op.status != compute_v1.Operation.Status.DONE:
            if op.zone:
                op = compute_v1.ZoneOperationsClient(**kw).wait(project=project, zone=zone, operation=op.name)
            elif op.region:
                op = compute_v1.RegionOperationsClient(**kw).wait(project=project, region=region, operation=op.name)
            else:
                op = compute_v1.GlobalOperationsClient(**kw).wait(project=project, operation=op.name)
        assert not op.error.errors, op.error

    done(
        compute_v1.InstanceTemplatesClient(**kw).insert_unary(
            project=project, instance_template_resource=compute_v1.InstanceTemplate(name=template, properties=props)
        )
    )
    shape = compute_v1.ResourcePolicy(
        name=policy, workload_policy={"type_": "HIGH_THROUGHPUT", "accelerator_topology": "2x2x2"}
    )
    done(
        compute_v1.ResourcePoliciesClient(**kw).insert_unary(
            project=project, region=region, resource_policy_resource=shape
        )
    )
    groups = compute_v1.InstanceGroupManagersClient(**kw)
    group = compute_v1.InstanceGroupManager(
        name=name,
        base_instance_name=name,
        instance_template=f"global/instanceTemplates/{template}",
        target_size=2,
        resource_policies={"workload_policy": f"projects/{project}/regions/{region}/resourcePolicies/{policy}"},
    )
    done(groups.insert_unary(project=project, zone=zone, instance_group_manager_resource=group))
    deadline = time.monotonic() + 120
    while not groups.get(project=project, zone=zone, instance_group_manager=name).status.is_stable:
        assert time.monotonic() < deadline, f"{name} never became stable"
        time.sleep(0.2)


def test_delete_of_an_attached_slice_says_what_it_leaves_and_why(cli, emulator, clean):
    """A slice made by hand and attached: `delete` takes its group and VMs, and leaves its instance template and
    workload policy (tpurun deletes only what it made, which it marks in the description; made elsewhere, they
    may serve other groups), saying which it left and why."""
    _made_by_hand(emulator, "byhand", "shared-template", "shared-policy")
    r = cli("attach", "byhand")
    assert r.code == 0, r.err
    r = cli("exec", "--", "true")
    assert r.code == 0, r.err
    r = cli("delete", "byhand", "--yes")
    assert r.code == 0, r.err
    assert "deleted byhand\n" in r.err, r.err
    assert "left the instance template shared-template and the workload policy shared-policy: " in r.err, r.err
    assert "tpurun deletes only what it made" in r.err and "made by tpurun for the TPU byhand" in r.err, r.err
    left = _left(emulator)
    assert sorted(left) == ["instanceTemplates", "resourcePolicies"], left
    assert _names(left["instanceTemplates"]) == ["shared-template"]
    assert _names(left["resourcePolicies"]) == ["shared-policy"]


def _wait_until_nothing_left(emulator, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _left(emulator):
        assert time.monotonic() < deadline, _left(emulator)
        time.sleep(0.3)


def _by_vm(emulator, before: int) -> list[tuple[str, str]]:
    """The calls a VM made with its own token since BEFORE that changed something: (method, what)."""
    return [
        (r["method"], r["path"].split("/", 5)[-1])
        for r in emulator.requests(before)
        if r["caller"].startswith("vm:")
        and r["method"] != "GET"
        and "/operations/" not in r["path"]
        and "listManagedInstances" not in r["path"]
    ]


def test_the_watchdog_deletes_a_compute_engine_tpu_with_its_own_token(cli, emulator, clean):
    """A group's `train --down` job ends (detached): its first VM leaves the group, deletes the group, its
    template and its workload policy, then itself. A lone VM made with --autostop deletes itself once idle."""
    cli.env["TPURUN_WATCHDOG_TICK"] = "0.5"
    assert cli("create", "downgroup", "-t", "tpu7x-16").code == 0
    assert cli("autostop", "downgroup", "1h").code == 0  # set per VM, the watchdogs started over SSH
    assert json.loads(cli("describe", "downgroup", "--json").out)["autostop"] == {
        "idleSeconds": 3600,
        "action": "delete",
    }
    (cli.cwd / "job.py").write_text("import time; time.sleep(2); print('job done', flush=True)\n")
    before = len(emulator.requests())
    r = cli("train", "job.py", "--runtime", "cpu", "--launch", "host", "--down", "--detach")
    assert r.code == 0, r.err
    _wait_until_nothing_left(emulator, 90)
    calls = _by_vm(emulator, before)
    (leave,) = [c for c in calls if c[1].endswith("/abandonInstances")]
    assert leave[1] == "zones/" + emulator.zone + "/instanceGroupManagers/downgroup/abandonInstances", calls
    deletes = [what.rsplit("/", 2)[-2] for m, what in calls if m == "DELETE"]
    assert deletes == ["instanceGroupManagers", "instanceTemplates", "resourcePolicies", "instances"], calls

    assert cli("create", "idlevm", "-t", "tpu7x-8", "--autostop", "2s").code == 0
    before = len(emulator.requests())
    _wait_until_nothing_left(emulator, 60)
    assert [(m, what.rsplit("/", 1)[-1]) for m, what in _by_vm(emulator, before)] == [("DELETE", "idlevm")]


def test_two_slices_through_compute_engine_are_one_tpu(cli, emulator, clean):
    """`--slices 2` on Compute Engine: two groups sharing one template and one workload policy, one name for
    both; each host gets its slice's values and the MEGASCALE ones that join the slices, and jax's own
    cluster detection numbers the hosts as tpurun does."""
    r = cli("create", "twin", "-t", "tpu7x-16", "--slices", "2", "--json")
    assert r.code == 0, r.err
    d = json.loads(r.out)
    assert [w["name"] for w in d["workerEndpoints"]] == ["s0/w0", "s0/w1", "s1/w0", "s1/w1"]
    assert [s["name"] for s in d["slices"]] == ["twin-0", "twin-1"] and d["backend"] == "compute"
    status = emulator.admin.status()
    assert _names(status["instanceGroupManagers"]) == ["twin-0", "twin-1"]
    assert _names(status["resourcePolicies"]) == _names(status["instanceTemplates"]) == ["twin"]
    r = cli("delete", "twin-1", "--yes")  # a slice goes with the others
    assert_clean_error(r, 2)
    assert "slice 1 of the multislice TPU twin" in r.err

    (cli.cwd / "probe.py").write_text(PROBE.replace("print(json.dumps(seen))", SLICE_VALUES))
    r = cli("train", "probe.py", "--runtime", "pjrt", timeout=300)
    assert r.code == 0, r.err[-3000:]
    addresses = [w["internalIp"] for w in d["workerEndpoints"]]
    for i, tag in enumerate(["s0/w0", "s0/w1", "s1/w0", "s1/w1"]):
        line = next(t for k, v in by_tag(r.out).items() if k.startswith(tag + "/") or k == tag for t in v if "{" in t)
        seen = json.loads(line[line.index("{") :])
        own = addresses[2 * (i // 2) : 2 * (i // 2) + 2]
        assert seen["env"] == {
            "MEGASCALE_COORDINATOR_ADDRESS": f"{addresses[0]}:8081",
            "MEGASCALE_NUM_SLICES": "2",
            "MEGASCALE_SLICE_ID": str(i // 2),
            "TPU_WORKER_ID": str(i % 2),
            "TPU_WORKER_HOSTNAMES": ",".join(own),
        }, seen["env"]
        assert (seen["cluster"], seen["id"], seen["count"]) == ("gketpu", i, 4), seen
        assert seen["coordinator"] == f"{addresses[0]}:8482" and seen["worker_ips"] == own

    r = cli("delete", "twin", "--yes")
    assert r.code == 0, r.err
    assert "its 2 slices' instance groups" in r.err and "its workload policy" in r.err
    assert not _left(emulator)


SLICE_VALUES = """keys = ("MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID", "TPU_WORKER_ID",
        "TPU_WORKER_HOSTNAMES")
seen["env"] = {k: os.environ.get(k) for k in keys}
print(json.dumps(seen))"""


def test_flex_start_waits_for_capacity_then_makes_the_slice_at_once(cli, emulator, clean):
    """--flex-start: a FLEX_START template (its run duration, deleted at the end) and a BULK group, which
    makes no VM until the zone has capacity for all of them; create waits as for a queued resource."""
    emulator.set_capacity(f"{emulator.zone}/tpu7x=0")
    proc = popen(cli, "create", "flexy", "-t", "tpu7x-16", "--flex-start", "--max-run-duration", "2h", "--json")
    try:
        deadline = time.monotonic() + 60
        while "flexy" not in _names(emulator.admin.status()["instanceGroupManagers"]):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        time.sleep(1)
        d = json.loads(cli("describe", "flexy", "--json").out)
        assert (d["state"], d["workers"]) == ("WAITING_FOR_RESOURCES", 0), d
    finally:
        emulator.set_capacity(clear=True)
    out, err = finish(proc, timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert json.loads(out)["state"] == "READY" and "WAITING_FOR_RESOURCES" in err
    (template,) = emulator.emu.templates.values()
    sched = template.properties.scheduling
    assert (sched.provisioning_model, sched.max_run_duration.seconds, sched.instance_termination_action) == (
        "FLEX_START",
        7200,
        "DELETE",
    )
    (group,) = emulator.emu.migs.values()
    assert group.igm.target_size_policy.mode == "BULK"
    assert cli("delete", "flexy", "--yes").code == 0
    assert not _left(emulator)
