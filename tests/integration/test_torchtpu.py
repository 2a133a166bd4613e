"""TorchTPU (torch_tpu 0.2.0, PyTorch's native TPU backend) under `tpurun train`, checked with its own code.

TorchTPU needs a torch that torch_xla 2.9's cannot share an environment with, so it runs from an
environment of its own (scripts/test makes it; TPURUN_TORCHTPU_PYTHON names its Python), which every
emulated worker carries too (TPURUN_EMULATOR_IMAGE_VENVS). Its real code runs on the emulated workers: it
counts the devices and reads its topology from their PCI functions, its `set_tpu_launch_env` derives the
launch environment from what tpurun gives a host, torch.multiprocessing.spawn makes the device processes.

Where it stops: there is no TPU here. A process's first operation on a device calls TorchTPU's device
module `_lazy_init` and then libtpu's PJRT client, which aborts the process ("No jellyfish device
found"). A test-only module (launch_scripts/tpu_stop) stops each process at that `_lazy_init` and
prints what it was given; everything before that is TorchTPU's, torch's and the script's own doing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import create_node, finish, popen, read_until
from tests.integration.test_launch import Run, _no_python_left, _project, check_flood, parse_reports
from tpurun import config
from tpurun.topology import parse_accelerator_type

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

EXAMPLES = Path(__file__).parents[2] / "examples"
LAUNCH_ENV = re.compile(r"^\[w(\d+)\] LAUNCH-ENV (\{.*\})$")
STOP = ("--env", "PYTHONPATH=tpu_stop")


@pytest.fixture(scope="module")
def python() -> str:
    """The TorchTPU environment's Python (a missing one fails the suite where scripts/test runs it)."""
    path = config.TORCHTPU_PYTHON.raw()
    if not (path and os.access(path, os.X_OK)):
        problem = "no TorchTPU environment: scripts/test makes one (TPURUN_TORCHTPU_PYTHON)"
        if config.REQUIRE_EMULATOR.on():
            pytest.fail(problem)
        pytest.skip(problem)
    return path


def _launch_env(lines: list[str]) -> dict[int, dict]:
    """What TorchTPU's set_tpu_launch_env left in each host's parent: {worker: variables}."""
    return {int(m.group(1)): json.loads(m.group(2)) for m in map(LAUNCH_ENV.match, lines) if m}


def test_torchtpu_on_a_v5p_pod_slice(cli, emulator, python):
    """Both launch styles on two hosts: TorchTPU's own launch code agrees with tpurun's numbering, the device
    processes its spawner makes are followed and tagged, and detach, logs, kill-stale, Ctrl-C and fail-fast
    hold for them."""
    name, topo = "ttpu", parse_accelerator_type("v5p-16")
    d = create_node(cli, name, topo.name)
    addresses = [ep["internalIp"] for ep in d["workerEndpoints"]]
    _project(cli)

    # host launch, detached, runtime picked by auto from what the workers have (torch_tpu, libtpu, devices)
    r = cli("train", "torchtpu_spawn.py", "--python", python, *STOP, "--detach")
    assert r.code == 0, r.err
    assert "runtime torchtpu (auto picked torchtpu" in r.err, r.err
    job = r.out.strip().splitlines()[-1]
    follow = popen(cli, "logs", job, "--follow")  # every line so far, then the rest as they come
    try:
        lines = read_until(follow, lambda ls: len(parse_reports(ls)) == topo.chips, timeout=300)
    except BaseException:
        follow.kill()
        raise
    launch, reports = _launch_env(lines), parse_reports(lines)
    want_addresses = ",".join(f"{a}:{8070 + i}" for a in addresses for i in range(4))
    assert sorted(launch) == [0, 1], lines[-20:]
    for w, env in launch.items():
        assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == want_addresses
        assert (env["NNODES"], env["NODE_RANK"], env["MASTER_ADDR"]) == ("2", str(w), addresses[0])
        assert (env["TORCH_TPU_TOPOLOGY"], env["TORCH_TPU_XPROF_SESSION_ID"]) == ("2,2,2", job)
    # every device process of the spawner: tagged by the index spawn gave it, with its host's environment
    assert sorted((w, c) for w, c, _ in reports) == [(w, c) for w in (0, 1) for c in range(4)], lines[-20:]
    for w, c, rep in reports:
        assert rep["device"] == c and (rep["host_devices"], rep["host_topology"]) == (4, "2,2,1"), rep
        assert {k: rep["env"][k] for k in launch[w]} == launch[w]
    # kill-stale frees the devices the spawned processes hold; the job then ends by itself
    r = cli("kill-stale", "--grace", "1")
    assert r.code == 0, r.err
    finish(follow, timeout=120)  # the follow ends with the job
    assert json.loads(cli("jobs", "--json").out)[0]["status"] != "running"
    _no_python_left(emulator, name)

    # chip launch: tpurun starts each device process with what set_tpu_launch_env derived above, and
    # torchrun's variables; Ctrl-C stops them all
    run = Run(cli, "torchtpu_torchrun.py", "--runtime", "torchtpu", "--launch", "chip", "--python", python, *STOP)
    chip = run.wait_reports(topo.chips)
    code = run.interrupt()
    assert sorted((w, c) for w, c, _ in chip) == [(w, c) for w in (0, 1) for c in range(4)], run.context()
    for w, c, rep in chip:
        assert {k: rep["env"][k] for k in launch[w] if k != "TORCH_TPU_XPROF_SESSION_ID"} == {
            k: v for k, v in launch[w].items() if k != "TORCH_TPU_XPROF_SESSION_ID"
        }, run.context()
        assert rep["env"]["RANK"] == str(4 * w + c) and rep["env"]["LOCAL_RANK"] == str(c) and rep["device"] == c
    assert code == 130, run.context()
    _no_python_left(emulator, name)

    # fail-fast: device 2's start fails on both hosts; its siblings are stopped at once and it is named
    r = cli("train", "torchtpu_spawn.py", "--runtime", "torchtpu", "--python", python, *STOP,
            "--env", "TPU_STOP_BUSY=2", timeout=300)  # fmt: skip
    assert r.code == 1, r.err
    assert re.search(r"w[01]/c2 .* failed first", r.err) and "TPU is already in use" in r.err, r.err
    _no_python_left(emulator, name)

    # whole lines, each tagged with its own device, from every process TorchTPU's spawner makes on both hosts,
    # also those they print at import, before their index is known
    r = cli("train", "print_flood.py", "--runtime", "torchtpu", "--python", python,
            "--env", "FLOOD_SPAWNER=torchtpu", timeout=300)  # fmt: skip
    assert r.code == 0, r.err[-3000:]
    check_flood(r.out, workers=2, ranks=4)


