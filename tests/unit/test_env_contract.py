"""The env contract (tpurun/job/env_contract.py) as golden tables: the full environment of chosen processes per
runtime and accelerator type, written out literally (sources: docs/train.md). These are tpurun's own
choices; what torch_xla does with them is tested by running it (tests/integration/test_launch.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tpurun.errors import UsageError
from tpurun.job.env_contract import (
    HOST,
    Framework,
    SlotSpec,
    explain_core,
    pick_launch,
    pick_runtime,
    plan_job,
    pre_commands,
    script_framework,
)
from tpurun.topology import parse_accelerator_type
from tpurun.worker.probe import PythonProbe

ADDRESSES = [f"10.130.{i // 200}.{2 + i % 200}" for i in range(64)]


def plan(name: str | None, runtime: str, **kw) -> list[list[SlotSpec]]:
    topo = parse_accelerator_type(name) if name else None
    workers = kw.pop("worker_addresses", ADDRESSES[: topo.hosts] if topo else ["127.0.0.1"])
    defaults = {
        "cores": None,
        "core": None,
        "script": "train.py",
        "args": ["--epochs", "2"],
        "launch": "host" if runtime == "xrt" else "chip",
    }
    return plan_job(job_id="job-1", topology=topo, runtime=runtime, worker_addresses=workers, **{**defaults, **kw})


# (runtime, accelerator type, worker, index of the process on that worker) -> its whole environment
GOLDEN: dict[tuple[str, str, int, int], dict[str, str]] = {
    ("pjrt", "v2-8", 0, 3): {
        "TPURUN_JOB_ID": "job-1",
        "TPURUN_WORKER_ID": "0",
        "TPURUN_NUM_WORKERS": "1",
        "TPURUN_LAUNCH": "chip",
        "TPURUN_CORE": "3",
        "TPURUN_RESTART_COUNT": "0",
        "TPURUN_RESTART_REASON": "",
        "MASTER_ADDR": "10.130.0.2",
        "MASTER_PORT": "12355",
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "3",
        "LOCAL_WORLD_SIZE": "4",
        "PYTHONUNBUFFERED": "1",
        "PJRT_DEVICE": "TPU",
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": "v2-8",
        "TPU_WORKER_ID": "0",
        "TPU_WORKER_HOSTNAMES": "10.130.0.2",
        "TPU_PROCESS_BOUNDS": "2,2,1",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_VISIBLE_CHIPS": "3",
        "CLOUD_TPU_TASK_ID": "3",
        "TPU_PROCESS_ADDRESSES": "localhost:8476,localhost:8477,localhost:8478,localhost:8479",
        "TPU_PROCESS_PORT": "8479",
        "PJRT_LOCAL_PROCESS_RANK": "3",
        "PJRT_LOCAL_PROCESS_COUNT": "4",
        "TORCHELASTIC_RUN_ID": "job-1",
    },
    ("pjrt", "v3-32", 1, 2): {
        "TPURUN_JOB_ID": "job-1",
        "TPURUN_WORKER_ID": "1",
        "TPURUN_NUM_WORKERS": "4",
        "TPURUN_LAUNCH": "chip",
        "TPURUN_CORE": "2",
        "TPURUN_RESTART_COUNT": "0",
        "TPURUN_RESTART_REASON": "",
        "MASTER_ADDR": "10.130.0.2",
        "MASTER_PORT": "12355",
        "RANK": "6",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "4",
        "PYTHONUNBUFFERED": "1",
        "PJRT_DEVICE": "TPU",
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": "v3-32",
        "TPU_WORKER_ID": "1",
        "TPU_WORKER_HOSTNAMES": "10.130.0.2,10.130.0.3,10.130.0.4,10.130.0.5",
        "TPU_PROCESS_BOUNDS": "4,4,1",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_VISIBLE_CHIPS": "2",
        "CLOUD_TPU_TASK_ID": "6",
        "TPU_PROCESS_ADDRESSES": "10.130.0.2:8476,10.130.0.2:8477,10.130.0.2:8478,10.130.0.2:8479,10.130.0.3:8476,10.130.0.3:8477,10.130.0.3:8478,10.130.0.3:8479,10.130.0.4:8476,10.130.0.4:8477,10.130.0.4:8478,10.130.0.4:8479,10.130.0.5:8476,10.130.0.5:8477,10.130.0.5:8478,10.130.0.5:8479",
        "TPU_PROCESS_PORT": "8478",
        "PJRT_LOCAL_PROCESS_RANK": "2",
        "PJRT_LOCAL_PROCESS_COUNT": "4",
        "TORCHELASTIC_RUN_ID": "job-1",
    },
    ("pjrt", "v3-32", 3, 3): {
        "TPURUN_JOB_ID": "job-1",
        "TPURUN_WORKER_ID": "3",
        "TPURUN_NUM_WORKERS": "4",
        "TPURUN_LAUNCH": "chip",
        "TPURUN_CORE": "3",
        "TPURUN_RESTART_COUNT": "0",
        "TPURUN_RESTART_REASON": "",
        "MASTER_ADDR": "10.130.0.2",
        "MASTER_PORT": "12355",
        "RANK": "15",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "3",
        "LOCAL_WORLD_SIZE": "4",
        "PYTHONUNBUFFERED": "1",
        "PJRT_DEVICE": "TPU",
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": "v3-32",
        "TPU_WORKER_ID": "3",
        "TPU_WORKER_HOSTNAMES": "10.130.0.2,10.130.0.3,10.130.0.4,10.130.0.5",
        "TPU_PROCESS_BOUNDS": "4,4,1",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_VISIBLE_CHIPS": "3",
        "CLOUD_TPU_TASK_ID": "15",
        "TPU_PROCESS_ADDRESSES": "10.130.0.2:8476,10.130.0.2:8477,10.130.0.2:8478,10.130.0.2:8479,10.130.0.3:8476,10.130.0.3:8477,10.130.0.3:8478,10.130.0.3:8479,10.130.0.4:8476,10.130.0.4:8477,10.130.0.4:8478,10.130.0.4:8479,10.130.0.5:8476,10.130.0.5:8477,10.130.0.5:8478,10.130.0.5:8479",
        "TPU_PROCESS_PORT": "8479",
        "PJRT_LOCAL_PROCESS_RANK": "3",
        "PJRT_LOCAL_PROCESS_COUNT": "4",
        "TORCHELASTIC_RUN_ID": "job-1",
    },
    ("pjrt", "v4-32", 2, 1): {
        "TPURUN_JOB_ID": "job-1",
        "TPURUN_WORKER_ID": "2",
        "TPURUN_NUM_WORKERS": "4",
        "TPURUN_LAUNCH": "chip",
        "TPURUN_CORE": "1",
        "TPURUN_RESTART_COUNT": "0",
        "TPURUN_RESTART_REASON": "",
        "MASTER_ADDR": "10.130.0.2",
        "MASTER_PORT": "12355",
        "RANK": "9",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "PYTHONUNBUFFERED": "1",
        "PJRT_DEVICE": "TPU",
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": "v4-32",
        "TPU_WORKER_ID": "2",
        "TPU_WORKER_HOSTNAMES": "10.130.0.2,10.130.0.3,10.130.0.4,10.130.0.5",
        "TPU_PROCESS_BOUNDS": "2,2,4",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_VISIBLE_CHIPS": "1",
        "CLOUD_TPU_TASK_ID": "9",
        "TPU_PROCESS_ADDRESSES": "10.130.0.2:8476,10.130.0.2:8477,10.130.0.2:8478,10.130.0.2:8479,10.130.0.3:8476,10.130.0.3:8477,10.130.0.3:8478,10.130.0.3:8479,10.130.0.4:8476,10.130.0.4:8477,10.130.0.4:8478,10.130.0.4:8479,10.130.0.5:8476,10.130.0.5:8477,10.130.0.5:8478,10.130.0.5:8479",
        "TPU_PROCESS_PORT": "8477",
        "PJRT_LOCAL_PROCESS_RANK": "1",
        "PJRT_LOCAL_PROCESS_COUNT": "4",
        "TORCHELASTIC_RUN_ID": "job-1",
    },
    ("pjrt", "v5litepod-16", 3, 0): {
        "TPURUN_JOB_ID": "job-1",
        "TPURUN_WORKER_ID": "3",
        "TPURUN_NUM_WORKERS": "4",
        "TPURUN_LAUNCH": "chip",
        "TPURUN_CORE": "0",
        "TPURUN_RESTART_COUNT": "0",
        "TPURUN_RESTART_REASON": "",
        "MASTER_ADDR": "10.130.0.2",
        "MASTER_PORT": "12355",
        "RANK": "12",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "4",
        "PYTHONUNBUFFERED": "1",
        "PJRT_DEVICE": "TPU",
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": "v5litepod-16",
        "TPU_WORKER_ID": "3",
        "TPU_WORKER_HOSTNAMES": "10.130.0.2,10.130.0.3,10.130.0.4,10.130.0.5",
        "TPU_PROCESS_BOUNDS": "4,4,1",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_VISIBLE_CHIPS": "0",
        "CLOUD_TPU_TASK_ID": "12",
        "TPU_PROCESS_ADDRESSES": "10.130.0.2:8476,10.130.0.2:8477,10.130.0.2:8478,10.130.0.2:8479,10.130.0.3:8476,10.130.0.3:8477,10.130.0.3:8478,10.130.0.3:8479,10.130.0.4:8476,10.130.0.4:8477,10.130.0.4:8478,10.130.0.4:8479,10.130.0.5:8476,10.130.0.5:8477,10.130.0.5:8478,10.130.0.5:8479",
        "TPU_PROCESS_PORT": "8476",
        "PJRT_LOCAL_PROCESS_RANK": "0",
        "PJRT_LOCAL_PROCESS_COUNT": "4",
        "TORCHELASTIC_RUN_ID": "job-1",
    },
    ("pjrt", "v6e-8", 0, 7): {
        "TPURUN_JOB_ID": "job-1",
        "TPURUN_WORKER_ID": "0",
        "TPURUN_NUM_WORKERS": "1",
        "TPURUN_LAUNCH": "chip",
        "TPURUN_CORE": "7",
        "TPURUN_RESTART_COUNT": "0",
        "TPURUN_RESTART_REASON": "",
        "MASTER_ADDR": "10.130.0.2",
        "MASTER_PORT": "12355",
        "RANK": "7",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "7",
        "LOCAL_WORLD_SIZE": "8",
        "PYTHONUNBUFFERED": "1",
        "PJRT_DEVICE": "TPU",
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": "v6e-8",
        "TPU_WORKER_ID": "0",
        "TPU_WORKER_HOSTNAMES": "10.130.0.2",
        "TPU_PROCESS_BOUNDS": "2,4,1",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_VISIBLE_CHIPS": "7",
        "CLOUD_TPU_TASK_ID": "7",
        "TPU_PROCESS_ADDRESSES": "localhost:8476,localhost:8477,localhost:8478,localhost:8479,localhost:8480,localhost:8481,localhost:8482,localhost:8483",
        "TPU_PROCESS_PORT": "8483",
        "PJRT_LOCAL_PROCESS_RANK": "7",
        "PJRT_LOCAL_PROCESS_COUNT": "8",
        "TORCHELASTIC_RUN_ID": "job-1",
    },
    ("xrt", "v2-8", 0, 0): {
        "TPURUN_JOB_ID": "job-1",
        "TPURUN_WORKER_ID": "0",
        "TPURUN_NUM_WORKERS": "1",
        "TPURUN_LAUNCH": "host",
        "TPURUN_RESTART_COUNT": "0",
        "TPURUN_RESTART_REASON": "",
        "MASTER_ADDR": "10.130.0.2",
        "MASTER_PORT": "12355",
        "PYTHONUNBUFFERED": "1",
        "XRT_TPU_CONFIG": "localservice;0;localhost:51011",
        "TPU_NUM_DEVICES": "8",
    },
    ("xrt", "v3-32", 0, 0): {
        "TPURUN_JOB_ID": "job-1",
        "TPURUN_WORKER_ID": "0",
        "TPURUN_NUM_WORKERS": "4",
        "TPURUN_LAUNCH": "host",
        "TPURUN_RESTART_COUNT": "0",
        "TPURUN_RESTART_REASON": "",
        "MASTER_ADDR": "10.130.0.2",
        "MASTER_PORT": "12355",
        "PYTHONUNBUFFERED": "1",
        "XRT_LOCAL_WORKER": "c_localservice:0",
        "XRT_MESH_SERVICE_ADDRESS": "10.130.0.2:8477",
        "XRT_SHARD_WORLD_SIZE": "4",
        "XRT_SHARD_ORDINAL": "0",
        "TPU_NUM_DEVICES": "8",
        "XLA_EMIT_STEPLOG": "1",
        "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
        "TPUVM_MODE": "1",
        "CLOUD_TPU_TASK_ID": "0",
        "TPU_HOST_BOUNDS": "2,2,1",
        "TPU_MESH_CONTROLLER_ADDRESS": "10.130.0.2:8476",
        "TPU_MESH_CONTROLLER_PORT": "8476",
        "XRT_TPU_CONFIG": "c_localservice;0;10.130.0.2:51011|c_localservice;1;10.130.0.3:51011|c_localservice;2;10.130.0.4:51011|c_localservice;3;10.130.0.5:51011",
    },
    ("xrt", "v3-32", 2, 0): {
        "TPURUN_JOB_ID": "job-1",
        "TPURUN_WORKER_ID": "2",
        "TPURUN_NUM_WORKERS": "4",
        "TPURUN_LAUNCH": "host",
        "TPURUN_RESTART_COUNT": "0",
        "TPURUN_RESTART_REASON": "",
        "MASTER_ADDR": "10.130.0.2",
        "MASTER_PORT": "12355",
        "PYTHONUNBUFFERED": "1",
        "XRT_LOCAL_WORKER": "c_localservice:2",
        "XRT_MESH_SERVICE_ADDRESS": "10.130.0.2:8477",
        "XRT_SHARD_WORLD_SIZE": "4",
        "XRT_SHARD_ORDINAL": "2",
        "TPU_NUM_DEVICES": "8",
        "XLA_EMIT_STEPLOG": "1",
        "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
        "TPUVM_MODE": "1",
        "CLOUD_TPU_TASK_ID": "2",
        "TPU_HOST_BOUNDS": "2,2,1",
        "TPU_MESH_CONTROLLER_ADDRESS": "10.130.0.2:8476",
        "TPU_MESH_CONTROLLER_PORT": "8476",
    },
    ("xrt", "v4-32", 1, 0): {
        "TPURUN_JOB_ID": "job-1",
        "TPURUN_WORKER_ID": "1",
        "TPURUN_NUM_WORKERS": "4",
        "TPURUN_LAUNCH": "host",
        "TPURUN_RESTART_COUNT": "0",
        "TPURUN_RESTART_REASON": "",
        "MASTER_ADDR": "10.130.0.2",
        "MASTER_PORT": "12355",
        "PYTHONUNBUFFERED": "1",
        "XRT_LOCAL_WORKER": "c_localservice:1",
        "XRT_MESH_SERVICE_ADDRESS": "10.130.0.2:8477",
        "XRT_SHARD_WORLD_SIZE": "4",
        "XRT_SHARD_ORDINAL": "1",
        "TPU_NUM_DEVICES": "4",
        "XLA_EMIT_STEPLOG": "1",
        "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
        "TPUVM_MODE": "1",
        "CLOUD_TPU_TASK_ID": "1",
        "TPU_HOST_BOUNDS": "1,1,4",
        "TPU_MESH_CONTROLLER_ADDRESS": "10.130.0.2:8476",
        "TPU_MESH_CONTROLLER_PORT": "8476",
    },
}


@pytest.mark.parametrize("key", list(GOLDEN), ids=lambda k: "-".join(map(str, k)))
def test_golden_env(key: tuple[str, str, int, int]) -> None:
    runtime, name, worker, index = key
    spec = plan(name, runtime)[worker][index]
    assert spec.env == GOLDEN[key]
    assert spec.argv == ["python3", "train.py", "--epochs", "2"]
    assert spec.worker == worker


@pytest.mark.parametrize(
    ("name", "hosts", "per_host"),
    [("v2-8", 1, 4), ("v3-32", 4, 4), ("v4-32", 4, 4), ("v5litepod-16", 4, 4), ("v6e-8", 1, 8)],
)
def test_pjrt_runs_one_process_per_chip(name: str, hosts: int, per_host: int) -> None:
    p = plan(name, "pjrt")
    assert [len(w) for w in p] == [per_host] * hosts


@pytest.mark.parametrize("name", ["v2-8", "v3-32", "v4-32"])
def test_xrt_runs_one_process_per_host(name: str) -> None:
    p = plan(name, "xrt")
    assert all(len(w) == 1 and w[0].slot == HOST for w in p)
    assert [w[0].env["TPURUN_WORKER_ID"] for w in p] == [str(i) for i in range(len(p))]
    assert not any("RANK" in w[0].env for w in p)


@pytest.mark.parametrize("name", ["v5litepod-16", "v6e-8"])
def test_xrt_is_refused_where_it_never_ran(name: str) -> None:
    with pytest.raises(UsageError, match="XRT was removed"):
        plan(name, "xrt")


def test_xrt_on_one_tpu_vm_uses_the_local_service() -> None:
    env = plan("v3-8", "xrt")[0][0].env
    assert env["XRT_TPU_CONFIG"] == "localservice;0;localhost:51011"
    assert env["TPU_NUM_DEVICES"] == "8"
    assert "XRT_LOCAL_WORKER" not in env
    assert pre_commands(parse_accelerator_type("v3-8"), "xrt", 0) == []


def test_xrt_tpu_node_architecture() -> None:
    env = plan("v3-8", "xrt", tpu_ip="10.240.1.2")[0][0].env
    assert env["XRT_TPU_CONFIG"] == "tpu_worker;0;10.240.1.2:8470"


def test_xrt_pod_workers_start_the_xrt_server_first() -> None:
    topo = parse_accelerator_type("v3-32")
    assert pre_commands(topo, "xrt", 2) == [["python3", "-m", "torch_xla.core.xrt_run_server", "--port", "51011"]]
    assert pre_commands(topo, "pjrt", 2) == []
    # only worker 0 carries the mesh's XRT_TPU_CONFIG
    p = plan("v3-32", "xrt")
    assert [("XRT_TPU_CONFIG" in w[0].env) for w in p] == [True, False, False, False]


def test_cpu_runtime_one_device_per_process() -> None:
    p = plan(None, "cpu", cores=4)
    assert len(p) == 1 and [s.slot for s in p[0]] == [0, 1, 2, 3]
    assert p[0][2].env == {
        "TPURUN_JOB_ID": "job-1",
        "TPURUN_WORKER_ID": "0",
        "TPURUN_NUM_WORKERS": "1",
        "TPURUN_LAUNCH": "chip",
        "TPURUN_CORE": "2",
        "TPURUN_RESTART_COUNT": "0",
        "TPURUN_RESTART_REASON": "",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "12355",
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "4",
        "PYTHONUNBUFFERED": "1",
        "PJRT_DEVICE": "CPU",
        "CPU_NUM_DEVICES": "1",
        "TORCHELASTIC_RUN_ID": "job-1",
        # no TPU to detect: what jax.distributed.initialize() needs, given
        "JAX_COORDINATOR_ADDRESS": "127.0.0.1:8482",
        "JAX_NUM_PROCESSES": "4",
        "JAX_PROCESS_ID": "2",
    }


def _multislice_plan(runtime: str, launch: str) -> list[list]:
    from tpurun.job.env_contract import plan_job

    return plan_job(
        job_id="job-1",
        topology=parse_accelerator_type("v4-16"),
        runtime=runtime,
        launch=launch,
        worker_addresses=["10.0.0.1", "10.0.0.2", "10.0.1.1", "10.0.1.2"],
        slice_size=2,
        cores=None if runtime == "pjrt" else 1,
        core=None,
        script="train.py",
        args=[],
    )


def test_multislice_each_slice_its_own_tpu_variables_every_process_the_megascale_ones() -> None:
    p = _multislice_plan("pjrt", "chip")
    s1w0 = p[2][1].env  # slice 1, its worker 0, chip 1
    assert s1w0["TPU_WORKER_ID"] == "0" and s1w0["TPU_WORKER_HOSTNAMES"] == "10.0.1.1,10.0.1.2"
    assert s1w0["CLOUD_TPU_TASK_ID"] == "1"  # within the slice: worker 0 × 4 chips + chip 1
    assert s1w0["TPU_PROCESS_ADDRESSES"].startswith("10.0.1.1:8476,")
    assert (s1w0["TPURUN_WORKER_ID"], s1w0["RANK"], s1w0["WORLD_SIZE"]) == ("2", "9", "16")
    for per_worker in p:
        for c in per_worker:
            slice_id = str(c.worker // 2)
            assert c.env["MEGASCALE_COORDINATOR_ADDRESS"] == "10.0.0.1:8081"
            assert (c.env["MEGASCALE_NUM_SLICES"], c.env["MEGASCALE_SLICE_ID"]) == ("2", slice_id)
            assert (c.env["TPURUN_NUM_SLICES"], c.env["TPURUN_SLICE_ID"]) == ("2", slice_id)
            assert c.env["MASTER_ADDR"] == "10.0.0.1"
    # a host launch sets nothing that would override what the VM says (its own tpu-env): only MEGASCALE
    host = _multislice_plan("pjrt", "host")[3][0].env
    assert "TPU_WORKER_ID" not in host and host["MEGASCALE_SLICE_ID"] == "1"
    assert not any(k.startswith("JAX_") for k in host)


def test_multislice_cpu_jax_process_ids_are_slice_major() -> None:
    p = _multislice_plan("cpu", "chip")
    assert [c.env["JAX_PROCESS_ID"] for w in p for c in w] == ["0", "1", "2", "3"]
    assert {c.env["JAX_NUM_PROCESSES"] for w in p for c in w} == {"4"}
    assert {c.env["JAX_COORDINATOR_ADDRESS"] for w in p for c in w} == {"10.0.0.1:8482"}


def test_multislice_xrt_refused() -> None:
    with pytest.raises(UsageError, match="XRT predates multislice"):
        _multislice_plan("xrt", "host")


def test_cpu_runtime_on_two_workers() -> None:
    p = plan(None, "cpu", cores=2, worker_addresses=["10.0.0.1", "10.0.0.2"])
    assert [[s.env["RANK"] for s in w] for w in p] == [["0", "1"], ["2", "3"]]
    assert {s.env["MASTER_ADDR"] for w in p for s in w} == {"10.0.0.1"}
    assert {s.env["WORLD_SIZE"] for w in p for s in w} == {"4"}
    # without --cores: the topology's devices per host, or one process
    assert len(plan("v4-8", "cpu")[0]) == 4
    assert len(plan(None, "cpu")[0]) == 1


def test_cores_1_runs_one_chip() -> None:
    p = plan("v3-8", "pjrt", cores=1)
    assert len(p[0]) == 1
    env = p[0][0].env
    assert (env["TPU_PROCESS_BOUNDS"], env["TPU_CHIPS_PER_PROCESS_BOUNDS"], env["TPU_VISIBLE_CHIPS"]) == (
        "1,1,1",
        "1,1,1",
        "0",
    )
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("0", "1", "1")
    assert "TPU_PROCESS_ADDRESSES" not in env and "CLOUD_TPU_TASK_ID" not in env
    # --cores N = all of a host is the default
    assert len(plan("v3-8", "pjrt", cores=8)[0]) == 4


def test_core_5_on_v3_8_runs_chip_2() -> None:
    p = plan("v3-8", "pjrt", core=5)
    assert len(p[0]) == 1
    spec = p[0][0]
    assert spec.slot == 5 and spec.env["TPURUN_CORE"] == "5"
    assert spec.env["TPU_VISIBLE_CHIPS"] == "2"
    assert spec.env["TPU_PROCESS_BOUNDS"] == "1,1,1"
    assert spec.env["RANK"] == "0" and spec.env["WORLD_SIZE"] == "1"
    assert explain_core(parse_accelerator_type("v3-8"), 5) == (
        "core 5 is TensorCore 1 of chip 2; PJRT cannot select one core of a v3 chip, "
        "so chip 2 (cores 4-5) runs as one process"
    )


def test_explain_core_other_generations() -> None:
    assert "megacore" in explain_core(parse_accelerator_type("v4-8"), 3)
    assert explain_core(parse_accelerator_type("v6e-8"), 7).startswith("core 7 is chip 7")
    with pytest.raises(UsageError, match="out of range"):
        explain_core(parse_accelerator_type("v3-8"), 8)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"cores": 3}, "1 or all"),
        ({"cores": 1, "core": 2}, "exclude"),
        ({"core": 9}, "out of range"),
    ],
)
def test_bad_core_choices(kw: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        plan("v3-8", "pjrt", **kw)


def test_one_core_of_a_pod_is_refused() -> None:
    with pytest.raises(UsageError, match="slice"):
        plan("v4-32", "pjrt", cores=1)


def test_wrong_number_of_workers() -> None:
    with pytest.raises(UsageError, match="4 hosts"):
        plan("v4-32", "pjrt", worker_addresses=ADDRESSES[:2])


def test_bf16_sets_xla_use_bf16() -> None:
    for runtime in ("pjrt", "xrt"):
        assert plan("v3-8", runtime, precision="bf16")[0][0].env["XLA_USE_BF16"] == "1"
    assert plan(None, "cpu", precision="bf16")[0][0].env["XLA_USE_BF16"] == "1"
    assert "XLA_USE_BF16" not in plan("v3-8", "pjrt")[0][0].env


def test_extra_env_wins() -> None:
    extra = {"TPU_VISIBLE_CHIPS": "9", "MASTER_PORT": "1", "MY_FLAG": "x y"}
    env = plan("v4-8", "pjrt", extra_env=extra)[0][1].env
    assert (env["TPU_VISIBLE_CHIPS"], env["MASTER_PORT"], env["MY_FLAG"]) == ("9", "1", "x y")


def test_restart_count_and_python_and_port() -> None:
    s = plan(None, "cpu", restart_count=2, python="/opt/py/bin/python", master_port=2345)[0][0]
    assert s.env["TPURUN_RESTART_COUNT"] == "2" and s.env["MASTER_PORT"] == "2345"
    assert s.argv == ["/opt/py/bin/python", "train.py", "--epochs", "2"]


def _probe(libtpu: bool = True, devices: bool = True, **versions: str | None) -> dict:
    """What the runtime probe prints of a worker's Python: libtpu, the TPU device files, the versions of torch_xla
    and torch_tpu it imports (one not named: not printed)."""
    return {"libtpu_installed": libtpu, "device_files_present": devices, **versions}


@pytest.mark.parametrize(
    ("requested", "probe", "runtime", "why"),
    [
        ("auto", _probe(torch_xla_version="2.9.0"), "pjrt", "libtpu"),
        ("auto", _probe(torch_xla_version="2.0.0+xrt"), "xrt", "< 2.1"),
        ("auto", _probe(torch_xla_version="1.13"), "xrt", "< 2.1"),
        ("auto", _probe(devices=False, torch_xla_version="2.9.0"), "cpu", "device files"),
        ("auto", _probe(libtpu=False, torch_xla_version="2.9.0"), "cpu", "libtpu is not"),
        ("auto", _probe(torch_xla_version=None), "cpu", "neither torch_xla nor torch_tpu is installed"),
        ("auto", _probe(torch_tpu_version="0.2.0"), "torchtpu", "torch_tpu 0.2.0"),
        # both (not in one environment as released): torch_xla's, as before TorchTPU; --runtime torchtpu says
        ("auto", _probe(torch_xla_version="2.9.0", torch_tpu_version="0.2.0"), "pjrt", "torch_xla 2.9.0"),
        ("auto", _probe(libtpu=False, devices=False, torch_tpu_version="0.2.0"), "cpu", "libtpu is not"),
        ("pjrt", {}, "pjrt", "requested"),
        ("torchtpu", {}, "torchtpu", "requested"),
    ],
)
def test_pick_runtime(requested: str, probe: dict, runtime: str, why: str) -> None:
    got, reason = pick_runtime(requested, PythonProbe.from_dict(probe))
    assert got == runtime and why in reason
    assert runtime in reason


def test_probe_script_runs_here() -> None:
    import json
    import subprocess
    import sys

    from tpurun.job.env_contract import PROBE_SCRIPT

    out = subprocess.run([sys.executable, "-c", PROBE_SCRIPT], capture_output=True, text=True, check=True).stdout
    probe = json.loads(out)
    assert {"libtpu_installed", "device_files_present", "torch_xla_version"} <= set(probe)
    # it prints every field of the answer's record but the error, read back as that record
    assert list(probe) == [f for f in PythonProbe.__slots__ if f != "error"]
    assert PythonProbe.from_dict(probe).to_dict() == probe
    assert pick_runtime("auto", PythonProbe.from_dict(probe))[0] in ("cpu", "pjrt", "xrt")


TYPES = ["v2-8", "v2-32", "v3-8", "v3-32", "v3-128", "v4-8", "v4-32", "v4-128", "v5litepod-4", "v5litepod-16",
         "v5litepod-64", "v5p-8", "v5p-32", "v6e-1", "v6e-8", "v6e-32"]  # fmt: skip


@given(name=st.sampled_from(TYPES), runtime=st.sampled_from(["pjrt", "cpu"]), cpu_cores=st.integers(1, 8))
def test_chip_launch_ranks_are_unique_and_contiguous(name: str, runtime: str, cpu_cores: int) -> None:
    topo = parse_accelerator_type(name)
    p = plan(name, runtime, cores=cpu_cores if runtime == "cpu" else None, launch="chip", oversubscribe=True)
    specs = [s for w in p for s in w]
    world = int(specs[0].env["WORLD_SIZE"])
    assert sorted(int(s.env["RANK"]) for s in specs) == list(range(world))
    assert [s.rank for s in specs] == list(range(world))  # worker-major
    for s in specs:
        assert int(s.env["LOCAL_RANK"]) < int(s.env["LOCAL_WORLD_SIZE"])
        assert s.env["TPURUN_WORKER_ID"] == str(s.worker)
        assert s.env["MASTER_ADDR"] == ADDRESSES[0]
    if runtime == "pjrt":
        for s in specs:
            addresses = s.env["TPU_PROCESS_ADDRESSES"].split(",")
            assert len(addresses) == world == len(set(addresses))
            assert int(s.env["CLOUD_TPU_TASK_ID"]) == s.rank
            assert addresses[s.rank].endswith(":" + s.env["TPU_PROCESS_PORT"])
            bounds = [int(x) for x in s.env["TPU_PROCESS_BOUNDS"].split(",")]
            assert bounds[0] * bounds[1] * bounds[2] == world == topo.chips


@given(name=st.sampled_from(["v2-8", "v3-8", "v4-8", "v5litepod-8", "v6e-8", "v5p-8"]), data=st.data())
def test_any_single_core_maps_to_its_chip(name: str, data: st.DataObject) -> None:
    topo = parse_accelerator_type(name)
    core = data.draw(st.integers(0, topo.pjrt_devices_per_host - 1))
    (spec,) = plan(name, "pjrt", core=core)[0]
    chip = int(spec.env["TPU_VISIBLE_CHIPS"])
    assert 0 <= chip < topo.chips_per_host
    assert f"chip {chip}" in explain_core(topo, core)


@given(name=st.sampled_from(TYPES), runtime=st.sampled_from(["pjrt", "xrt", "cpu"]))
def test_host_launch_is_one_process_per_worker_without_torchrun_variables(name: str, runtime: str) -> None:
    topo = parse_accelerator_type(name)
    if runtime == "xrt" and topo.generation not in ("v2", "v3", "v4"):
        with pytest.raises(UsageError, match="XRT was removed"):
            plan(name, runtime, launch="host")
        return
    p = plan(name, runtime, launch="host")
    assert [[s.slot for s in w] for w in p] == [[HOST]] * topo.hosts
    for w, (s,) in enumerate(p):
        assert s.env["TPURUN_WORKER_ID"] == str(w) and s.env["TPURUN_LAUNCH"] == "host"
        assert s.env["MASTER_ADDR"] == ADDRESSES[0]
        # the script's spawner numbers its children; tpurun must not hand them one torchrun rank
        assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "TPURUN_CORE", "TORCHELASTIC_RUN_ID"} & set(s.env)
        assert s.argv == ["python3", "train.py", "--epochs", "2"]


def test_pjrt_host_launch_leaves_the_topology_to_the_vm() -> None:
    (s,) = plan("v4-8", "pjrt", launch="host")[0]
    assert s.env["PJRT_DEVICE"] == "TPU"
    # torch_xla reads the chips from PCI and the bounds from the tpu-env metadata, as on any TPU VM
    assert not [k for k in s.env if k.startswith("TPU_")]


@pytest.mark.parametrize(("name", "bounds", "per_host"), [("tpu7x-32", "1,1,4", "2,2,1"), ("v6e-8", "1,1,1", "2,4,1")])
def test_pjrt_host_launch_on_vms_that_do_not_describe_their_slice(name: str, bounds: str, per_host: str) -> None:
    """Compute Engine VMs carry no `tpu-env`: each host is given its slice under the environment names,
    host-level only, so the script's spawner still numbers its chip processes itself."""
    topo = parse_accelerator_type(name)
    p = plan(name, "pjrt", launch="host", slice_metadata=False)
    for w, (s,) in enumerate(p):
        tpu = {k: v for k, v in s.env.items() if k.startswith(("TPU_", "MEGASCALE_"))}
        assert tpu == {
            "TPU_SKIP_MDS_QUERY": "1",
            "TPU_ACCELERATOR_TYPE": name,
            "TPU_WORKER_ID": str(w),
            "TPU_WORKER_HOSTNAMES": ",".join(ADDRESSES[: topo.hosts]),
            "TPU_HOST_BOUNDS": bounds,
            "TPU_CHIPS_PER_HOST_BOUNDS": per_host,
            "TPU_TOPOLOGY": topo.topology,
            "MEGASCALE_NUM_SLICES": "1",
            "MEGASCALE_SLICE_ID": "0",
        }
        # whatever the runtime and launch: `import torch_xla` reads the slice where the VM has chips
        for runtime, launch in (("cpu", "host"), ("cpu", "chip")):
            for c in plan(name, runtime, launch=launch, slice_metadata=False)[w]:
                assert {k: c.env[k] for k in tpu} == tpu, (runtime, launch)
    # where the metadata describes the slice, nothing of it is given on the cpu runtime
    (s,) = plan(name, "cpu", launch="host")[0]
    assert not [k for k in s.env if k.startswith(("TPU_", "MEGASCALE_"))]


