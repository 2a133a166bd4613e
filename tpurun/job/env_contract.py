"""The env contract of `tpurun train`: which processes run on which worker and what each one sees.

Pure functions over a `Topology` (no I/O), so tpurun's own tables are checked by unit tests and printed
by `--dry-run`; what torch_xla, Lightning and JAX then do with them is checked by running their code on
emulated workers (tests/integration/test_launch.py). Two launch models (docs/train.md):

* host: one process per worker runs the user's command, as xla_dist and the Cloud TPU pod recipe do;
  the script's own spawner (xmp.spawn, torch_xla.launch, Lightning, SPMD, JAX) makes the chip processes.
* chip: one process per chip (per core on `cpu`), with torchrun's variables, for torchrun-style scripts.

Sources of every variable are in docs/train.md: pytorch/xla `torch_xla/_internal/tpu.py` (xmp.spawn's
`configure_topology`), `torch_xla/_internal/pjrt.py` and `torch_xla/distributed/xla_dist.py` (<= 2.0).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from tpurun.errors import UsageError  # a stdlib-only leaf; gives the CLI exit code 2 for bad --cores/--core
from tpurun.naming import worker_name
from tpurun.topology import MEGASCALE_PORT, Topology, axes
from tpurun.worker.protocol import HOST, Launch  # the agent's words for how processes are made and where filed


class Runtime(str, Enum):
    """The runtime a job asks for (--runtime): `auto` picks from what a worker has."""

    auto = "auto"
    pjrt = "pjrt"
    xrt = "xrt"
    cpu = "cpu"
    torchtpu = "torchtpu"  # TorchTPU (torch_tpu), PyTorch's native TPU backend


RUNTIMES = tuple(m.value for m in Runtime if m is not Runtime.auto)


class Precision(str, Enum):
    """--precision: bf16 sets XLA_USE_BF16=1."""

    fp32 = "32"
    bf16 = "bf16"


PRECISIONS = tuple(m.value for m in Precision)


LAUNCHES = tuple(m.value for m in Launch)

# xmp.spawn's base port for per-process TPU clients (tpu.configure_topology(base_port=8476)).
PJRT_BASE_PORT = 8476
# jax.distributed's coordinator port on Cloud TPU (jax/_src/clusters/cloud_tpu_cluster.py).
JAX_COORDINATOR_PORT = 8482
# xla_dist (torch_xla ≤ 2.0): XRT local service, mesh service, mesh controller, TPU Node port.
XRT_SERVER_PORT = 51011
XRT_MESH_SERVICE_PORT = 8477
XRT_MESH_CONTROLLER_PORT = 8476
XRT_TPU_NODE_PORT = 8470
# XRT (torch_xla ≤ 2.0) predates v5e/v5p/v6e, which need torch_xla ≥ 2.1 (PJRT only).
XRT_GENERATIONS = ("v2", "v3", "v4")
# TorchTPU's slice-builder ports: one per device of a host from this one (set_tpu_launch_env's
# TORCH_TPU_BASE_PORT default, torch_tpu/_internal/distributed/distributed.py).
TORCH_TPU_BASE_PORT = 8070


@dataclass(frozen=True)
class CoreSpec:
    """One process tpurun starts on one worker: its place in the job, its environment and command."""

    worker: int
    core: int  # index on its worker (log file w<worker>-c<core>.log, TPURUN_CORE), or HOST (w<worker>.log)
    local_rank: int
    rank: int
    env: dict[str, str]
    argv: list[str]


def _pci_chips(topology: Topology) -> int:
    """What torch_xla counts as a host's chips (its PCI functions, which TPU_VISIBLE_CHIPS indexes): the
    chips, but on TPU7x each of a chip's two chiplets."""
    return topology.chips_per_host * topology.pci_functions_per_chip


def _devices_per_chip(topology: Topology) -> int:
    # v2/v3: 2 PJRT devices (TensorCores) per chip; v4/v5p megacore, v5e/v6e and a TPU7x chiplet: 1.
    return topology.pjrt_devices_per_host // _pci_chips(topology)


