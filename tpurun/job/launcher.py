"""The launcher side of `tpurun train`: plan the job, ship the agent, start it everywhere, stream, stop.

The agent (worker/agent.py) owns the processes on each worker and writes every line to files first;
this module only decides and renders (as in torchelastic, the agent is separate from the launcher). Each
worker gets one SSH channel running `agent start` then `agent stream --attached`: the channel's stdin
is the job's lifeline, so closing it (fail-fast, Ctrl-C) or losing it (tpurun killed, laptop gone)
stops the cores of an attached job on that worker.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import re
import secrets
import shlex
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpurun import ui
from tpurun.errors import ExitCode, TpurunError, UnreachableError, UsageError
from tpurun.job import plan as envc
from tpurun.topology import Topology, parse_accelerator_type
from tpurun.transport.runner import Runner, Stream, each, open_stream, run_capture
from tpurun.transport.targets import Target
from tpurun.worker import bundle_name, bundle_tar

AGENT_MISSING = 93  # exit code of the start command when the agent file is not on the worker yet

# Runs on each worker: agent present? start the job (spec from $2, base64), then stream its records
# with our stdin as the lifeline (exec: the stream process *is* the channel's command).
_START_AND_STREAM = (
    'f="$HOME/.tpurun/bin/$1/agent.py"; [ -f "$f" ] || exit 93; '
    'printf %s "$2" | base64 -d | "$3" "$f" start >/dev/null || exit $?; '
    '[ "$5" = detach ] && exit 0; '
    'exec "$3" "$f" stream "$4" --follow --attached'
)
# The bundle (a tar on stdin) unpacked beside, then renamed into place: a worker never sees half of it,
# and of two concurrent installs the second finds the first's and drops its own.
_INSTALL_AGENT = (
    'd="$HOME/.tpurun/bin/$1"; t="$d.tmp.$$"; mkdir -p "$t" && tar -xf - -C "$t" || { rm -rf "$t"; exit 1; }; '
    '[ -d "$d" ] || mv -T "$t" "$d" 2>/dev/null; rm -rf "$t"; [ -f "$d/agent.py" ]'
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


def new_job_id() -> str:
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


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
    runtime: str = "auto"
    launch: str | None = None  # host | chip; None: the runtime's default (envc.pick_launch)
    precision: str = "32"
    env: dict[str, str] = field(default_factory=dict)
    detach: bool = False
    max_restarts: int = 0
    metrics: bool = False
    dry_run: bool = False
    python: str | None = None
    setup: list[str] = field(default_factory=list)  # shell commands run once per content on every worker
    grace: float = 5.0
    master_port: int = 12355
    tpu_ip: str | None = None


@dataclass
class CoreOutcome:
    worker: int
    core: int
    exit_code: int | None = None
    status: str = "running"
    started: float = 0.0
    ended: float = 0.0
    last_lines: deque[str] = field(default_factory=lambda: deque(maxlen=20))

    @property
    def failed(self) -> bool:
        # "died": a chip process of a host launch that vanished unreported (its exit status is its parent's)
        return self.exit_code not in (0, None) or self.status == "died"

    @property
    def ending(self) -> str:
        if self.status == "died":
            return "no exit status: it died, killed by a signal or crashed"
        return f"exit code {self.exit_code}"


@dataclass
class JobRecord:
    """What tpurun remembers locally about a job, for `jobs`, `logs` and `cancel`."""

    job_id: str
    tpu: str  # "local" for this machine
    workers: list[int]
    cores: dict[int, list[int]]  # worker -> core indexes
    created: str
    detached: bool
    command: list[str]
    python: str

    def save(self, home: Path) -> None:
        d = home / "jobs"
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = d / f"{self.job_id}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.__dict__, indent=1))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)

    @classmethod
    def load(cls, home: Path, job_id: str) -> JobRecord:
        path = home / "jobs" / f"{job_id}.json"
        if not job_id or "/" in job_id or not path.is_file():
            known = sorted(p.stem for p in (home / "jobs").glob("*.json")) if (home / "jobs").is_dir() else []
            hint = f"known jobs: {', '.join(known[-5:])}" if known else "`tpurun jobs` lists them"
            raise UsageError(f"unknown job {job_id!r}", hint=hint)
        data = json.loads(path.read_text())
        data["cores"] = {int(k): v for k, v in data["cores"].items()}
        return cls(**data)


def list_records(home: Path) -> list[JobRecord]:
    d = home / "jobs"
    if not d.is_dir():
        return []
    return [JobRecord.load(home, p.stem) for p in sorted(d.glob("*.json"))]


# ---------------------------------------------------------------------------- planning


def worker_python(target: Target, spec: TrainSpec) -> str:
    if spec.python:
        return spec.python
    # this machine: the interpreter tpurun runs in (it has torch_xla when installed with [xla])
    return sys.executable if target.local else "python3"


def probe(target: Target, python: str) -> dict[str, Any]:
    """What worker 0 has: libtpu, device files, torch_xla version (for --runtime auto and hints)."""
    rc, out, err = run_capture(target.runners[0], [python, "-c", envc.PROBE_SCRIPT], timeout=120)
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

    runtime: str
    runtime_reason: str
    launch: str
    launch_reason: str
    specs: list[list[envc.CoreSpec]]

    @property
    def processes(self) -> int:
        return sum(len(per) for per in self.specs)


def plan(target: Target, spec: TrainSpec, job_id: str, restart_count: int = 0) -> JobPlan:
    python = worker_python(target, spec)
    topo: Topology | None = parse_accelerator_type(target.accelerator_type) if target.accelerator_type else None
    runtime, why = spec.runtime, "asked for"
    if runtime == "auto":
        runtime, why = envc.pick_runtime("auto", probe(target, python))
    launch, launch_why = envc.pick_launch(spec.launch, runtime)
    cores = spec.cores
    if target.local and cores is None and spec.core is None and runtime == "cpu" and launch == "chip":
        cores = 1
    extra = dict(spec.env)
    if spec.metrics:
        extra.setdefault("TPURUN_METRICS", "1")
    addresses = [w.address for w in target.all_workers]
    specs = envc.plan_job(
        job_id=job_id,
        topology=topo,
        runtime=runtime,
        launch=launch,
        worker_addresses=addresses,
        cores=cores,
        core=spec.core,
        script=spec.script,
        args=spec.args,
        python=python,
        master_port=spec.master_port,
        extra_env=extra,
        precision=spec.precision,
        restart_count=restart_count,
        tpu_ip=spec.tpu_ip,
    )
    return JobPlan(runtime, why, launch, launch_why, specs)


def process_name(worker: int, core: int) -> str:
    """wN/cM for a chip (or core) process, wN for a host launch's own process: its lines are tagged [name]."""
    return f"w{worker}" if core == envc.HOST else f"w{worker}/c{core}"


