"""The env contract of `tpurun train`: which processes run on which worker and what each one sees.

Pure functions over a `Topology` (no I/O), so tpurun's own tables are checked by unit tests and printed
by `--dry-run`; what torch_xla, Lightning and JAX then do with them is checked by running their code on
emulated workers (tests/integration/test_launch.py). Two launch models (docs/train.md):

* host: one process per worker runs the user's command, as xla_dist and the Cloud TPU pod recipe do;
  the script's own spawner (xmp.spawn, torch_xla.launch, Lightning, SPMD, JAX) makes the chip processes.
* chip: one process per chip (per core on `cpu`), with torchrun's variables, for torchrun-style scripts.

Each runtime's own variables are made by runtimes.py. Sources of every variable are in docs/train.md: pytorch/xla
`torch_xla/_internal/tpu.py` (xmp.spawn's `configure_topology`), `torch_xla/_internal/pjrt.py` and
`torch_xla/distributed/xla_dist.py` (<= 2.0).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeVar

from tpurun.errors import UsageError  # a stdlib-only leaf; gives the CLI exit code 2 for bad --cores/--core
from tpurun.job.runtimes import (
    XRT_SERVER_PORT,
    Precision,
    Runtime,
    jax_cpu_env,
    runtime_env,
    torchtpu_env,
)
from tpurun.naming import worker_name
from tpurun.topology import MEGASCALE_PORT, Topology, vm_env
from tpurun.worker import WORKER_DIR
from tpurun.worker.probe import PythonProbe  # what PROBE_SCRIPT prints
from tpurun.worker.protocol import HOST, Launch, Word  # the agent's words for how processes are made and where filed

W = TypeVar("W", Runtime, Launch, Precision)


def choice(kind: type[W], value: W | str, option: str) -> W:
    """VALUE as a member of KIND (one passes through): the one check of each of train's choices, and its one
    message (the command line's own parser checks them first; this holds for every other caller)."""
    try:
        return kind(value)
    except ValueError:
        *others, last = [m.value for m in kind]
        raise UsageError(f"{option} {value}: use {', '.join(others)} or {last}") from None


# XRT (torch_xla ≤ 2.0) predates v5e/v5p/v6e, which need torch_xla ≥ 2.1 (PJRT only).
XRT_GENERATIONS = ("v2", "v3", "v4")


@dataclass(frozen=True)
class SlotSpec:
    """One process tpurun starts on one worker, filed under its slot: its place in the job, its environment
    and command."""

    worker: int
    slot: int  # index on its worker (log file w<worker>-c<slot>.log, TPURUN_CORE), or HOST (w<worker>.log)
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
    *,
    job_id: str,
    worker: int,
    num_workers: int,
    launch: str,
    master_addr: str,
    master_port: int,
    restart_count: int,
    restart_reason: str,
) -> dict[str, str]:
    """What every process tpurun starts sees, in either launch model."""
    return {
        "TPURUN_JOB_ID": job_id,
        "TPURUN_WORKER_ID": str(worker),
        "TPURUN_NUM_WORKERS": str(num_workers),
        "TPURUN_LAUNCH": launch,
        "TPURUN_RESTART_COUNT": str(restart_count),
        "TPURUN_RESTART_REASON": restart_reason,  # why the last attempt ended (job.ends' kinds); "" at first
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


class Framework(Word):
    """What a script imports, which decides its default launch and what its notes speak of."""

    jax = "jax"  # JAX and no torch: one process per host drives that host's chips
    torch = "torch"  # torch_xla, Lightning or plain torch: a spawner makes the chip processes
    other = "other"  # neither


def script_framework(source: str) -> Framework:
    """The framework a script's SOURCE imports (a module it imports through another is not seen)."""
    found = set(_IMPORT_RE.findall(source))
    if not found:
        return Framework.other
    return Framework.jax if found == {"jax"} else Framework.torch


def _torchrun_env(*, slot: int, rank: int, world_size: int, local_rank: int, local_world_size: int) -> dict[str, str]:
    """torchrun's per-process variables (chip launch only: in a host launch the spawner numbers its children)."""
    return {
        "TPURUN_CORE": str(slot),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
    }


def pick_launch(
    asked: Launch | str | None, runtime: Runtime | str, framework: Framework = Framework.torch
) -> tuple[Launch, str]:
    """(launch, reason): ASKED, or the default for RUNTIME and the script's FRAMEWORK."""
    runtime = choice(Runtime, runtime, "--runtime")
    jax = framework is Framework.jax
    if asked is None:
        if jax and runtime is not Runtime.torchtpu:
            return Launch.host, (
                "launch host, the default for a JAX script: one process per worker (JAX's own model), which "
                + (
                    "drives every chip of its host"
                    if runtime is not Runtime.cpu
                    else "joins the others through jax.distributed"
                )
            )
        if runtime is Runtime.torchtpu:
            return Launch.host, (
                "launch host, the default on torchtpu: one process per worker; the script calls "
                "set_tpu_launch_env and its launcher (torch.multiprocessing.spawn, torchrun) makes one process per device"
            )
        if runtime is Runtime.cpu:
            return Launch.chip, (
                "launch chip, the default on the cpu runtime: with no chips for a script's spawner to find, "
                "tpurun starts one process per core"
            )
        return Launch.host, (
            f"launch host, the default on {runtime}: one process per worker; the script's spawner "
            "(xmp.spawn, torch_xla.launch, Lightning) makes one process per chip, SPMD drives the chips from it"
        )
    requested = choice(Launch, asked, "--launch")
    _refuse_chip_on_xrt(runtime, requested)
    if requested is Launch.chip and runtime is Runtime.torchtpu:
        return Launch.chip, (
            "launch chip, as requested: one process per device with torchrun's variables and what "
            "set_tpu_launch_env would derive"
        )
    if requested is Launch.chip:
        return Launch.chip, "launch chip, as requested: one process per chip with torchrun's variables"
    if jax:
        return Launch.host, "launch host, as requested: one JAX process per worker"
    return (
        Launch.host,
        "launch host, as requested: one process per worker; the script's spawner makes the chip processes",
    )


# A one-host pod on this machine stands for one TPU host: at most as many CPU processes as the largest host
# has PJRT devices (v2/v3: 4 chips x 2 TensorCores), unless oversubscribed on purpose.
LOCAL_MAX_PROCESSES = 8


def _slots(
    *,
    runtime: Runtime,
    launch: Launch,
    topology: Topology | None,
    cores: int | None,
    core: int | None,
    oversubscribe: bool = False,
) -> list[int]:
    """The slots to start on every worker: [HOST] for a host launch."""
    if cores is not None and core is not None:
        raise UsageError("--cores and --core exclude each other: give one")
    if cores is not None and cores < 1:
        raise UsageError(f"--cores {cores}: give a positive number")
    if runtime is Runtime.cpu:
        return _cpu_slots(launch, topology, cores, core, oversubscribe)
    assert topology is not None
    if runtime is Runtime.torchtpu:
        return _torchtpu_slots(launch, topology, cores, core)
    if runtime is Runtime.xrt:
        return _xrt_slots(topology, cores, core)
    return _pjrt_slots(launch, topology, cores, core)


def _cpu_slots(
    launch: Launch, topology: Topology | None, cores: int | None, core: int | None, oversubscribe: bool
) -> list[int]:
    """The cpu runtime's slots: one process per core asked for, each standing for one PJRT device of a host."""
    if core is not None and core < 0:
        raise UsageError(f"--core {core}: give a core index ≥ 0")
    if launch is Launch.host:
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
        raise UsageError(f"{what}: {host}, and each CPU process stands for one; --oversubscribe starts more on purpose")
    if core is not None:
        return [core]
    n = cores if cores is not None else (topology.pjrt_devices_per_host if topology else 1)
    return list(range(n))


def _torchtpu_slots(launch: Launch, topology: Topology, cores: int | None, core: int | None) -> list[int]:
    """TorchTPU's slots: every device of a host, made by the script's launcher (host) or by tpurun (chip)."""
    devices = topology.pjrt_devices_per_host
    if core is not None or cores not in (None, devices):
        raise UsageError(
            f"--cores/--core with --runtime torchtpu: TorchTPU runs every device of a host ({devices} on "
            f"{topology.name}); drop the option"
        )
    return [HOST] if launch is Launch.host else list(range(devices))


def _xrt_slots(topology: Topology, cores: int | None, core: int | None) -> list[int]:
    """XRT's one slot: xla_dist ran one process per host; the script's own xmp.spawn(nprocs=1|None) picks the
    cores."""
    if core is not None:
        raise UsageError(
            "--core is not available with --runtime xrt: XRT runs one process per host and the script's "
            "xmp.spawn picks the cores (nprocs=1 runs only the first)"
        )
    if cores not in (None, 1, topology.cores_per_host, topology.pjrt_devices_per_host):
        raise UsageError(f"--cores {cores}: with --runtime xrt give 1 or all ({topology.cores_per_host})")
    return [HOST]


def _pjrt_slots(launch: Launch, topology: Topology, cores: int | None, core: int | None) -> list[int]:
    """PJRT's slots: every chip (one process per chip, made by tpurun or by the script's spawner), or one chip."""
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
    if launch is Launch.host:
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
    runtime: Runtime | str,
    launch: Launch | str,
    worker_addresses: list[str],
    cores: int | None,
    core: int | None,
    script: str,
    args: list[str],
    slice_size: int | None = None,
    python: str = "python3",
    master_port: int = 12355,
    extra_env: dict[str, str] | None = None,
    precision: Precision | str = Precision.fp32,
    restart_count: int = 0,
    restart_reason: str = "",
    tpu_ip: str | None = None,
    oversubscribe: bool = False,
    slice_metadata: bool = True,
) -> list[list[SlotSpec]]:
    """Every process tpurun starts for the job: one list per worker, one SlotSpec per process on it.

    `launch` is host (one process per worker, slot HOST) or chip (one per chip, or per core on
    `cpu`). `cores`: None = every chip of a host; 1 = one. `core`: one specific core index (pjrt: a PJRT
    device index of the host, mapped to its chip, see explain_core). In a chip launch ranks are global
    process indices (torchrun's meaning), worker-major. `slice_size`: hosts per slice of a multislice TPU
    (WORKER_ADDRESSES slice-major): each slice gets its own TPU variables, every process the MEGASCALE
    ones that join the slices. `slice_metadata`: whether the VMs' metadata server tells the runtimes their
    place in the slice (a Cloud TPU API node's does, a Compute Engine VM's does not: then every process is
    given those values, see topology.vm_env).
    """
    num_workers = len(worker_addresses)
    runtime, launch = choice(Runtime, runtime, "--runtime"), choice(Launch, launch, "--launch")
    precision = choice(Precision, precision, "--precision")
    _check_job(runtime, launch, topology, num_workers, tpu_ip, slice_size)
    slots = _slots(
        runtime=runtime, launch=launch, topology=topology, cores=cores, core=core, oversubscribe=oversubscribe
    )
    job = _JobArgs(
        job_id=job_id,
        runtime=runtime,
        launch=launch,
        topology=topology,
        worker_addresses=worker_addresses,
        slice_size=slice_size,
        local_world=len(slots),
        single_chip=_single_chip(topology, cores, core) if runtime is Runtime.pjrt and topology else None,
        master_port=master_port,
        restart_count=restart_count,
        restart_reason=restart_reason,
        tpu_ip=tpu_ip,
        slice_metadata=slice_metadata,
        precision=precision,
        extra_env=extra_env,
    )
    argv = [python, script, *args]
    plan: list[list[SlotSpec]] = []
    for worker in range(num_workers):
        specs: list[SlotSpec] = []
        for local_rank, slot in enumerate(slots):
            rank = worker * len(slots) + local_rank
            env = _process_env(job, worker=worker, slot=slot, local_rank=local_rank, rank=rank)
            specs.append(SlotSpec(worker=worker, slot=slot, local_rank=local_rank, rank=rank, env=env, argv=list(argv)))
        plan.append(specs)
    return plan


