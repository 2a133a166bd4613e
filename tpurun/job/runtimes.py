"""Each runtime's variables for one process: PJRT's (a host launch's, or torch_xla's per-chip topology made
explicit), XRT's (what xla_dist exported), TorchTPU's, and jax's coordinator where there is no TPU. Pure functions
over a `Topology`, put together with the job's own variables by env_contract.plan_job; the sources of every
variable are in docs/train.md."""

from __future__ import annotations

from tpurun.topology import Topology, axes
from tpurun.worker.protocol import Launch, Word


class Runtime(Word):
    """The runtime a job asks for (--runtime): `auto` picks from what a worker has."""

    auto = "auto"
    pjrt = "pjrt"
    xrt = "xrt"
    cpu = "cpu"
    torchtpu = "torchtpu"  # TorchTPU (torch_tpu), PyTorch's native TPU backend


class Precision(Word):
    """--precision: bf16 sets XLA_USE_BF16=1."""

    fp32 = "32"
    bf16 = "bf16"


# xmp.spawn's base port for per-process TPU clients (tpu.configure_topology(base_port=8476)).
PJRT_BASE_PORT = 8476
# jax.distributed's coordinator port on Cloud TPU (jax/_src/clusters/cloud_tpu_cluster.py).
JAX_COORDINATOR_PORT = 8482
# xla_dist (torch_xla ≤ 2.0): XRT local service, mesh service, mesh controller, TPU Node port.
XRT_SERVER_PORT = 51011
XRT_MESH_SERVICE_PORT = 8477
XRT_MESH_CONTROLLER_PORT = 8476
XRT_TPU_NODE_PORT = 8470
# TorchTPU's slice-builder ports: one per device of a host from this one (set_tpu_launch_env's
# TORCH_TPU_BASE_PORT default, torch_tpu/_internal/distributed/distributed.py).
TORCH_TPU_BASE_PORT = 8070


def jax_cpu_env(coordinator: str, process_id: int, num_processes: int) -> dict[str, str]:
    """Where there is no TPU, what `jax.distributed.initialize()` cannot find for itself: the coordinator
    (jax reads JAX_COORDINATOR_ADDRESS), the process count and this process's id (read by the cluster
    tpurun's hook adds to jax's auto-detection; scripts may pass them on themselves)."""
    return {
        "JAX_COORDINATOR_ADDRESS": f"{coordinator}:{JAX_COORDINATOR_PORT}",
        "JAX_NUM_PROCESSES": str(num_processes),
        "JAX_PROCESS_ID": str(process_id),
    }