def test_tpu7x_chip_launch_bounds_count_its_two_tensorcores() -> None:
    """torch_xla counts a TPU7x chip's two chiplets as two chips (two PCI functions) and its configure_topology
    adds a fourth process bound of 2 (pytorch/xla #9586): eight processes per host."""
    p = plan("tpu7x-32", "pjrt", launch="chip")
    assert [len(w) for w in p] == [8] * 4
    s = p[3][7]
    assert (s.env["TPU_PROCESS_BOUNDS"], s.env["CLOUD_TPU_TASK_ID"], s.env["TPU_VISIBLE_CHIPS"]) == (
        "2,2,4,2",
        "31",
        "7",
    )


@pytest.mark.parametrize(
    ("name", "kw", "chip"), [("v4-8", {"cores": 1}, "0"), ("v3-8", {"core": 5}, "2"), ("v6e-8", {"core": 7}, "7")]
)
def test_pjrt_host_launch_one_chip_uses_torch_xlas_one_chip_topology(name: str, kw: dict, chip: str) -> None:
    (s,) = plan(name, "pjrt", launch="host", **kw)[0]
    assert s.slot == HOST
    assert {k: v for k, v in s.env.items() if k.startswith("TPU_")} == {
        "TPU_VISIBLE_CHIPS": chip,
        "TPU_PROCESS_BOUNDS": "1,1,1",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
    }