def explain_core(topology: Topology, core: int) -> str:
    """What `--core K` runs under PJRT on TOPOLOGY, in one sentence for the user."""
    per_chip = _devices_per_chip(topology)
    n = topology.pjrt_devices_per_host
    if not 0 <= core < n:
        raise UsageError(
            f"--core {core} is out of range: a {topology.name} host has {n} PJRT devices (cores 0-{n - 1})"
        )
    chip = core // per_chip
    gen = topology.generation
    if per_chip > 1:
        first = chip * per_chip
        last = first + per_chip - 1
        return (
            f"core {core} is TensorCore {core % per_chip} of chip {chip}; PJRT cannot select one core of a "
            f"{gen} chip, so chip {chip} (cores {first}-{last}) runs as one process"
        )
    if topology.pci_functions_per_chip > 1:
        return (
            f"core {core} is TensorCore {core % topology.pci_functions_per_chip} of chip "
            f"{core // topology.pci_functions_per_chip}; a {gen} chip shows each TensorCore as a device of its "
            "own, so it runs as one process"
        )
    if topology.cores_per_chip > 1:
        return (
            f"core {core} is chip {chip}: a {gen} chip's {topology.cores_per_chip} TensorCores form one "
            f"megacore PJRT device, so chip {chip} runs as one process"
        )
    return f"core {core} is chip {chip} ({gen} has one TensorCore per chip); it runs as one process"


def _job_env(
    *, job_id: str, worker: int, num_workers: int, launch: str, master_addr: str, master_port: int, restart_count: int
) -> dict[str, str]:
    """What every process tpurun starts sees, in either launch model."""
    return {
        "TPURUN_JOB_ID": job_id,
        "TPURUN_WORKER_ID": str(worker),
        "TPURUN_NUM_WORKERS": str(num_workers),
        "TPURUN_LAUNCH": launch,
        "TPURUN_RESTART_COUNT": str(restart_count),
        # worker 0: what torch_xla's xla:// rendezvous and torch.distributed's env:// use
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        # Lines must reach the log as they are printed, not when a block buffer fills.
        "PYTHONUNBUFFERED": "1",
    }


def _multislice_env(coordinator: str, slice_id: int, num_slices: int) -> dict[str, str]:
    """What joins the slices of a multislice TPU: the values Cloud TPU puts in a multislice node's
    `tpu-env` (coordinator = slice 0's first worker), and tpurun's own."""
    return {
        "MEGASCALE_COORDINATOR_ADDRESS": f"{coordinator}:{MEGASCALE_PORT}",
        "MEGASCALE_NUM_SLICES": str(num_slices),
        "MEGASCALE_SLICE_ID": str(slice_id),
        "MEGASCALE_PORT": str(MEGASCALE_PORT),
        "TPURUN_SLICE_ID": str(slice_id),
        "TPURUN_NUM_SLICES": str(num_slices),
    }


_IMPORT_RE = re.compile(r"^\s*(?:import|from)\s+(jax|torch_xla|torch|lightning|pytorch_lightning)\b", re.MULTILINE)


def script_framework(source: str) -> str:
    """ "jax" for a script that imports JAX and no torch, else "torch" (what its notes talk about)."""
    found = set(_IMPORT_RE.findall(source))
    return "jax" if "jax" in found and not found - {"jax"} else "torch"


def _jax_cpu_env(coordinator: str, process_id: int, num_processes: int) -> dict[str, str]:
    """Where there is no TPU, what `jax.distributed.initialize()` cannot find for itself: the coordinator
    (jax reads JAX_COORDINATOR_ADDRESS), the process count and this process's id (read by the cluster
    tpurun's hook adds to jax's auto-detection; scripts may pass them on themselves)."""
    return {
        "JAX_COORDINATOR_ADDRESS": f"{coordinator}:{JAX_COORDINATOR_PORT}",
        "JAX_NUM_PROCESSES": str(num_processes),
        "JAX_PROCESS_ID": str(process_id),
    }


def _torchrun_env(*, core: int, rank: int, world_size: int, local_rank: int, local_world_size: int) -> dict[str, str]:
    """torchrun's per-process variables (chip launch only: in a host launch the spawner numbers its children)."""
    return {
        "TPURUN_CORE": str(core),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
    }


def _mul_bounds(a: str, b: str) -> str:
    return ",".join(str(int(x) * int(y)) for x, y in zip(a.split(","), b.split(","), strict=True))