def runtime_env(
    *,
    runtime: Runtime,
    launch: Launch,
    topology: Topology | None,
    worker: int,
    worker_addresses: list[str],
    local_rank: int,
    local_world: int,
    single_chip: int | None,
    job_id: str,
    tpu_ip: str | None,
) -> dict[str, str]:
    """What one process needs of its runtime: PJRT's variables (per host or per chip), XRT's, or CPU's."""
    env: dict[str, str] = {}
    if runtime is Runtime.torchtpu:
        return env  # plan_job: TorchTPU's variables span every slice (torchtpu_env)
    if runtime is Runtime.pjrt:
        assert topology is not None
        if launch is Launch.host:
            env.update(_pjrt_host_env(single_chip))
        else:
            env.update(
                _pjrt_env(
                    topology=topology,
                    worker=worker,
                    worker_addresses=worker_addresses,
                    local_rank=local_rank,
                    local_world=local_world,
                    single_chip=single_chip,
                )
            )
            # torch_xla.launch(fn) and the xla:// rendezvous then run fn(LOCAL_RANK) in this process
            # (torchrun mode) instead of spawning one process per chip a second time.
            env["TORCHELASTIC_RUN_ID"] = job_id
    elif runtime is Runtime.xrt:
        assert topology is not None
        env.update(_xrt_env(topology=topology, worker=worker, worker_addresses=worker_addresses, tpu_ip=tpu_ip))
    else:
        env.update({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"})
        if launch is Launch.chip:
            env["TORCHELASTIC_RUN_ID"] = job_id
    return env


def _pjrt_host_env(single_chip: int | None) -> dict[str, str]:
    """A host launch on a TPU: what the Cloud TPU pod recipe sets (PJRT_DEVICE=TPU), nothing that would
    override what torch_xla reads from the VM itself (PCI chips, the `tpu-env` metadata); for one chip,
    the variables of torch_xla's one-chip topology, so the script's spawner makes one process there."""
    env = {"PJRT_DEVICE": "TPU"}
    if single_chip is not None:
        env.update(
            {
                "TPU_VISIBLE_CHIPS": str(single_chip),
                "TPU_PROCESS_BOUNDS": "1,1,1",
                "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
            }
        )
    return env


def _mul_bounds(a: str, b: str) -> str:
    return ",".join(str(int(x) * int(y)) for x, y in zip(a.split(","), b.split(","), strict=True))


def _process_bounds(topology: Topology) -> str:
    """TPU_PROCESS_BOUNDS at one process per chip, as torch_xla's configure_topology makes it: host bounds ×
    chips-per-host bounds (v2/v3: chips per host 2,2,1), and on TPU7x a fourth bound of 2, its TensorCores
    per chip (pytorch/xla #9586)."""
    return _mul_bounds(topology.host_bounds, topology.chips_per_host_bounds) + _tensorcore_bound(topology)


def _tensorcore_bound(topology: Topology) -> str:
    """The fourth bound both torch_xla and TorchTPU add on TPU7x: its TensorCores per chip (",2"), else none."""
    return f",{topology.cores_per_chip}" if topology.generation == "tpu7x" else ""


def _pjrt_env(
    *,
    topology: Topology,
    worker: int,
    worker_addresses: list[str],
    local_rank: int,
    local_world: int,
    single_chip: int | None,
) -> dict[str, str]:
    """What xmp.spawn's tpu.configure_topology / configure_one_chip_topology set, made explicit."""
    env = {
        "PJRT_DEVICE": "TPU",
        # Topology from these variables rather than the metadata server (tpu.get_tpu_env): the same
        # answer on a real TPU VM, and the only one where no metadata server answers.
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": topology.name,
        "TPU_WORKER_ID": str(worker),
        "TPU_WORKER_HOSTNAMES": ",".join(worker_addresses),
    }
    if single_chip is not None:
        env.update(
            {
                "TPU_PROCESS_BOUNDS": "1,1,1",
                "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
                "TPU_VISIBLE_CHIPS": str(single_chip),
                "PJRT_LOCAL_PROCESS_RANK": "0",
                "PJRT_LOCAL_PROCESS_COUNT": "1",
            }
        )
        return env
    # tpu.get_worker_ips(): a single host is always 'localhost'.
    ips = worker_addresses if len(worker_addresses) > 1 else ["localhost"]
    ports = [PJRT_BASE_PORT + i for i in range(local_world)]
    env.update(
        {
            "TPU_PROCESS_BOUNDS": _process_bounds(topology),
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
            "TPU_VISIBLE_CHIPS": str(local_rank),
            "CLOUD_TPU_TASK_ID": str(worker * local_world + local_rank),
            "TPU_PROCESS_ADDRESSES": ",".join(f"{ip}:{port}" for ip in ips for port in ports),
            "TPU_PROCESS_PORT": str(ports[local_rank]),
            "PJRT_LOCAL_PROCESS_RANK": str(local_rank),
            "PJRT_LOCAL_PROCESS_COUNT": str(local_world),
        }
    )
    return env


def torchtpu_topology(topology: Topology) -> str:
    """TORCH_TPU_TOPOLOGY of a slice: its chips along x,y,z, and on TPU7x a fourth bound of 2, its TensorCores
    per chip, as TorchTPU's own table of one host's topologies writes them (torch_tpu/_internal/utils/hardware.py)."""
    return ",".join(str(d) for d in axes(topology.topology)) + _tensorcore_bound(topology)


def torchtpu_env(
    *, topology: Topology, worker: int, worker_addresses: list[str], launch: Launch, local_world: int, job_id: str
) -> dict[str, str]:
    """What TorchTPU's set_tpu_launch_env reads (host launch: the script calls it) or derives (chip launch:
    every process gets what it would have derived in a parent), from tpurun's numbering of the hosts.

    A host's NODE_RANK is its worker number: TorchTPU ranks a slice's hosts by their chips' coordinates,
    Z-major, then Y, then X, which is the worker order when the runtime lays the hosts out X-fastest over
    TPU_HOST_BOUNDS (docs/train.md). Set here, it spares set_tpu_launch_env the child process that would
    start the TPU client to read the coordinates, and holds across slices, where coordinates repeat."""
    hosts = len(worker_addresses)
    env = {
        "TPU_WORKER_HOSTNAMES": ",".join(worker_addresses),
        # one profiling session for the whole job (each host's parent would otherwise take its own clock)
        "TORCH_TPU_XPROF_SESSION_ID": job_id,
    }
    if hosts > 1 or launch is Launch.chip:
        env["TORCH_TPU_TOPOLOGY"] = torchtpu_topology(topology)
    if hosts > 1:
        env.update({"NNODES": str(hosts), "NODE_RANK": str(worker)})
    if launch is Launch.chip:
        where = worker_addresses if hosts > 1 else ["localhost"]
        env["TORCH_TPU_SLICEBUILDER_ADDRESSES"] = ",".join(
            f"{host}:{TORCH_TPU_BASE_PORT + i}" for host in where for i in range(local_world)
        )
        env["TORCHELASTIC_RUN_ID"] = job_id
    return env


def _xrt_env(*, topology: Topology, worker: int, worker_addresses: list[str], tpu_ip: str | None) -> dict[str, str]:
    """What torch_xla.distributed.xla_dist (torch_xla 2.0) exported on each worker, or the one-VM configs."""
    devices = str(topology.pjrt_devices_per_host)  # 8 on v2/v3, 4 on v4 (one per megacore)
    if tpu_ip is not None:
        # Old TPU Node architecture: a user VM drives the TPU's own host over gRPC.
        return {"XRT_TPU_CONFIG": f"tpu_worker;0;{tpu_ip}:{XRT_TPU_NODE_PORT}", "TPU_NUM_DEVICES": devices}
    if not topology.multi_host:
        # One TPU VM: the client starts its own local XRT service; no mesh, no xrt_run_server.
        return {"XRT_TPU_CONFIG": f"localservice;0;localhost:{XRT_SERVER_PORT}", "TPU_NUM_DEVICES": devices}
    w0 = worker_addresses[0]
    env = {
        "XRT_LOCAL_WORKER": f"c_localservice:{worker}",
        "XRT_MESH_SERVICE_ADDRESS": f"{w0}:{XRT_MESH_SERVICE_PORT}",
        "XRT_SHARD_WORLD_SIZE": str(len(worker_addresses)),
        "XRT_SHARD_ORDINAL": str(worker),
        "TPU_NUM_DEVICES": devices,
        "XLA_EMIT_STEPLOG": "1",
        "TPU_CHIPS_PER_HOST_BOUNDS": topology.chips_per_host_bounds,
        "TPUVM_MODE": "1",
        "CLOUD_TPU_TASK_ID": str(worker),
        "TPU_HOST_BOUNDS": topology.host_bounds,
        "TPU_MESH_CONTROLLER_ADDRESS": f"{w0}:{XRT_MESH_CONTROLLER_PORT}",
        "TPU_MESH_CONTROLLER_PORT": str(XRT_MESH_CONTROLLER_PORT),
    }
    if worker == 0:
        env["XRT_TPU_CONFIG"] = "|".join(
            f"c_localservice;{i};{ip}:{XRT_SERVER_PORT}" for i, ip in enumerate(worker_addresses)
        )
    return env