def test_pick_launch() -> None:
    assert pick_launch(None, "pjrt")[0] == "host"
    assert pick_launch(None, "xrt")[0] == "host"
    assert pick_launch(None, "cpu")[0] == "chip"
    assert pick_launch("chip", "pjrt")[0] == "chip"
    assert pick_launch("host", "cpu")[0] == "host"
    with pytest.raises(UsageError, match="XRT runs one process per host"):
        pick_launch("chip", "xrt")
    with pytest.raises(UsageError, match="use host or chip"):
        pick_launch("rank", "pjrt")


@pytest.mark.parametrize(
    ("source", "framework"),
    [
        ("import jax\nimport jax.numpy as jnp\n", "jax"),
        ("import jax\nimport torch\n", "torch"),
        ("from torch_xla import runtime as xr\n", "torch"),
        ("import lightning as L\n", "torch"),
        ("import numpy as np\nprint('hi')\n", "other"),
    ],
)
def test_a_scripts_framework_decides_its_default_launch_and_words(source: str, framework: str) -> None:
    """JAX's own model is one process per host, on every runtime: a JAX script's default launch is host, and
    its reason speaks of JAX, never of a spawner; a torch script keeps the runtime's default."""
    found = script_framework(source)
    assert found == framework
    for runtime in ("cpu", "pjrt"):
        launch, why = pick_launch(None, runtime, found)
        if found is Framework.jax:
            assert launch == "host" and "JAX" in why and "spawner" not in why, why
        else:
            assert launch == pick_launch(None, runtime)[0]
    assert ("spawner" in pick_launch("host", "pjrt", found)[1]) == (found is not Framework.jax)