def pick_launch(requested: str | None, runtime: str) -> tuple[str, str]:
    """(launch, reason): REQUESTED, or the default for RUNTIME."""
    if requested is None:
        if runtime == "torchtpu":
            return "host", (
                "launch host, the default on torchtpu: one process per worker; the script calls "
                "set_tpu_launch_env and its launcher (torch.multiprocessing.spawn, torchrun) makes one process per device"
            )
        if runtime == "cpu":
            return "chip", (
                "launch chip, the default on the cpu runtime: with no chips for a script's spawner to find, "
                "tpurun starts one process per core"
            )
        return "host", (
            f"launch host, the default on {runtime}: one process per worker; the script's spawner "
            "(xmp.spawn, torch_xla.launch, Lightning) makes one process per chip, SPMD and JAX drive the chips from it"
        )
    if requested not in LAUNCHES:
        raise UsageError(f"--launch {requested}: use host or chip")
    if requested == "chip" and runtime == "xrt":
        raise UsageError("--launch chip: XRT runs one process per host, as xla_dist did; use --launch host")
    if requested == "chip" and runtime == "torchtpu":
        return "chip", (
            "launch chip, as requested: one process per device with torchrun's variables and what "
            "set_tpu_launch_env would derive"
        )
    if requested == "chip":
        return "chip", "launch chip, as requested: one process per chip with torchrun's variables"
    return "host", "launch host, as requested: one process per worker; the script's spawner makes the chip processes"


# A one-host pod on this machine stands for one TPU host: at most as many CPU processes as the largest host
# has PJRT devices (v2/v3: 4 chips x 2 TensorCores), unless oversubscribed on purpose.
LOCAL_MAX_PROCESSES = 8


def _slots(
    *,
    runtime: str,
    launch: str,
    topology: Topology | None,
    cores: int | None,
    core: int | None,
    oversubscribe: bool = False,
) -> list[int]:
    """The core indices (process slots) to start on every worker: [HOST] for a host launch."""
    if cores is not None and core is not None:
        raise UsageError("--cores and --core exclude each other: give one")
    if cores is not None and cores < 1:
        raise UsageError(f"--cores {cores}: give a positive number")
    if runtime == "cpu":
        if core is not None and core < 0:
            raise UsageError(f"--core {core}: give a core index ≥ 0")
        if launch == "host":
            if core is not None or cores not in (None, 1):
                raise UsageError(
                    "--cores/--core with --launch host on the cpu runtime: torch_xla's spawner makes one process "
                    "on CPU; use --launch chip to run N processes"
                )
            return [HOST]
        limit = topology.pjrt_devices_per_host if topology else LOCAL_MAX_PROCESSES
        wanted = (core + 1) if core is not None else cores
        if wanted is not None and wanted > limit and not oversubscribe:
            host = (
                f"a {topology.name} host has {limit} PJRT devices"
                if topology
                else (f"a one-host pod stands for one TPU host, at most {limit} devices")
            )
            what = f"--core {core}" if core is not None else f"--cores {cores}"
            raise UsageError(
                f"{what}: {host}, and each CPU process stands for one; --oversubscribe starts more on purpose"
            )
        if core is not None:
            return [core]
        n = cores if cores is not None else (topology.pjrt_devices_per_host if topology else 1)
        return list(range(n))
    assert topology is not None
    if runtime == "torchtpu":
        devices = topology.pjrt_devices_per_host
        if core is not None or cores not in (None, devices):
            raise UsageError(
                f"--cores/--core with --runtime torchtpu: TorchTPU runs every device of a host ({devices} on "
                f"{topology.name}); drop the option"
            )
        return [HOST] if launch == "host" else list(range(devices))
    if runtime == "xrt":
        # xla_dist ran one process per host; the script's own xmp.spawn(nprocs=1|None) picks the cores.
        if core is not None:
            raise UsageError(
                "--core is not available with --runtime xrt: XRT runs one process per host and the script's "
                "xmp.spawn picks the cores (nprocs=1 runs only the first)"
            )
        if cores not in (None, 1, topology.cores_per_host, topology.pjrt_devices_per_host):
            raise UsageError(f"--cores {cores}: with --runtime xrt give 1 or all ({topology.cores_per_host})")
        return [HOST]
    # pjrt: every chip (one process per chip, made by tpurun or by the script's spawner), or one chip.
    all_values = {topology.cores_per_host, topology.pjrt_devices_per_host, topology.chips_per_host}
    single = core is not None or cores == 1
    if single and topology.multi_host:
        raise UsageError(
            f"--cores 1 / --core K run one chip of a single-host TPU; {topology.name} is a {topology.hosts}-host "
            "slice whose chips must all take part: drop the option"
        )
    if core is not None:
        explain_core(topology, core)  # validates the range
    if cores is not None and cores != 1 and cores not in all_values:
        raise UsageError(
            f"--cores {cores}: a {topology.name} host runs 1 or all of its cores "
            f"({topology.cores_per_host} cores = {topology.chips_per_host} chips, one process per chip)"
        )
    if launch == "host":
        return [HOST]
    if core is not None:
        return [core]
    if cores == 1:
        return [0]
    return list(range(_pci_chips(topology)))