@dataclass(frozen=True)
class _JobArgs:
    """What plan_job was asked for, checked, as every process's environment is made from it."""

    job_id: str
    runtime: Runtime
    launch: Launch
    topology: Topology | None
    worker_addresses: list[str]
    slice_size: int | None
    local_world: int  # processes per worker
    single_chip: int | None
    master_port: int
    restart_count: int
    restart_reason: str
    tpu_ip: str | None
    slice_metadata: bool
    precision: Precision
    extra_env: dict[str, str] | None


def _process_env(job: _JobArgs, *, worker: int, slot: int, local_rank: int, rank: int) -> dict[str, str]:
    """Everything one process sees, in the order that decides which value wins: the job's variables, its
    slice's, torchrun's (chip launch), jax's (cpu), TorchTPU's, its runtime's, bf16's, and the user's last."""
    runtime, launch, topology, local_world = job.runtime, job.launch, job.topology, job.local_world
    num_workers = len(job.worker_addresses)
    world_size = num_workers * local_world
    size = job.slice_size or num_workers
    slice_id, host = divmod(worker, size)
    in_slice = job.worker_addresses[slice_id * size : (slice_id + 1) * size]
    env = _job_env(
        job_id=job.job_id,
        worker=worker,
        num_workers=num_workers,
        launch=launch,
        master_addr=job.worker_addresses[0],
        master_port=job.master_port,
        restart_count=job.restart_count,
        restart_reason=job.restart_reason,
    )
    if topology is not None and not job.slice_metadata:
        # whatever the runtime: `import torch_xla` reads the slice from the metadata where there are chips
        env.update(vm_env(topology, host, in_slice, slices=num_workers // size, slice_id=slice_id))
    if job.slice_size is not None:
        env.update(_multislice_env(job.worker_addresses[0], slice_id, num_workers // size))
    if launch is Launch.chip:
        env.update(
            _torchrun_env(
                slot=slot, rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world
            )
        )
    if runtime is Runtime.cpu:
        env.update(jax_cpu_env(job.worker_addresses[0], rank, world_size))
    if runtime is Runtime.torchtpu:
        assert topology is not None
        # one rendezvous over every host, of every slice: global worker numbers and addresses
        env.update(
            torchtpu_env(
                topology=topology, worker=worker, worker_addresses=job.worker_addresses, launch=launch,
                local_world=local_world, job_id=job.job_id,
            )
        )  # fmt: skip
    env.update(
        runtime_env(
            runtime=runtime,
            launch=launch,
            topology=topology,
            worker=host,
            worker_addresses=in_slice,
            local_rank=local_rank,
            local_world=local_world,
            single_chip=job.single_chip,
            job_id=job.job_id,
            tpu_ip=job.tpu_ip,
        )
    )
    if job.precision is Precision.bf16:
        env["XLA_USE_BF16"] = "1"
    env.update(job.extra_env or {})  # last: the user's values win, as with xmp.spawn's setdefault
    return env


def _check_job(
    runtime: Runtime,
    launch: Launch,
    topology: Topology | None,
    num_workers: int,
    tpu_ip: str | None,
    slice_size: int | None = None,
) -> None:
    """Refuse a combination that cannot run, with the reason."""
    if slice_size is not None and runtime is Runtime.xrt:
        raise UsageError("--runtime xrt: XRT predates multislice; use --runtime pjrt")
    if slice_size is not None and (slice_size < 1 or num_workers % slice_size):
        raise UsageError(f"{num_workers} workers cannot form slices of {slice_size}")
    if runtime is Runtime.auto:
        raise UsageError("--runtime auto: pick the runtime first (pick_runtime)")
    if not num_workers:
        raise UsageError("no workers to run on")
    if runtime in (Runtime.pjrt, Runtime.xrt, Runtime.torchtpu):
        if topology is None:
            raise UsageError(f"--runtime {runtime} needs a TPU accelerator type; use --runtime cpu on this machine")
        if tpu_ip is None and topology.hosts != (slice_size or num_workers):
            raise UsageError(
                f"{topology.name} has {topology.hosts} hosts but {slice_size or num_workers} worker addresses were "
                "given" + (" per slice" if slice_size else "")
            )
    if runtime is Runtime.xrt and topology is not None and topology.generation not in XRT_GENERATIONS:
        raise UsageError(
            f"--runtime xrt: XRT was removed after torch_xla 2.0 and never ran on {topology.generation}; "
            "use --runtime pjrt"
        )
    _refuse_chip_on_xrt(runtime, launch)
    if tpu_ip is not None and (runtime is not Runtime.xrt or num_workers != 1):
        raise UsageError("--tpu-ip (the old TPU Node architecture) works only with --runtime xrt and one client VM")


def _refuse_chip_on_xrt(runtime: Runtime, launch: Launch) -> None:
    if runtime is Runtime.xrt and launch is Launch.chip:
        raise UsageError("--launch chip: XRT runs one process per host, as xla_dist did; use --launch host")


def pre_commands(
    topology: Topology | None, runtime: Runtime | str, worker: int, python: str = "python3"
) -> list[list[str]]:
    """Commands the agent runs on WORKER before the cores (xla_dist started the XRT server on each TPU VM
    of a pod; on one VM the client's localservice config starts its own)."""
    del worker  # every worker of a pod runs the same server
    runtime = choice(Runtime, runtime, "--runtime")
    if runtime is Runtime.xrt and topology is not None and topology.multi_host:
        return [[python, "-m", "torch_xla.core.xrt_run_server", "--port", str(XRT_SERVER_PORT)]]
    return []


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        m = re.match(r"\d+", piece)
        parts.append(int(m.group()) if m else 0)
    return tuple(parts)


def pick_runtime(asked: Runtime | str, probe: PythonProbe) -> tuple[Runtime, str]:
    """(runtime, reason): ASKED unless it is `auto`, which picks from what PROBE_SCRIPT saw on a worker."""
    requested = choice(Runtime, asked, "--runtime")
    version = probe.torch_xla_version
    tpu = bool(probe.libtpu_installed) and bool(probe.device_files_present)
    if requested is not Runtime.auto:
        return requested, f"--runtime {requested} was requested"
    if not tpu:
        missing = []
        if not probe.libtpu_installed:
            missing.append("libtpu is not installed")
        if not probe.device_files_present:
            missing.append("no TPU device files (/dev/accel*, /dev/vfio/*)")
        return Runtime.cpu, "auto picked cpu: " + " and ".join(missing)
    torch_tpu = probe.torch_tpu_version
    if not version and torch_tpu:
        return Runtime.torchtpu, f"auto picked torchtpu: libtpu and TPU device files present, torch_tpu {torch_tpu}"
    if not version:
        return Runtime.cpu, "auto picked cpu: TPU present but neither torch_xla nor torch_tpu is installed"
    if _version_tuple(version) < (2, 1):
        return Runtime.xrt, f"auto picked xrt: torch_xla {version} < 2.1 (XRT era) and a TPU is present"
    return Runtime.pjrt, f"auto picked pjrt: libtpu and TPU device files present, torch_xla {version}"


# Runs on a worker with its own python3 (any 3.8+); prints its answer, a `probe.PythonProbe` (every field but
# `error`, by name), for pick_runtime and doctor (with the versions of what decides a job, read as the agent's
# preflight reads them: versions.py first).
PROBE_SCRIPT = (
    (WORKER_DIR / "versions.py").read_text()
    + r"""
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
print(json.dumps(dict(
    libtpu_installed=libtpu is not None,
    libtpu_path=libtpu,
    device_files_present=bool(devices),
    device_files=devices,
    torch_xla_version=version("torch_xla") or version("torch-xla"),
    torch_tpu_version=version("torch_tpu") or version("torch-tpu"),
    torch_version=version("torch"),
    python=sys.executable,
    python_version="%d.%d.%d" % sys.version_info[:3],
    packages=installed(DECISIVE),
)))
"""
)


def process_name(worker: int, slot: int, name: str | None = None) -> str:
    """wN/cM for the process in slot M, wN for a host launch's own process (slot HOST): its lines are tagged
    [name]. NAME replaces wN (sS/wN in a multislice TPU)."""
    name = name or worker_name(worker)
    return name if slot == HOST else f"{name}/c{slot}"