def test_cpu_host_launch_refuses_several_cores() -> None:
    with pytest.raises(UsageError, match="--launch chip"):
        plan(None, "cpu", launch="host", cores=2)
    (s,) = plan(None, "cpu", launch="host", cores=1)[0]
    assert s.env["PJRT_DEVICE"] == "CPU" and s.slot == HOST


# ---------------------------------------------------------------- TorchTPU (docs/train.md, "TorchTPU")

TORCHTPU_JOB = {"TPURUN_JOB_ID", "TPURUN_WORKER_ID", "TPURUN_NUM_WORKERS", "TPURUN_LAUNCH", "TPURUN_RESTART_COUNT",
                "TPURUN_RESTART_REASON",
                "MASTER_ADDR", "MASTER_PORT", "PYTHONUNBUFFERED"}  # fmt: skip


def test_torchtpu_host_launch_gives_each_host_what_set_tpu_launch_env_reads() -> None:
    """The script's own set_tpu_launch_env derives the rest (slice-builder addresses for its nproc_per_node)."""
    for w, (s,) in enumerate(plan("v5p-16", "torchtpu", launch="host")):
        assert s.slot == HOST
        assert {k: v for k, v in s.env.items() if k not in TORCHTPU_JOB} == {
            "TPU_WORKER_HOSTNAMES": "10.130.0.2,10.130.0.3",
            "TORCH_TPU_TOPOLOGY": "2,2,2",
            "TORCH_TPU_XPROF_SESSION_ID": "job-1",
            "NNODES": "2",
            "NODE_RANK": str(w),
        }
        assert s.env["MASTER_ADDR"] == "10.130.0.2"
    # one host: TorchTPU finds its topology on PCI and picks local ports itself
    (s,) = plan("v6e-8", "torchtpu", launch="host")[0]
    assert {k: v for k, v in s.env.items() if k not in TORCHTPU_JOB} == {
        "TPU_WORKER_HOSTNAMES": "10.130.0.2",
        "TORCH_TPU_XPROF_SESSION_ID": "job-1",
    }