def dry_run_rows(target: Target, specs: list[list[envc.CoreSpec]]) -> list[dict[str, Any]]:
    """Per process tpurun starts: worker, core, address, exact argv and environment (what --dry-run prints)."""
    rows = []
    for per_worker in specs:
        for c in per_worker:
            rows.append(
                {
                    "worker": c.worker,
                    "core": None if c.core == envc.HOST else c.core,  # a host launch's one process per worker
                    "address": target.all_workers[c.worker].address,
                    "command": c.argv,
                    "env": c.env,
                }
            )
    return rows


# ---------------------------------------------------------------------------- running


# What a runtime prints once per process and tells a user nothing: hidden on the terminal unless asked
# (--debug); the job's log files keep every line.
CHATTER = re.compile(
    r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected peer ranks is : \d+"
)


class Renderer:
    """Lines to stdout as `[wN/cM] line`, coloured on a terminal; whole lines only; CHATTER only if asked."""

    COLOURS = [36, 35, 32, 33, 34, 31]

    def __init__(self, colour: bool, quiet: bool = False, chatter: bool = False) -> None:
        self.colour = colour
        self.quiet = quiet
        self.chatter = chatter
        self.lock = threading.Lock()
        self.buffer: list[str] = []
        self.last_flush = time.monotonic()

    def line(self, worker: int, core: int, text: str) -> None:
        if self.quiet or (not self.chatter and CHATTER.fullmatch(text)):
            return
        prefix = f"[{process_name(worker, core)}]"
        if self.colour:
            prefix = f"\x1b[{self.COLOURS[worker % len(self.COLOURS)]}m{prefix}\x1b[0m"
        with self.lock:
            self.buffer.append(f"{prefix} {text}\n")
            if len(self.buffer) > 512 or time.monotonic() - self.last_flush > 0.05:
                self._flush()

    def _flush(self) -> None:
        if self.buffer:
            try:
                sys.stdout.write("".join(self.buffer))
                sys.stdout.flush()
            except BrokenPipeError:
                pass
            self.buffer.clear()
        self.last_flush = time.monotonic()

    def flush(self) -> None:
        with self.lock:
            self._flush()


