"""The launcher side of `tpurun train`: plan the job, ship the agent, start it everywhere, stream, stop.

The agent (worker/agent.py) owns the processes on each worker and writes every line to files first;
this module only decides and renders (as in torchelastic, the agent is separate from the launcher). Each
worker gets one SSH channel running `agent start` then `agent stream --attached`: the channel's stdin
is the job's lifeline, so closing it (fail-fast, Ctrl-C) or losing it (tpurun killed, laptop gone)
stops the processes of an attached job on that worker.
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

from tpurun import config
from tpurun.errors import ApiError, TpurunError, UnreachableError, UsageError
from tpurun.job import env_contract, preflight
from tpurun.job.records import JobRecord, RecordStream, new_job_id
from tpurun.job.runtimes import Precision, Runtime
from tpurun.job.setup import Setup, SetupResult, plan_setup, run_everywhere
from tpurun.sync import sender
from tpurun.targets import Target
from tpurun.transport import bundle
from tpurun.transport.fanout import each
from tpurun.transport.runner import Runner, Stream, open_stream, run_capture, worker_names
from tpurun.worker import bundle_name, protocol
from tpurun.worker.protocol import JOB_GRACE, AgentExit, Launch, ProcessStatus

# Runs on each worker: agent present (else exit AgentExit.MISSING)? start the job (spec from $2, base64),
# then stream its records with our stdin as the lifeline (exec: the stream process *is* the channel's command).
_START_AND_STREAM = (
    f'f="{bundle.BIN}/$1/agent.py"; [ -f "$f" ] || exit {AgentExit.MISSING.value}; '
    'printf %s "$2" | base64 -d | "$3" "$f" start || exit $?; '
    '[ "$5" = detach ] && exit 0; '
    'exec "$3" "$f" stream "$4" --follow --attached'
)
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
    dry_run: bool = False
    python: str | None = None
    setup: list[str] = field(default_factory=list)  # shell commands run once per content on every worker
    grace: float = JOB_GRACE
    master_port: int = 12355
    tpu_ip: str | None = None
    down: bool = False  # delete the TPU when the job ends (the TPU's watchdog does, if tpurun is gone)
    oversubscribe: bool = False  # the cpu runtime: more processes per worker than the host has devices
    allow_skew: bool = False  # start even where the workers' Python or decisive packages differ


@dataclass
class SlotOutcome:
    """How the process in one slot of a worker stands or ended, as the launcher follows it."""

    worker: int
    slot: int
    exit_code: int | None = None
    status: ProcessStatus = ProcessStatus.RUNNING
    started: float = 0.0
    ended: float = 0.0
    last_lines: deque[str] = field(default_factory=lambda: deque(maxlen=20))

    @property
    def failed(self) -> bool:
        # died: a chip process of a host launch that vanished unreported (its exit status is its parent's)
        return self.exit_code not in (0, None) or self.status is ProcessStatus.DIED

    @property
    def ending(self) -> str:
        if self.status is ProcessStatus.DIED:
            return "no exit status: it died, killed by a signal or crashed"
        return f"exit code {self.exit_code}"


# ---------------------------------------------------------------------------- planning


def probe(target: Target, python: str) -> dict[str, Any]:
    """What worker 0 has: libtpu, device files, torch_xla version (for --runtime auto and hints)."""
    rc, out, err = run_capture(target.runners[0], [python, "-c", env_contract.PROBE_SCRIPT], timeout=120)
    if rc != 0:
        raise UnreachableError(
            f"cannot run {python} on worker {target.runners[0].worker.label()}: {err.strip().splitlines()[-1:] or rc}"
        )
    try:
        return json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {}


@dataclass(frozen=True)
class JobPlan:
    """What `train` decided: the runtime and launch model (each with why) and every process it starts."""

    runtime: Runtime
    runtime_reason: str
    launch: Launch
    launch_reason: str
    specs: list[list[env_contract.SlotSpec]]

    @property
    def processes(self) -> int:
        return sum(len(per) for per in self.specs)


def plan(target: Target, spec: TrainSpec, job_id: str, restart_count: int = 0) -> JobPlan:
    python = target.python(spec.python)
    topo = target.topology
    runtime, why = spec.runtime, "asked for"
    if runtime is Runtime.auto:
        runtime, why = env_contract.pick_runtime(Runtime.auto, probe(target, python))
    launch, launch_why = env_contract.pick_launch(spec.launch, runtime)
    cores = spec.cores
    if target.local and cores is None and spec.core is None and runtime is Runtime.cpu and launch is Launch.chip:
        cores = 1
    extra = dict(spec.env)
    if spec.metrics:
        extra.setdefault("TPURUN_METRICS", "1")
    # the workers reach each other inside the VPC: internal addresses (external ones take SSH only, by the
    # default firewall rules), whatever address tpurun itself connects to
    addresses = [w.internal or w.address for w in target.all_workers]
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
        tpu_ip=spec.tpu_ip,
        oversubscribe=spec.oversubscribe,
        slice_metadata=target.slice_metadata,
    )
    return JobPlan(runtime, why, launch, launch_why, specs)


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


# ---------------------------------------------------------------------------- running


class Output(Protocol):
    """How the launcher reports (it prints nothing itself): status lines, every process's lines, and the
    lines a worker's setup prints."""

    def name_workers(self, names: dict[int, str]) -> None: ...
    def info(self, text: str) -> None: ...
    def warn(self, text: str) -> None: ...
    def lines(self, worker: int, lines: list[tuple[int, str]]) -> None: ...  # (slot, text) each, in order
    def worker_line(self, worker: int, stream: str, text: str) -> None: ...
    def flush(self) -> None: ...
    def progress(self) -> AbstractContextManager[Callable[[str], None]]: ...