def _single_chip(topology: Topology, cores: int | None, core: int | None) -> int | None:
    """The chip `--cores 1` / `--core K` runs on, or None for every chip."""
    if core is not None:
        return core // _devices_per_chip(topology)
    return 0 if cores == 1 else None


def plan_job(
    *,
    job_id: str,
    topology: Topology | None,
    runtime: str,
    launch: str,
    worker_addresses: list[str],
    cores: int | None,
    core: int | None,
    script: str,
    args: list[str],
    slice_size: int | None = None,
    python: str = "python3",
    master_port: int = 12355,
    extra_env: dict[str, str] | None = None,
    precision: str = "32",
    restart_count: int = 0,
    tpu_ip: str | None = None,
    oversubscribe: bool = False,
    slice_metadata: bool = True,
) -> list[list[CoreSpec]]:
    """Every process tpurun starts for the job: one list per worker, one CoreSpec per process on it.

    `launch` is "host" (one process per worker, core HOST) or "chip" (one per chip, or per core on
    `cpu`). `cores`: None = every chip of a host; 1 = one. `core`: one specific core index (pjrt: a PJRT
    device index of the host, mapped to its chip, see explain_core). In a chip launch ranks are global
    process indices (torchrun's meaning), worker-major. `slice_size`: hosts per slice of a multislice TPU
    (WORKER_ADDRESSES slice-major): each slice gets its own TPU variables, every process the MEGASCALE
    ones that join the slices. `slice_metadata`: whether the VMs' metadata server tells the runtimes their
    place in the slice (a Cloud TPU API node's does, a Compute Engine VM's does not: then every process is
    given those values, see _slice_env).
    """
    num_workers = len(worker_addresses)
    _check_job(runtime, launch, precision, topology, num_workers, tpu_ip, slice_size)
    size = slice_size or num_workers
    slots = _slots(
        runtime=runtime, launch=launch, topology=topology, cores=cores, core=core, oversubscribe=oversubscribe
    )
    local_world = len(slots)
    world_size = num_workers * local_world
    argv = [python, script, *args]
    single_chip = _single_chip(topology, cores, core) if runtime == "pjrt" and topology else None
    plan: list[list[CoreSpec]] = []
    for worker in range(num_workers):
        specs: list[CoreSpec] = []
        slice_id, host = divmod(worker, size)
        in_slice = worker_addresses[slice_id * size : (slice_id + 1) * size]
        for local_rank, slot in enumerate(slots):
            rank = worker * local_world + local_rank
            env = _job_env(
                job_id=job_id,
                worker=worker,
                num_workers=num_workers,
                launch=launch,
                master_addr=worker_addresses[0],
                master_port=master_port,
                restart_count=restart_count,
            )
            if slice_size is not None:
                env.update(_multislice_env(worker_addresses[0], slice_id, num_workers // size))
            elif runtime == "pjrt" and not slice_metadata:
                # one slice: jax looks these up in the environment, then in `tpu-env` (six tries, 3 s, each)
                env.update({"MEGASCALE_NUM_SLICES": "1", "MEGASCALE_SLICE_ID": "0"})
            if launch == "chip":
                env.update(
                    _torchrun_env(
                        core=slot, rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world
                    )
                )
            if runtime == "cpu":
                env.update(_jax_cpu_env(worker_addresses[0], rank, world_size))
            if runtime == "torchtpu":
                assert topology is not None
                # one rendezvous over every host, of every slice: global worker numbers and addresses
                env.update(
                    _torchtpu_env(
                        topology=topology, worker=worker, worker_addresses=worker_addresses, launch=launch,
                        local_world=local_world, job_id=job_id,
                    )
                )  # fmt: skip
            env.update(
                _runtime_env(
                    runtime=runtime,
                    launch=launch,
                    topology=topology,
                    worker=host,
                    worker_addresses=in_slice,
                    local_rank=local_rank,
                    local_world=local_world,
                    single_chip=single_chip,
                    job_id=job_id,
                    tpu_ip=tpu_ip,
                    slice_metadata=slice_metadata,
                )
            )
            if precision == "bf16":
                env["XLA_USE_BF16"] = "1"
            env.update(extra_env or {})  # last: the user's values win, as with xmp.spawn's setdefault
            specs.append(CoreSpec(worker=worker, core=slot, local_rank=local_rank, rank=rank, env=env, argv=list(argv)))
        plan.append(specs)
    return plan


def _check_job(
    runtime: str,
    launch: str,
    precision: str,
    topology: Topology | None,
    num_workers: int,
    tpu_ip: str | None,
    slice_size: int | None = None,
) -> None:
    """Refuse a combination that cannot run, with the reason."""
    if slice_size is not None and runtime == "xrt":
        raise UsageError("--runtime xrt: XRT predates multislice; use --runtime pjrt")
    if slice_size is not None and (slice_size < 1 or num_workers % slice_size):
        raise UsageError(f"{num_workers} workers cannot form slices of {slice_size}")
    if runtime not in RUNTIMES:
        raise UsageError(f"unknown runtime '{runtime}': use one of auto, {', '.join(RUNTIMES)}")
    if launch not in LAUNCHES:
        raise UsageError(f"--launch {launch}: use host or chip")
    if precision not in PRECISIONS:
        raise UsageError(f"--precision {precision}: use {' or '.join(PRECISIONS)}")
    if not num_workers:
        raise UsageError("no workers to run on")
    if runtime in ("pjrt", "xrt", "torchtpu"):
        if topology is None:
            raise UsageError(f"--runtime {runtime} needs a TPU accelerator type; use --runtime cpu on this machine")
        if tpu_ip is None and topology.hosts != (slice_size or num_workers):
            raise UsageError(
                f"{topology.name} has {topology.hosts} hosts but {slice_size or num_workers} worker addresses were "
                "given" + (" per slice" if slice_size else "")
            )
    if runtime == "xrt" and topology is not None and topology.generation not in XRT_GENERATIONS:
        raise UsageError(
            f"--runtime xrt: XRT was removed after torch_xla 2.0 and never ran on {topology.generation}; "
            "use --runtime pjrt"
        )
    if runtime == "xrt" and launch == "chip":
        raise UsageError("--launch chip: XRT runs one process per host, as xla_dist did; use --launch host")
    if tpu_ip is not None and (runtime != "xrt" or num_workers != 1):
        raise UsageError("--tpu-ip (the old TPU Node architecture) works only with --runtime xrt and one client VM")


def _runtime_env(
    *,
    runtime: str,
    launch: str,
    topology: Topology | None,
    worker: int,
    worker_addresses: list[str],
    local_rank: int,
    local_world: int,
    single_chip: int | None,
    job_id: str,
    tpu_ip: str | None,
    slice_metadata: bool = True,
) -> dict[str, str]:
    """What one process needs of its runtime: PJRT's variables (per host or per chip), XRT's, or CPU's."""
    env: dict[str, str] = {}
    if runtime == "torchtpu":
        return env  # plan_job: TorchTPU's variables span every slice (_torchtpu_env)
    if runtime == "pjrt":
        assert topology is not None
        if launch == "host":
            if not slice_metadata:
                env.update(_slice_env(topology, worker, worker_addresses))
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
    elif runtime == "xrt":
        assert topology is not None
        env.update(_xrt_env(topology=topology, worker=worker, worker_addresses=worker_addresses, tpu_ip=tpu_ip))
    else:
        env.update({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"})
        if launch == "chip":
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


def _slice_env(topology: Topology, worker: int, worker_addresses: list[str]) -> dict[str, str]:
    """A host launch on VMs whose metadata server does not describe their slice (Compute Engine's): what
    the runtimes would have read from a Cloud TPU API node's `tpu-env`, `agent-worker-number` and
    `worker-network-endpoints`, under the names they read from the environment instead (the ones GKE gives
    a TPU container). Host-level names only: the script's spawner still derives each chip process's own
    (xmp.spawn's configure_topology sets TPU_PROCESS_BOUNDS and the rest only where they are unset)."""
    return {
        # torch_xla reads the variables below instead of the metadata server (tpu.build_tpu_env_from_vars),
        # and jax's cluster detection skips its metadata cluster (GceTpuCluster) for the env one (GkeTpuCluster)
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": topology.name,
        "TPU_WORKER_ID": str(worker),
        "TPU_WORKER_HOSTNAMES": ",".join(worker_addresses),
        "TPU_HOST_BOUNDS": topology.host_bounds,
        "TPU_CHIPS_PER_HOST_BOUNDS": topology.chips_per_host_bounds,
        "TPU_TOPOLOGY": topology.topology,
    }


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


def _torchtpu_env(
    *, topology: Topology, worker: int, worker_addresses: list[str], launch: str, local_world: int, job_id: str
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
    if hosts > 1 or launch == "chip":
        env["TORCH_TPU_TOPOLOGY"] = torchtpu_topology(topology)
    if hosts > 1:
        env.update({"NNODES": str(hosts), "NODE_RANK": str(worker)})
    if launch == "chip":
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


def pre_commands(topology: Topology | None, runtime: str, worker: int, python: str = "python3") -> list[list[str]]:
    """Commands the agent runs on WORKER before the cores (xla_dist started the XRT server on each TPU VM
    of a pod; on one VM the client's localservice config starts its own)."""
    del worker  # every worker of a pod runs the same server
    if runtime == "xrt" and topology is not None and topology.multi_host:
        return [[python, "-m", "torch_xla.core.xrt_run_server", "--port", str(XRT_SERVER_PORT)]]
    return []


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        m = re.match(r"\d+", piece)
        parts.append(int(m.group()) if m else 0)
    return tuple(parts)


def pick_runtime(requested: str, probe: dict[str, object]) -> tuple[str, str]:
    """(runtime, reason): REQUESTED unless it is `auto`, which picks from what PROBE_SCRIPT saw on a worker."""
    version = probe.get("torch_xla_version")
    tpu = bool(probe.get("libtpu_installed")) and bool(probe.get("device_files_present"))
    if requested in RUNTIMES:
        return requested, f"--runtime {requested} was requested"
    if requested != "auto":
        raise UsageError(f"unknown runtime '{requested}': use auto, {', '.join(RUNTIMES)}")
    if not tpu:
        missing = []
        if not probe.get("libtpu_installed"):
            missing.append("libtpu is not installed")
        if not probe.get("device_files_present"):
            missing.append("no TPU device files (/dev/accel*, /dev/vfio/*)")
        return "cpu", "auto picked cpu: " + " and ".join(missing)
    torch_tpu = probe.get("torch_tpu_version")
    if (not isinstance(version, str) or not version) and isinstance(torch_tpu, str) and torch_tpu:
        return "torchtpu", f"auto picked torchtpu: libtpu and TPU device files present, torch_tpu {torch_tpu}"
    if not isinstance(version, str) or not version:
        return "cpu", "auto picked cpu: TPU present but neither torch_xla nor torch_tpu is installed"
    if _version_tuple(version) < (2, 1):
        return "xrt", f"auto picked xrt: torch_xla {version} < 2.1 (XRT era) and a TPU is present"
    return "pjrt", f"auto picked pjrt: libtpu and TPU device files present, torch_xla {version}"


# Runs on a worker with its own python3 (any 3.8+); prints one JSON object for pick_runtime and doctor.
PROBE_SCRIPT = r"""
import glob, json, os, sys
try:
    import importlib.util as iu
    import importlib.metadata as md
except Exception:
    iu = md = None

def version(name):
    try:
        return md.version(name) if md else None
    except Exception:
        return None

libtpu = None
try:
    spec = iu.find_spec("libtpu") if iu else None
    if spec is not None:
        libtpu = (list(spec.submodule_search_locations or []) or [spec.origin])[0]
except Exception:
    pass
if libtpu is None:
    candidates = ["/lib/libtpu.so", "/usr/lib/libtpu.so", "/usr/local/lib/libtpu.so"]
    for base in sys.path:
        if base and os.path.isdir(base):
            candidates += glob.glob(os.path.join(base, "libtpu*", "libtpu*.so"))
            candidates += glob.glob(os.path.join(base, "libtpu*.so"))
    for c in candidates:
        if os.path.exists(c):
            libtpu = c
            break
devices = sorted(glob.glob("/dev/accel*") + [p for p in glob.glob("/dev/vfio/*") if p != "/dev/vfio/vfio"])
print(json.dumps({
    "libtpu_installed": libtpu is not None,
    "libtpu_path": libtpu,
    "device_files_present": bool(devices),
    "device_files": devices,
    "torch_xla_version": version("torch_xla") or version("torch-xla"),
    "torch_tpu_version": version("torch_tpu") or version("torch-tpu"),
    "torch_version": version("torch"),
    "python": sys.executable,
    "python_version": "%d.%d.%d" % sys.version_info[:3],
}))
"""


def process_name(worker: int, core: int, name: str | None = None) -> str:
    """wN/cM for a chip (or core) process, wN for a host launch's own process: its lines are tagged [name].
    NAME replaces wN (sS/wN in a multislice TPU)."""
    name = name or worker_name(worker)
    return name if core == HOST else f"{name}/c{core}"