@pytest.mark.parametrize(
    ("name", "per_host", "topology"),
    [("v5p-16", 4, "2,2,2"), ("v6e-16", 4, "4,4,1"), ("tpu7x-16", 8, "2,2,2,2"), ("v6e-8", 8, "2,4,1"), ("tpu7x-8", 8, "2,2,1,2")],
)  # fmt: skip
def test_torchtpu_chip_launch_gives_every_device_what_set_tpu_launch_env_would_derive(name, per_host, topology) -> None:
    topo = parse_accelerator_type(name)
    p = plan(name, "torchtpu", launch="chip")
    assert [len(w) for w in p] == [per_host] * topo.hosts
    hosts = ADDRESSES[: topo.hosts] if topo.multi_host else ["localhost"]
    addresses = ",".join(f"{h}:{8070 + i}" for h in hosts for i in range(per_host))
    for w, specs in enumerate(p):
        for i, s in enumerate(specs):
            want = {
                "TPU_WORKER_HOSTNAMES": ",".join(ADDRESSES[: topo.hosts]),
                "TORCH_TPU_TOPOLOGY": topology,
                "TORCH_TPU_XPROF_SESSION_ID": "job-1",
                "TORCH_TPU_SLICEBUILDER_ADDRESSES": addresses,
                "TORCHELASTIC_RUN_ID": "job-1",
                "TPURUN_CORE": str(i),
                "RANK": str(w * per_host + i),
                "WORLD_SIZE": str(topo.hosts * per_host),
                "LOCAL_RANK": str(i),
                "LOCAL_WORLD_SIZE": str(per_host),
            }
            if topo.multi_host:
                want.update(NNODES=str(topo.hosts), NODE_RANK=str(w))
            assert {k: v for k, v in s.env.items() if k not in TORCHTPU_JOB} == want


def test_torchtpu_ranks_hosts_across_slices_and_runs_every_device() -> None:
    p = plan("v5p-16", "torchtpu", launch="host", worker_addresses=ADDRESSES[:4], slice_size=2)
    assert [s.env["NODE_RANK"] for (s,) in p] == ["0", "1", "2", "3"]
    assert {s.env["NNODES"] for (s,) in p} == {"4"} and {s.env["TORCH_TPU_TOPOLOGY"] for (s,) in p} == {"2,2,2"}
    assert [s.env["MEGASCALE_SLICE_ID"] for (s,) in p] == ["0", "0", "1", "1"]
    for kw in ({"cores": 1}, {"core": 2}):
        with pytest.raises(UsageError, match="TorchTPU runs every device of a host"):
            plan("v5p-8", "torchtpu", **kw)
    with pytest.raises(UsageError, match="needs a TPU accelerator type"):
        plan(None, "torchtpu")
    assert pick_launch(None, "torchtpu")[0] == "host"