class JobRun:
    """One attempt of a job across all workers."""

    def __init__(
        self,
        target: Target,
        job_id: str,
        specs: list[list[env_contract.SlotSpec]],
        out: Output,
        *,
        cwd: str,
        python: str,
        detach: bool,
        grace: float,
        pre: Callable[[int], list[list[str]]],
        launch: Launch,
        cancel: threading.Event | None = None,
        down: bool = False,
    ) -> None:
        self.target = target
        self.job_id = job_id
        self.specs = specs
        self.out = out
        self.cwd = cwd
        self.python = python
        self.detach = detach
        self.grace = grace
        self.pre = pre
        self.launch = launch
        self.down = down
        self.cancel = cancel or threading.Event()  # set by the caller (Ctrl-C): stop the job everywhere
        self.outcomes: dict[tuple[int, int], SlotOutcome] = {
            (c.worker, c.slot): SlotOutcome(c.worker, c.slot) for per in specs for c in per
        }
        self.first_failure: SlotOutcome | None = None
        self.lost: dict[int, str] = {}
        self.busy: dict[int, str] = {}  # worker -> why the agent refused (another job runs there)
        self.stop = threading.Event()
        self.started_at = time.monotonic()
        self.lock = threading.Lock()

    def job_spec(self, worker: int) -> protocol.JobSpec:
        return protocol.JobSpec(
            job_id=self.job_id,
            worker=worker,
            cores=[protocol.ProcessSpec(c.slot, c.argv, c.env, self.cwd) for c in self.specs[worker]],
            launch=self.launch,
            detach=self.detach,
            down=self.down,
            grace=self.grace,
            pre_commands=self.pre(worker),
        )

    def _command(self, worker: int) -> list[str]:
        spec = base64.b64encode(self.job_spec(worker).to_json().encode()).decode()
        mode = "detach" if self.detach else "attach"
        return ["sh", "-c", _START_AND_STREAM, "tpurun", bundle_name(), spec, self.python, self.job_id, mode]

    def _worker(self, runner: Runner) -> None:
        w = runner.worker.index
        try:
            stream = open_stream(runner, self._command(w))
            if self._pump(w, stream) == AgentExit.MISSING:
                # first job on this worker (or a new tpurun version): ship the agent, then start again
                bundle.install(runner)
                self._pump(w, open_stream(runner, self._command(w)))
        except TpurunError as exc:
            self._lose(w, str(exc))
        except (OSError, EOFError) as exc:
            self._lose(w, f"worker {runner.worker.label()}: {exc}")

    def _lose(self, w: int, why: str) -> None:
        with self.lock:
            self.lost[w] = why
        self.stop.set()

    def _pump(self, w: int, stream: Stream) -> int:
        """Render W's records until its job is done; the stream's exit code."""
        reader = RecordStream(stream)
        closed = False
        done = False
        while not done:
            if self.cancel.is_set():
                self.stop.set()
            if self.stop.is_set() and not closed and not self.detach:
                stream.close_stdin()  # the agent stops this worker's processes and keeps streaming to the end
                closed = True
            recs = reader.records(0.1)
            if recs is None:
                break
            took, over = self._take(w, recs)
            done = done or over
            if not took:
                self.out.flush()  # idle: show what is buffered now, not when the next line comes
        rc = stream.wait()
        if not done:
            err = stream.stderr_text().strip()
            if rc == AgentExit.MISSING:
                return rc
            if rc == AgentExit.BUSY:
                # another job holds this worker: a refusal (nothing of ours started), not a lost worker
                with self.lock:
                    self.busy[w] = err.splitlines()[-1]
                self.stop.set()
            elif self.detach and rc == 0:
                return rc
            else:
                detail = err.splitlines()[-1] if err else f"connection closed (exit {rc})"
                self._lose(w, f"lost worker {self.target.all_workers[w].label()}: {detail}")
        return rc

    def _take(self, w: int, recs: Iterable[protocol.Record]) -> tuple[bool, bool]:
        """A read's worth of W's records, each run of lines to the output at once: whether there were any,
        and whether W's part of the job is over."""
        took = over = False
        batch: list[tuple[int, str]] = []
        for rec in recs:
            took = True
            if isinstance(rec, protocol.Line):
                batch.append((rec.slot, rec.text))
                continue
            if batch:
                self._lines(w, batch)
                batch = []
            over = self._event(w, rec) or over
        if batch:
            self._lines(w, batch)
        return took, over

    def _lines(self, w: int, batch: list[tuple[int, str]]) -> None:
        kept: dict[int, deque[str]] = {}  # each slot's last lines (an outcome's lookup takes the lock)
        for slot, text in batch:
            last = kept.get(slot)
            if last is None:
                last = kept[slot] = self.outcome(w, slot).last_lines
            last.append(text)
        self.out.lines(w, batch)

    def _event(self, w: int, rec: protocol.Record) -> bool:
        """Take one of W's records other than a line; True once W's part of the job is over."""
        if isinstance(rec, protocol.Exit):
            self._exited(w, rec)
            return False
        if isinstance(rec, protocol.Done):
            origin = protocol.first_failure(rec.state)
            if origin is not None and self.first_failure is None:
                with self.lock:
                    if self.first_failure is None:
                        self.first_failure = self.outcome(w, origin.slot)
            for ps in protocol.process_states(rec.state):
                o = self.outcome(w, ps.slot)
                if o.exit_code is None:
                    o.exit_code, o.status = ps.exit_code, ps.status
            return True
        if isinstance(rec, protocol.StartFailed):
            self._lose(w, f"{self.target.all_workers[w].name}: the agent could not start the job: {rec.reason}")
            return True
        return False  # Started

    def _exited(self, w: int, rec: protocol.Exit) -> None:
        o = self.outcome(w, rec.slot)
        o.exit_code, o.status = rec.code, rec.status
        o.ended = time.monotonic() - self.started_at
        if o.failed and not self.stop.is_set():
            # a process the agent killed because a sibling failed is not the origin: wait for the sibling's record
            if o.status is not ProcessStatus.KILLED:
                with self.lock:
                    if self.first_failure is None:
                        self.first_failure = o
            name = env_contract.process_name(w, rec.slot, self.target.all_workers[w].name)
            self.out.info(f"{name} failed ({o.ending}): stopping the job everywhere")
            self.stop.set()
        elif o.failed and o.status is not ProcessStatus.KILLED and self.first_failure is None:
            with self.lock:
                self.first_failure = o  # its worker's agent reported the killed sibling first

    def outcome(self, w: int, slot: int) -> SlotOutcome:
        """W's SLOT, also one the script's spawner made after the start (a host launch's chips)."""
        with self.lock:
            if (w, slot) not in self.outcomes:
                self.outcomes[(w, slot)] = SlotOutcome(w, slot)
            return self.outcomes[(w, slot)]

    def run(self) -> None:
        each(self.target.runners, self._worker, name="job")
        self.out.flush()


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