class JobRun:
    """One attempt of a job across all workers."""

    def __init__(
        self,
        target: Target,
        job_id: str,
        specs: list[list[envc.CoreSpec]],
        renderer: Renderer,
        *,
        cwd: str,
        python: str,
        detach: bool,
        grace: float,
        pre: Callable[[int], list[list[str]]],
        launch: str,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.target = target
        self.job_id = job_id
        self.specs = specs
        self.renderer = renderer
        self.cwd = cwd
        self.python = python
        self.detach = detach
        self.grace = grace
        self.pre = pre
        self.launch = launch
        self.on_event = on_event or (lambda text: None)
        self.outcomes: dict[tuple[int, int], CoreOutcome] = {
            (c.worker, c.core): CoreOutcome(c.worker, c.core) for per in specs for c in per
        }
        self.first_failure: CoreOutcome | None = None
        self.lost: dict[int, str] = {}
        self.busy: dict[int, str] = {}  # worker -> why the agent refused (another job runs there)
        self.stop = threading.Event()
        self.started_at = time.monotonic()
        self.lock = threading.Lock()

    def job_spec(self, worker: int) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "worker": worker,
            "detach": self.detach,
            "grace": self.grace,
            "pre_commands": self.pre(worker),
            "launch": self.launch,
            "cores": [{"core": c.core, "argv": c.argv, "env": c.env, "cwd": self.cwd} for c in self.specs[worker]],
        }

    def _command(self, worker: int, follow: bool) -> list[str]:
        spec = base64.b64encode(json.dumps(self.job_spec(worker)).encode()).decode()
        mode = "detach" if self.detach else "attach"
        return ["sh", "-c", _START_AND_STREAM, "tpurun", bundle_name(), spec, self.python, self.job_id, mode]

    def install_agent(self, runner: Runner) -> None:
        rc, _, err = run_capture(runner, ["sh", "-c", _INSTALL_AGENT, "tpurun", bundle_name()], stdin=bundle_tar())
        if rc != 0:
            raise UnreachableError(f"cannot install tpurun's agent on worker {runner.worker.label()}: {err.strip()}")

    def _worker(self, runner: Runner) -> None:
        w = runner.worker.index
        try:
            stream = open_stream(runner, self._command(w, follow=True))
            if self._pump(w, stream) == AGENT_MISSING:
                # first job on this worker (or a new tpurun version): ship the agent, then start again
                self.install_agent(runner)
                self._pump(w, open_stream(runner, self._command(w, follow=True)))
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
        buf = b""
        closed = False
        done = False
        while True:
            if self.stop.is_set() and not closed and not self.detach:
                stream.close_stdin()  # the agent stops this worker's cores and keeps streaming to the end
                closed = True
            if b"\n" in buf:
                *lines, buf = buf.split(b"\n")
                for raw in lines:
                    if raw:
                        done = self._record(w, raw) or done
            if done:
                break
            data = stream.read(0.1)
            if data is None:
                break
            if not data:
                self.renderer.flush()  # idle: show what is buffered now, not when the next line comes
            buf += data
        rc = stream.wait()
        if not done:
            err = stream.stderr_text().strip()
            if rc == AGENT_MISSING:
                return rc
            if rc == 3 and "still running" in err:
                # another job holds this worker: a refusal (nothing of ours started), not a lost worker
                with self.lock:
                    self.busy[w] = err.splitlines()[-1]
                self.stop.set()
            elif self.detach and rc == 0:
                return rc
            else:
                detail = err.splitlines()[-1] if err else f"connection closed (exit {rc})"
                self._lose(w, f"lost worker w{w} ({self.target.all_workers[w].address}): {detail}")
        return rc

    def _record(self, w: int, raw: bytes) -> bool:
        try:
            rec = json.loads(raw)
        except ValueError:
            return False
        event = rec.get("event")
        if event is None:
            c = int(rec["c"])
            line = rec.get("l", "")
            self.outcome(w, c).last_lines.append(line)
            self.renderer.line(w, c, line)
            return False
        if event == "started":
            return False
        if event == "exit":
            c = int(rec["c"])
            o = self.outcome(w, c)
            o.exit_code = rec.get("code")
            o.status = rec.get("status") or "exited"
            o.ended = time.monotonic() - self.started_at
            if o.failed and not self.stop.is_set():
                # a core the agent killed because a sibling failed is not the origin: wait for the sibling's record
                if o.status != "killed":
                    with self.lock:
                        if self.first_failure is None:
                            self.first_failure = o
                self.on_event(f"{process_name(w, c)} failed ({o.ending}): stopping the job everywhere")
                self.stop.set()
            elif o.failed and o.status != "killed" and self.first_failure is None:
                with self.lock:
                    self.first_failure = o  # its worker's agent reported the killed sibling first
            return False
        if event == "done":
            state = rec.get("state", {})
            origin = state.get("first_failure") or {}
            if origin and self.first_failure is None and "core" in origin:
                with self.lock:
                    if self.first_failure is None:
                        self.first_failure = self.outcome(w, int(origin["core"]))
            for core in state.get("cores", []):
                o = self.outcome(w, int(core["core"]))
                if o.exit_code is None:
                    o.exit_code = core.get("exit_code")
                    o.status = core.get("status", o.status)
            return True
        if event == "failed":
            self._lose(w, f"w{w}: the agent could not start the job: {rec.get('reason')}")
            return True
        return False

    def outcome(self, w: int, c: int) -> CoreOutcome:
        """W's core C, also one the script's spawner made after the start (a host launch's chips)."""
        with self.lock:
            if (w, c) not in self.outcomes:
                self.outcomes[(w, c)] = CoreOutcome(w, c)
            return self.outcomes[(w, c)]

    def run(self) -> None:
        each(self.target.runners, self._worker, name="job")
        self.renderer.flush()


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