def test_torchtpu_reads_a_tpu7x_vm_as_its_table_describes(cli, emulator, python):
    """A TPU7x VM made by Compute Engine: TorchTPU counts its 8 devices (4 chips, 2 chiplets each) and reads
    the topology its own table gives 8 devices; its spawner's 8 processes are followed, tagged c0..c7."""
    r = cli("create", "ironttpu", "--machine-type", "tpu7x-standard-4t", "--json")
    assert r.code == 0, r.err
    try:
        _tpu7x_host(cli, python)
    finally:
        assert cli("delete", "ironttpu", "--yes").code == 0


def _tpu7x_host(cli, python: str) -> None:
    _project(cli)
    shutil.copy(EXAMPLES / "digits_torchtpu.py", cli.cwd / "digits_torchtpu.py")  # the example, as shipped
    run = Run(cli, "digits_torchtpu.py", "--runtime", "torchtpu", "--python", python, *STOP)
    reports = run.wait_reports(8)
    code = run.interrupt()
    assert sorted(c for _, c, _ in reports) == list(range(8)), run.context()
    assert {(rep["host_devices"], rep["host_topology"]) for _, _, rep in reports} == {(8, "2,2,1,2")}
    for _, _, rep in reports:  # what set_tpu_launch_env left the parent, which the device processes inherit
        env = rep["env"]
        assert env["TORCH_TPU_TOPOLOGY"] == "2,2,1,2" and env["NNODES"] is None  # one host: no rendezvous
        assert len(env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")) == 8
    assert code == 130, run.context()
    # what tpurun's chip launch gives the same VM: TorchTPU's topology, one address per device
    plan = json.loads(cli("train", "torchtpu_torchrun.py", "--runtime", "torchtpu", "--launch", "chip",
                          "--dry-run", "--json").out)  # fmt: skip
    assert {p["env"]["TORCH_TPU_TOPOLOGY"] for p in plan["processes"]} == {"2,2,1,2"}
    assert len(plan["processes"]) == 8


def test_torchtpus_own_host_order_is_tpuruns_worker_order(python):
    """TorchTPU ranks a slice's hosts by their chips' coordinates (Z-major, then Y, then X); with hosts laid
    out X-fastest over the host bounds, its rank of every host is tpurun's worker number (docs/train.md)."""
    cases = {}
    for accel in ("v5p-16", "v5p-128", "v6e-16", "v6e-64", "tpu7x-32", "tpu7x-128"):
        topo = parse_accelerator_type(accel)
        bx, by, _ = (int(b) for b in topo.host_bounds.split(","))
        coords = [[(w % bx) * 2, (w // bx % by) * 2, w // (bx * by)] for w in range(topo.hosts)]
        cases[accel] = (topo.topology, coords)
    code = (
        "import json, sys\n"
        "from torch_tpu._internal.distributed.distributed import _calculate_topological_node_rank as rank\n"
        "cases = json.loads(sys.argv[1])\n"
        "print(json.dumps({a: [rank(c, t) for c in cs] for a, (t, cs) in cases.items()}))\n"
    )
    out = subprocess.run([python, "-c", code, json.dumps(cases)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    ranks = json.loads(out.stdout.strip().splitlines()[-1])
    assert ranks == {a: list(range(len(cs))) for a, (_, cs) in cases.items()}