def connect(target: Target, record: JobRecord | None = None) -> None:
    """Connect every worker of TARGET, or raise; with RECORD, also that TARGET is the TPU that job ran on."""
    errors = target.connect()
    if errors:
        raise UnreachableError("; ".join(errors[i] for i in sorted(errors)))
    if record is not None and target.other_than(record.ids):
        raise ApiError(
            f"job {record.job_id} ran on the TPU {record.tpu} with node id {', '.join(record.ids)}, which no longer "
            f"exists: the TPU named {record.tpu} now is another one (node id {', '.join(target.ids)}), without "
            "that job or its logs"
        )


# ---------------------------------------------------------------------------- a whole job


class JobState(str, Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # a process failed (first_failure names the first)
    SETUP_FAILED = "setup failed"  # the job did not start
    INTERRUPTED = "interrupted"  # Ctrl-C / SIGTERM: stopped everywhere
    LOST = "lost"  # a worker could not be reached or vanished
    PREEMPTED = "preempted"  # the node was preempted (and --max-restarts is used up)
    BUSY = "busy"  # another job runs there: nothing started
    DETACHED = "detached"  # started and left running


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
    framework: str = "torch"  # what the script imports: "jax" or "torch" (env_contract.script_framework)
    skew: preflight.Skew = field(default_factory=lambda: preflight.Skew(()))  # where the workers differ

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
        if p.runtime is Runtime.cpu and p.processes > 1 and self.framework == "jax":
            out.append(
                (
                    "info",
                    f"note: {p.processes} CPU processes join as one JAX job when the script calls "
                    "jax.distributed.initialize() (tpurun sets its coordinator, process count and id; CPU "
                    "collectives go over gloo: docs/train.md)",
                )
            )
        elif p.runtime is Runtime.cpu and p.processes > 1:
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
    job: Job
    state: JobState
    run: JobRun | None = None
    setup: SetupResult | None = None
    restarts: int = 0


def prepare(spec: TrainSpec, target: Target, restart: int, *, dest: str | None, local_dir: Path) -> Job:
    """Decide the job: runtime, launch model, every process, the setup. Only --runtime auto (or a real
    start) needs the workers. A real start is refused on a busy TPU, and on skewed workers unless allowed
    (after the setup, when there is one: it may install what differs)."""
    job_id = new_job_id()
    if spec.runtime is Runtime.auto or not spec.dry_run:
        connect(target)
    p = plan(target, spec, job_id, restart_count=restart)
    python = target.python(spec.python)
    cwd = str(local_dir) if target.local else (dest or sender.default_dest(local_dir))
    setup = plan_setup(
        spec.setup, script=spec.script, python=python, cwd=cwd, local_dir=local_dir, on_tpu=not target.local
    )
    try:
        framework = env_contract.script_framework((local_dir / spec.script).read_text(errors="replace"))
    except OSError:
        framework = "torch"
    job = Job(job_id, spec, target, p, python, cwd, setup, framework)
    if not spec.dry_run:
        answers = preflight.ask(target, python, preflight.requirement_names(spec.script, local_dir))
        preflight.refuse_if_busy(target, answers)
        if setup is None:
            job.skew = preflight.compare(target, answers)
            preflight.refuse_skew(target, job.skew, spec.allow_skew)
    return job


def start(job: Job, *, home: Path, local_dir: Path, out: Output, cancel: threading.Event) -> JobResult:
    """Sync, set up, start the job on every worker and follow it to its end (or start it detached)."""
    target, spec = job.target, job.spec
    out.name_workers(worker_names(target.all_workers))
    if not target.local:
        sync_code(target, local_dir, job.cwd, home, out)
    if job.setup:
        res = run_setup(job, out, cancel)
        if res.failed is not None:  # (its fail-fast also sets CANCEL: a failure comes first)
            return JobResult(job, JobState.SETUP_FAILED, setup=res)
        if cancel.is_set():
            return JobResult(job, JobState.INTERRUPTED, setup=res)
        job.skew = preflight.compare(
            target, preflight.ask(target, job.python, preflight.requirement_names(spec.script, local_dir))
        )
        preflight.refuse_skew(target, job.skew, spec.allow_skew)
    if job.skew:
        out.warn(f"starting anyway (--allow-skew): the workers differ: {job.skew.summary()}")
    specs = job.plan.specs
    JobRecord(
        job_id=job.job_id,
        tpu=target.name,
        workers=[r.worker.index for r in target.runners],
        cores={w: [c.slot for c in per] for w, per in enumerate(specs)},
        created=time.strftime("%Y-%m-%dT%H:%M:%S"),
        detached=spec.detach,
        command=[spec.script, *spec.args],
        python=job.python,
        ids=list(target.ids),
        project=target.project,
        zone=target.zone,
    ).save(home)
    topo = target.topology
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
    )
    run.run()
    return JobResult(job, _state(run, job, cancel), run=run)