def render_summary(run: JobRun) -> None:
    rows = []
    for (w, c), o in sorted(run.outcomes.items()):
        code = "-" if o.exit_code is None else str(o.exit_code)
        rows.append(
            (
                process_name(w, c),
                o.status,
                code,
                f"{o.ended:.1f} s" if o.ended else "-",
                (o.last_lines[-1] if o.last_lines else "")[:60],
            )
        )
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):
        ui.table(f"job {run.job_id}", ["core", "status", "exit", "time", "last line"], rows)


def outcome_code(run: JobRun, interrupted: bool) -> int:
    if run.busy and not run.lost and run.first_failure is None:
        workers = ",".join(f"w{w}" for w in sorted(run.busy))
        ui.err().print(f"error: {run.target.name} is busy on {workers}: {run.busy[min(run.busy)]}", markup=False)
        return ExitCode.USAGE
    if interrupted:
        return ExitCode.INTERRUPTED
    if run.first_failure is not None:
        f = run.first_failure
        tail = "\n".join("    " + line for line in list(f.last_lines))
        hint = hint_for(list(f.last_lines), python=run.python, local=run.target.local)
        ui.err().print(
            f"error: {process_name(f.worker, f.core)} ({run.target.all_workers[f.worker].address}) failed first "
            f"({f.ending}); its last lines:\n{tail}",
            markup=False,
        )
        if hint:
            ui.err().print(f"hint: {hint}", markup=False)
        return ExitCode.PROGRAM_FAILED
    if run.lost:
        for why in run.lost.values():
            ui.err().print(f"error: {why}", markup=False)
        return ExitCode.UNREACHABLE
    failed = [o for o in run.outcomes.values() if o.failed]
    if failed:
        return ExitCode.PROGRAM_FAILED
    return ExitCode.OK


def connect(target: Target) -> None:
    errors = target.connect()
    if errors:
        raise UnreachableError("; ".join(errors[i] for i in sorted(errors)))


def remote_cwd(target: Target, local_dir: Path, dest: str | None) -> str:
    if target.local:
        return str(local_dir)
    return dest or f"~/{local_dir.resolve().name}"


def quote(argv: list[str]) -> str:
    return shlex.join(argv)
