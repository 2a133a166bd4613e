"""The launcher side of `tpurun train`: plan the job, sync the code, set up, and start it (an attempt: job.attempt).

The agent (worker/agent.py) owns the processes on each worker and writes every line to files first;
this module only decides (as in torchelastic, the agent is separate from the launcher).
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tpurun import config
from tpurun.errors import ExitCode, TpurunError, UnreachableError, UsageError
from tpurun.fleet.interface import Call
from tpurun.fleet.targets import Target
from tpurun.job import ends, env_contract, preflight
from tpurun.job.attempt import DEFAULT_HANG_TIMEOUT, HangWatch, JobRun, OnHang, Output
from tpurun.job.ends import Budgets, End
from tpurun.job.records import JobRecord, connect, forget, new_job_id
from tpurun.job.runtimes import Precision, Runtime
from tpurun.job.setup import Setup, SetupResult, plan_setup, run_everywhere
from tpurun.job.spend_limit import SpendLimit
from tpurun.naming import each_or_by_reason, listed
from tpurun.sync import report, sender
from tpurun.topology import Topology
from tpurun.transport.runner import worker_names
from tpurun.worker.probe import PythonProbe
from tpurun.worker.protocol import JOB_GRACE, PROFILE_PORT, JobStatus, Launch, ProcessStatus

HINTS = [
    (
        "Missing XLA configuration",
        "no XLA device is configured: use --runtime pjrt on a TPU (tpurun sets PJRT_DEVICE), or run `tpurun doctor`",
    ),
    (
        "Cannot replicate if number of devices",
        "the XLA device was touched outside the spawned processes: do not call xm.xla_device() before xmp.spawn / Trainer.fit",
    ),
    (
        "mappingproxy",
        "an object that cannot be pickled was passed to the spawned processes: create models and data loaders inside the spawned function",
    ),
    ("TPU is already in use", "a stale process holds the TPU: run `tpurun kill-stale`"),
    ("libtpu_lockfile", "a stale libtpu lock file or process: run `tpurun kill-stale`"),
    ("Device or resource busy", "the TPU device is held by another process: run `tpurun kill-stale`"),
    (
        "Couldn't open device",
        "the TPU device cannot be opened (busy or no permission): run `tpurun kill-stale`, then `tpurun doctor`",
    ),
]


def parse_env(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if (
            not sep
            or not key
            or not key.isascii()  # str.isalnum() takes 'Ä' too; variable names are ASCII
            or not (key[0].isalpha() or key[0] == "_")
            or not all(c.isalnum() or c == "_" for c in key)
        ):
            raise UsageError(f"bad --env {item!r}: expected NAME=VALUE with NAME of letters, digits and '_'")
        if "\0" in value:
            raise UsageError(f"bad --env '{key}': values cannot contain NUL bytes")
        out[key] = value
    return out


@dataclass
class TrainSpec:
    script: str
    args: list[str]
    cores: int | None = None
    core: int | None = None
    runtime: Runtime = Runtime.auto
    launch: Launch | None = None  # None: the runtime's default (env_contract.pick_launch)
    precision: Precision = Precision.fp32
    env: dict[str, str] = field(default_factory=dict)
    detach: bool = False
    max_restarts: int = 0
    metrics: bool = False
    profile: bool = True  # a profiler server in every process of the job, for `tpurun profile`
    dry_run: bool = False
    python: str | None = None
    setup: list[str] = field(default_factory=list)  # shell commands run once per content on every worker
    grace: float = JOB_GRACE
    master_port: int = 12355
    tpu_ip: str | None = None
    down: bool = False  # delete the TPU when the job ends (the TPU's watchdog does, if tpurun is gone)
    oversubscribe: bool = False  # the cpu runtime: more processes per worker than the host has devices
    allow_skew: bool = False  # start even where the workers' Python or decisive packages differ
    hang_timeout: float = DEFAULT_HANG_TIMEOUT  # seconds without progress before --on-hang (0: never)
    on_hang: OnHang = OnHang.report
    on_notice: str | None = None  # --on-notice as given (ends.on_notice; None: the runtime's default)
    restarts: str = ""  # --restarts KIND=N,... (ends.Budgets)
    worker: str | None = None  # --worker SPEC: one host alone, as the single-host slice it is on its own (or all)
    budget: float = 0.0  # --budget USD: the job is stopped before it costs more (job/spend_limit.py; 0: none)


# ---------------------------------------------------------------------------- planning


def probe(target: Target, python: str) -> PythonProbe:
    """What worker 0 has: libtpu, device files, torch_xla version (for --runtime auto and hints)."""
    first = target.workers[0]
    a = target.fleet.call(Call.command([python, "-c", env_contract.PROBE_SCRIPT]), timeout=120, only=[first.index])
    answer = a[first.index]
    if answer.rc is None:
        raise UnreachableError(answer.error)
    if answer.rc != 0:
        raise UnreachableError(
            f"cannot run {python} on worker {first.label()}: {answer.err.strip().splitlines()[-1:] or answer.rc}"
        )
    try:
        return PythonProbe.from_dict(json.loads(answer.out.decode().strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return PythonProbe()


@dataclass(frozen=True)
class JobPlan:
    """What `train` decided: the runtime and launch model (each with why) and every process it starts."""

    runtime: Runtime
    runtime_reason: str
    launch: Launch
    launch_reason: str
    specs: list[list[env_contract.SlotSpec]]
    topology: Topology | None = None  # what the processes are told they run on (one host's, with --worker)

    @property
    def processes(self) -> int:
        return sum(len(per) for per in self.specs)


def plan(
    target: Target,
    spec: TrainSpec,
    job_id: str,
    restart_count: int = 0,
    framework: env_contract.Framework = env_contract.Framework.torch,
    restart_reason: str = "",
) -> JobPlan:
    python = target.python(spec.python)
    selected, every = len(target.workers), len(target.all_workers)
    if spec.worker is not None and selected not in (1, every):
        raise UsageError(
            f"--worker {spec.worker} selects {selected} of {every} workers: a job runs on every worker of the TPU "
            "(the runtime joins every host of a slice) or on one alone (--worker N)"
        )
    if spec.worker is not None and selected == 1 < every and target.slices > 1:
        raise UsageError("--worker runs one host of one slice; this TPU has several slices")
    alone = target.alone  # --worker N of a pod: that host as the single-host slice it is
    topo = alone or target.topology
    runtime, why = spec.runtime, "asked for"
    if runtime is Runtime.auto:
        runtime, why = env_contract.pick_runtime(Runtime.auto, probe(target, python))
    # --cores/--core ask for that many processes per worker: tpurun's to make, whatever the framework
    counted = spec.cores is not None or spec.core is not None
    launch, launch_why = env_contract.pick_launch(
        spec.launch, runtime, env_contract.Framework.torch if counted else framework
    )
    cores = spec.cores
    if target.local and cores is None and spec.core is None and runtime is Runtime.cpu and launch is Launch.chip:
        cores = 1
    extra = dict(spec.env)
    if spec.metrics:
        extra.setdefault("TPURUN_METRICS", "1")
    if spec.profile:
        extra.setdefault(PROFILE_PORT, config.PROFILE_PORT.raw())
    # the workers reach each other inside the VPC: internal addresses (external ones take SSH only, by the
    # default firewall rules), whatever address tpurun itself connects to
    workers = [target.workers[0]] if alone else target.all_workers
    addresses = [w.internal or w.address for w in workers]
    slice_size = sum(1 for w in target.all_workers if w.slice == 0) if target.slices > 1 else None
    specs = env_contract.plan_job(
        job_id=job_id,
        topology=topo,
        runtime=runtime,
        launch=launch,
        worker_addresses=addresses,
        cores=cores,
        core=spec.core,
        script=spec.script,
        args=spec.args,
        slice_size=slice_size,
        python=python,
        master_port=spec.master_port,
        extra_env=extra,
        precision=spec.precision,
        restart_count=restart_count,
        restart_reason=restart_reason,
        tpu_ip=spec.tpu_ip,
        oversubscribe=spec.oversubscribe,
        # one host alone: its metadata describes the whole slice, so the runtimes are given one host's values
        slice_metadata=target.slice_metadata and not alone,
    )
    if alone:  # planned as worker 0 of a one-host slice; started on, and named after, the host it is
        w = workers[0].index
        specs = [[replace(c, worker=w) for c in specs[0]] if i == w else [] for i in range(len(target.all_workers))]
        launch_why += f"; {target.all_workers[w].name} alone, as a {alone.name} single-host slice (--worker)"
    return JobPlan(runtime, why, launch, launch_why, specs, topo)


def dry_run_rows(target: Target, specs: list[list[env_contract.SlotSpec]]) -> list[dict[str, Any]]:
    """Per process tpurun starts: worker, slot (as "core"), address, exact argv and environment (what
    --dry-run prints)."""
    rows = []
    for per_worker in specs:
        for c in per_worker:
            rows.append(
                {
                    "worker": c.worker,
                    "name": env_contract.process_name(c.worker, c.slot, target.all_workers[c.worker].name),
                    "core": None if c.slot == env_contract.HOST else c.slot,  # a host launch's one process per worker
                    "address": target.all_workers[c.worker].address,
                    "command": c.argv,
                    "env": c.env,
                }
            )
    return rows


_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^'.]+)")


def hint_for(lines: list[str], *, python: str = "python3", local: bool = False) -> str | None:
    text = "\n".join(lines)
    missing = _NO_MODULE.search(text)
    if missing and local:
        return (
            f"this machine's Python ({python}) has no module '{missing.group(1)}': install the package that "
            "provides it there, or pass --python with an interpreter that has it"
        )
    if missing:
        return (
            f"the workers' Python ({python}) has no module '{missing.group(1)}': install the package that provides "
            "it on every worker with `tpurun train ... --setup 'pip install PACKAGE'` (or a requirements.txt beside "
            "the script), or pass --python with an interpreter that has it (docs/train.md)"
        )
    for needle, hint in HINTS:
        if needle in text:
            return hint
    return None


# ---------------------------------------------------------------------------- a whole job


@dataclass
class Job:
    """A job decided and not started yet (what --dry-run shows)."""

    job_id: str
    spec: TrainSpec
    target: Target
    plan: JobPlan
    python: str
    cwd: str
    setup: Setup | None
    framework: env_contract.Framework = env_contract.Framework.torch  # what the script imports
    skew: preflight.Skew = field(default_factory=lambda: preflight.Skew(()))  # where the workers differ
    claim: preflight.Claim | None = None  # every worker held for this job until it starts (none for --dry-run)
    restart: tuple[int, str] = (0, "")  # its train's restarts before it, and why the attempt before it ended

    def release(self) -> None:
        """Let the workers go that are still held for this job (it started, or never will)."""
        if self.claim is not None:
            self.claim.release()

    def dry_run(self) -> dict[str, Any]:
        """What `train --dry-run` shows of the job (its --json document): the runtime and launch model and why,
        each process tpurun would start (`dry_run_rows`), the setup."""
        p, setup = self.plan, self.setup
        return {
            "job_id": self.job_id,
            "runtime": p.runtime,
            "reason": p.runtime_reason,
            "launch": p.launch,
            "launch_reason": p.launch_reason,
            "processes": dry_run_rows(self.target, p.specs),
            "setup": {"commands": list(setup.commands), "key": setup.key} if setup else None,
        }

    def notes(self) -> list[tuple[str, str]]:
        """(info|warn, text): what the user is told before the job starts."""
        t, p = self.target, self.plan
        shape = f"{len(t.all_workers)} workers" + (f" in {t.slices} slices" if t.slices > 1 else "")
        where = "this machine" if t.local else f"{t.name} ({shape})"
        out = [
            (
                "info",
                f"job {self.job_id}: {where}, runtime {p.runtime} ({p.runtime_reason}); {p.launch_reason}; "
                f"{p.processes} process(es) started by tpurun",
            )
        ]
        if p.runtime is Runtime.cpu and p.processes > 1 and self.framework is env_contract.Framework.jax:
            out.append(
                (
                    "info",
                    f"note: {p.processes} CPU processes join as one JAX job when the script calls "
                    "jax.distributed.initialize() (tpurun sets its coordinator, process count and id; CPU "
                    "collectives go over gloo: docs/train.md)",
                )
            )
        elif p.runtime is Runtime.cpu and p.processes > 1 and self.framework is env_contract.Framework.torch:
            out.append(
                (
                    "info",
                    f"note: {p.processes} CPU processes are {p.processes} separate XLA worlds (torch_xla has no "
                    "cross-process collectives on CPU); a script reduces across them with torch.distributed gloo "
                    "(docs/train.md)",
                )
            )
        if self.spec.core is not None and t.topology is not None:
            out.append(("info", env_contract.explain_core(t.topology, self.spec.core)))
        if self.spec.precision is Precision.bf16:
            out.append(
                ("warn", "XLA_USE_BF16 is deprecated in recent torch_xla; prefer explicit bfloat16 dtypes in the model")
            )
        return out


@dataclass
class JobResult:
    """How a `train`'s job ended: its END (job.ends), None only where it did not end here: started and left
    running (`--detach`), or refused on a BUSY TPU before anything started. RUN is None where the job ended in its
    setup (failed or stopped)."""

    job: Job
    end: End | None
    run: JobRun | None = None
    setup: SetupResult | None = None
    busy: bool = False  # another job holds the TPU: nothing of this one started
    budgets: Budgets | None = None  # what each cause of an end has cost in restarts (lifecycle.train)
    spend: SpendLimit | None = None  # its --budget (lifecycle.train)
    cost: float | None = None  # USD its TPU's time cost while it ran (every attempt's, after lifecycle.train)

    @property
    def exit_code(self) -> ExitCode:
        """The exit code this end gives `train` (docs/train.md has the table): the end's own; a busy TPU is 2, a
        detached start 0 and, where a worker could not be reached to start it there, 4; a setup that could not run
        on a worker 4."""
        if self.busy:
            return ExitCode.USAGE
        if self.run is None and self.setup is not None and self.setup.failed is not None and self.setup.failed.error:
            return ExitCode.UNREACHABLE  # the setup could not run on a worker: the job did not start
        if self.job.spec.detach and self.run is not None and self.run.unreachable:
            return ExitCode.UNREACHABLE  # not started everywhere
        return ExitCode.OK if self.end is None else self.end.exit_code


def prepare(
    spec: TrainSpec, target: Target, restart: int, *, dest: str | None, local_dir: Path, reason: str = ""
) -> Job:
    """Decide the job: runtime, launch model, every process, the setup. Only --runtime auto (or a real
    start) needs the workers. A real start is refused on a busy TPU, and on skewed workers unless allowed
    (after the setup, when there is one: it may install what differs)."""
    job_id = new_job_id()
    target.run_jobs_with(target.python(spec.python))
    if spec.runtime is Runtime.auto or not spec.dry_run:
        connect(target)
    try:
        framework = env_contract.script_framework((local_dir / spec.script).read_text(errors="replace"))
    except OSError:
        framework = env_contract.Framework.torch
    p = plan(target, spec, job_id, restart_count=restart, framework=framework, restart_reason=reason)
    python = target.python(spec.python)
    cwd = str(local_dir) if target.local else (dest or sender.default_dest(local_dir))
    setup = plan_setup(
        spec.setup, script=spec.script, python=python, cwd=cwd, local_dir=local_dir, on_tpu=not target.local
    )
    job = Job(job_id, spec, target, p, python, cwd, setup, framework, restart=(restart, reason))
    if not spec.dry_run:
        packages = preflight.requirement_names(spec.script, local_dir)
        answers, job.claim = preflight.claim(target, python, packages, job_id)  # refused when another job holds it
        if setup is None:
            job.skew = preflight.compare(target, answers)
            try:
                preflight.refuse_skew(target, job.skew, spec.allow_skew)
            except BaseException:
                job.release()
                raise
    return job


def start(
    job: Job, *, home: Path, local_dir: Path, out: Output, cancel: threading.Event, spend: SpendLimit | None = None,
    began: threading.Event | None = None,
) -> JobResult:  # fmt: skip
    """Sync, set up, start the job on every worker and follow it to its end (or start it detached); SPEND: its
    --budget, whose clock starts here the first time; BEGAN: set once it started on every worker."""
    target, spec = job.target, job.spec
    out.name_workers(worker_names(target.all_workers))
    if not target.local:
        sync_code(target, local_dir, job.cwd, home, out)
    if job.setup:
        res = run_setup(job, out, cancel)
        if res.failed is not None:  # (its fail-fast also sets CANCEL: a failure comes first)
            return JobResult(job, End.FAILED, setup=res)
        if cancel.is_set():
            return JobResult(job, End.STOPPED, setup=res)
        job.skew = preflight.compare(
            target, preflight.ask(target, job.python, preflight.requirement_names(spec.script, local_dir))
        )
        preflight.refuse_skew(target, job.skew, spec.allow_skew)
    if job.skew:
        out.warn(f"starting anyway (--allow-skew): the workers differ: {job.skew.summary()}")
    lost = job.claim.lost() if job.claim is not None else []
    if lost:
        names = listed([target.all_workers[w].name for w in lost])
        raise UsageError(
            f"{names} stopped being held for job {job.job_id} before it started (`tpurun kill-stale` ends a hold); "
            "nothing was started",
            hint="run the train again",
        )
    specs = job.plan.specs
    record = JobRecord(
        job_id=job.job_id,
        tpu=target.name,
        workers=[w.index for w in target.workers],
        cores={w: [c.slot for c in per] for w, per in enumerate(specs)},
        created=time.strftime("%Y-%m-%dT%H:%M:%S"),
        detached=spec.detach,
        command=[spec.script, *spec.args],
        python=job.python,
        ids=list(target.ids),
        project=target.project,
        zone=target.zone,
        restart=job.restart[0],
        restart_reason=job.restart[1],
        price=job_price(target, home, spend),
        started_at=time.time(),
    )
    record.begin(home)
    topo = job.plan.topology
    run = JobRun(
        target,
        job.job_id,
        specs,
        out,
        cwd=job.cwd,
        python=job.python,
        detach=spec.detach,
        grace=spec.grace,
        pre=lambda w: env_contract.pre_commands(topo, job.plan.runtime, w, job.python),
        launch=job.plan.launch,
        cancel=cancel,
        down=spec.down,
        hang=HangWatch(spec.hang_timeout, spec.on_hang, home) if spec.hang_timeout > 0 else None,
        on_notice=ends.on_notice(spec.on_notice, job.framework.value),
        spend_for=spend.left() if spend is not None else None,
        held=job.claim.hand_over() if job.claim is not None else None,
        began=began,
    )
    run.run()
    busy = bool(run.busy) and not run.unreachable and run.first_failure is None
    # a detached job has no end here (not even where a worker could not be reached to start it: the others run on)
    end = None if busy or spec.detach else _ended(run, job, cancel)
    if busy and not run.started:
        forget(home, job.job_id)  # refused everywhere it was asked: it started nowhere, so it leaves no record
    elif end is not None:
        record.close(home, end, run.failure_detail(), run.notice)
    return JobResult(job, end, run=run, busy=busy, cost=record.cost() if end is not None else None)


def job_price(target: Target, home: Path, budget: SpendLimit | None) -> dict[str, Any] | None:
    """The price a job's record keeps (`prices.Price.to_json`): its --budget's, else its TPU's as the spend ledger
    knows it (the API asked only for a TPU the ledger has not priced); None on this machine, without a published
    price, or where the API cannot say."""
    if target.local:
        return None
    if budget is not None:
        return budget.price.to_json()
    from tpurun.cloud import spend

    def ask() -> Any:
        from tpurun.cloud import provision  # here: Google's clients take 0.3 s and 50 MiB, and mostly the ledger knows

        return provision.tpu(target.cloud(), target.name)

    assert target.where is not None  # (a named TPU: not this machine)
    try:
        price = spend.price_for(home, target.project, target.where.endpoint, target.ids, ask)
    except TpurunError:
        return None
    return price.to_json() if price is not None else None


def _ended(run: JobRun, job: Job, cancel: threading.Event) -> End:
    """How RUN ended (job.ends.judge): the user's stop, a notice, a hang, a worker lost (the API says to what), a
    process failed."""
    lost = None
    if run.unreachable and not cancel.is_set() and run.notice is None:
        lost = lost_to(job.target)
    elif run.unreachable:
        lost = End.LOST
    every = run.outcomes.values()
    stopped = bool(run.ended) and all(st.status is JobStatus.STOPPED for st in run.ended.values())
    return ends.judge(
        ends.Facts(
            notice=run.notice,
            user=cancel.is_set() or (stopped and not (run.first_failure or run.unreachable or run.notice or run.hung)),
            hung=run.hung,
            spent=any(st.status is JobStatus.SPENT for st in run.ended.values()),
            # a process that failed on its own; one the job's stop killed is not a failure of the program
            failed=run.first_failure is not None
            or any(o.failed and o.status is not ProcessStatus.KILLED for o in every),
            lost=lost,
            all_zero=bool(every) and all(o.exit_code == 0 for o in every),
        )
    )


def lost_to(target: Target) -> End:
    """Why TARGET's workers vanished, as its API tells (it may say so a little after they went, so look for a
    while: TPURUN_PREEMPT_CHECK): preempted (or gone), maintenance, else infrastructure."""
    if target.local:
        return End.LOST
    from tpurun.cloud import provision, views

    deadline = time.monotonic() + config.PREEMPT_CHECK.number()
    try:
        cloud = target.cloud()
    except TpurunError:
        return End.LOST
    while True:
        try:
            answer = provision.why_down(cloud, target.name)
        except TpurunError:
            return End.LOST
        if answer is not None or time.monotonic() > deadline:
            return {views.PREEMPTED: End.PREEMPTED, views.MAINTENANCE: End.MAINTENANCE}.get(answer or "", End.LOST)
        time.sleep(1.0)


def sync_code(target: Target, src: Path, dest: str, home: Path, out: Output) -> None:
    """SRC to DEST on every worker (incremental: unchanged files cost nothing); a large one warns first."""
    started = time.monotonic()
    stats = sender.push(
        target, src, dest, cache_dir=home / "sync-cache", on_needs=report.size_check(src, out.warn)
    ).stats
    failed = [st for st in stats if st.error or st.errors]
    if failed:
        raise UnreachableError(
            "could not sync the code: "
            + "; ".join(
                each_or_by_reason([(st.name, f"{st.name} ({st.address}): {st.error or st.errors[0]}") for st in failed])
            )
        )
    out.info(f"synced {src} to {dest} in {time.monotonic() - started:.1f} s: {report.totals(stats).line()}")


def run_setup(job: Job, out: Output, cancel: threading.Event) -> SetupResult:
    """The job's setup where it has not run before, its lines to OUT."""
    assert job.setup is not None
    setup = job.setup
    started = time.monotonic()

    def announce(todo: list[int], skipped: list[int]) -> None:
        if skipped:
            out.info(f"setup: unchanged on {len(skipped)} worker(s), skipped")
        if todo:
            out.info(f"setup on {len(todo)} worker(s): {setup.describe()}")

    res = run_everywhere(
        job.target.fleet,
        setup,
        cwd=job.cwd,
        python=job.python,
        sink=out.worker_line,
        stop=cancel,
        grace=job.spec.grace,
        on_start=announce,
        env=job.target.vm_env,
    )
    if res.ran and res.failed is None and not cancel.is_set():
        out.info(f"setup done on {len(res.ran)} worker(s) in {time.monotonic() - started:.1f} s")
    return res