def _state(run: JobRun, job: Job, cancel: threading.Event) -> JobState:
    if run.busy and not run.lost and run.first_failure is None:
        return JobState.BUSY  # refused: another job runs there; nothing was started
    if job.spec.detach:
        return JobState.LOST if run.lost else JobState.DETACHED
    if cancel.is_set():
        return JobState.INTERRUPTED
    if run.first_failure is not None:
        return JobState.FAILED
    if run.lost:
        return JobState.PREEMPTED if preempted(job.target) else JobState.LOST
    return JobState.FAILED if any(o.failed for o in run.outcomes.values()) else JobState.SUCCEEDED


def preempted(target: Target) -> bool:
    """Whether the API reports TARGET (one of its slices) preempted or gone after its workers vanished; it
    may say so a little after the workers went, so look for a while (TPURUN_PREEMPT_CHECK)."""
    if target.local:
        return False
    from tpurun.cloud import provision

    deadline = time.monotonic() + config.PREEMPT_CHECK.number()
    try:
        cloud = target.cloud()
    except TpurunError:
        return False
    while True:
        try:
            answer = provision.gone_or_preempted(cloud, target.name)
        except TpurunError:
            return False
        if answer is not None or time.monotonic() > deadline:
            return bool(answer)
        time.sleep(1.0)


def sync_code(target: Target, src: Path, dest: str, home: Path, out: Output) -> None:
    """SRC to DEST on every worker (incremental: unchanged files cost nothing)."""
    started = time.monotonic()
    pushed = sender.push(target, src, dest, cache_dir=home / "sync-cache")
    manifest, stats = pushed.manifest, pushed.stats
    failed = [st for st in stats if st.error or st.errors]
    if failed:
        raise UnreachableError(
            "could not sync the code: "
            + "; ".join(f"{st.name} ({st.address}): {st.error or st.errors[0]}" for st in failed)
        )
    # files, not files x workers: what changed here, sent to each worker that lacked it
    sent = sorted({st.files_sent for st in stats})
    some = " (to some workers only)" if len(sent) > 1 else ""
    out.info(
        f"synced {src} to {dest} on {len(stats)} worker(s): {sent[-1] if sent else 0} of "
        f"{len(manifest.files) + len(manifest.links)} file(s) sent{some} in {time.monotonic() - started:.1f} s"
    )


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
        job.target.runners,
        setup,
        cwd=job.cwd,
        python=job.python,
        sink=out.worker_line,
        stop=cancel,
        grace=job.spec.grace,
        on_start=announce,
    )
    if res.ran and res.failed is None and not cancel.is_set():
        out.info(f"setup done on {len(res.ran)} worker(s) in {time.monotonic() - started:.1f} s")
    return res
