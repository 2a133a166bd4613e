"""Commands of the job runner: train, jobs, logs, cancel."""

from __future__ import annotations

import contextlib
import shlex
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Annotated

import typer

from tpurun import naming, settings, ui
from tpurun.cli import grouped
from tpurun.cli.options import (
    GraceOpt,
    JobArg,
    JobTpuOpt,
    JsonOpt,
    LocalOpt,
    MaxRestartsOpt,
    OnNoticeOpt,
    ProjectOpt,
    RelayOpt,
    RestartsOpt,
    TpuOpt,
    ViaOpt,
    WorkerOpt,
    ZoneOpt,
    parsing,
    relay_flag,
)
from tpurun.cli.output import LineWriter, Renderer, progress_display, skew_table, stacks_report, stop_on_signals
from tpurun.errors import ExitCode, UsageError
from tpurun.job import attempt, control, ends, env_contract, launcher, lifecycle, preflight, stacks, status
from tpurun.job.attempt import OnHang
from tpurun.job.ends import End
from tpurun.job.runtimes import Precision, Runtime
from tpurun.job.stacks import Stacks
from tpurun.job.watch import Waiting
from tpurun.naming import EACH_UP_TO, each_or_by_reason, listed
from tpurun.worker.protocol import JOB_GRACE, Launch, Notice


def _check_inputs(script: str, cores: int | None, core: int | None) -> None:
    path = Path(script)
    if not path.is_file():
        raise UsageError(f"no such script: {script}")
    if path.is_absolute() or ".." in path.parts:
        try:
            path.resolve().relative_to(Path.cwd().resolve())
        except ValueError:
            raise UsageError(
                f"{script} is outside this directory: tpurun syncs the current directory, so run it from "
                "the project that holds the script"
            ) from None
    if cores is not None and core is not None:
        raise UsageError("choose one of --cores and --core")


# train's options
CoresOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Cores (PJRT devices) per worker to run on: 1, or all (default); on the cpu runtime up to the "
        "host's devices (8 on this machine).",
    ),
]
OversubscribeOpt = Annotated[
    bool, typer.Option("--oversubscribe", help="The cpu runtime: allow more --cores than the host has devices.")
]
CoreOpt = Annotated[
    int | None,
    typer.Option(min=0, help="Run on one core (PJRT device) K of each worker, like devices=[5]."),
]
RuntimeOpt = Annotated[
    Runtime,
    typer.Option(
        help="auto: pjrt on a TPU (xrt for torch_xla before 2.1; torchtpu where torch_tpu is installed and "
        "torch_xla is not), cpu where there is none."
    ),
]
LaunchOpt = Annotated[
    Launch | None,
    typer.Option(
        help="host: one process per worker, the script's spawner (xmp.spawn, Lightning, ...) makes one per chip "
        "(default on TPUs). chip: one process per chip with torchrun's variables (default on cpu)."
    ),
]
PrecisionOpt = Annotated[Precision, typer.Option(help="bf16 sets XLA_USE_BF16=1.")]
EnvOpt = Annotated[list[str] | None, typer.Option("--env", help="NAME=VALUE for every core (repeatable).")]
DetachOpt = Annotated[bool, typer.Option("--detach", help="Start and return the job id; `tpurun logs` reattaches.")]
MetricsOpt = Annotated[
    bool, typer.Option("--metrics", help="torch_xla's metrics report of every process that does the work.")
]
ProfileOpt = Annotated[
    bool,
    typer.Option(
        "--profile/--no-profile",
        help="A profiler server in every process of the job, for `tpurun profile` (it costs no step time measured).",
    ),
]
DryRunOpt = Annotated[
    bool,
    typer.Option("--dry-run", help="Print the launch model and each process's command and env; start nothing."),
]
PythonOpt = Annotated[str | None, typer.Option(help="Python on the workers (default python3; here: this one).")]
SetupOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--setup",
        help="A shell command run in the job's directory on every worker before the script, once per content "
        "(repeatable; e.g. 'pip install -r requirements.txt'). A requirements.txt beside the script is "
        "installed on TPU workers without asking.",
    ),
]
DestOpt = Annotated[str | None, typer.Option(help="Where the code goes on the workers (default ~/<dir name>).")]
TpuIpOpt = Annotated[str | None, typer.Option("--tpu-ip", help="xrt on the old TPU Node architecture.")]
DownOpt = Annotated[
    bool,
    typer.Option(
        "--down",
        help="Delete the TPU (and its queued resource) when the job ends, however it ends; for a detached job "
        "(or if tpurun is gone) the TPU's own watchdog does.",
    ),
]

AloneOpt = Annotated[
    str | None,
    typer.Option(
        "--worker",
        "-w",
        metavar="SPEC",
        help="Run on one worker alone, as the single-host slice one host is on its own (its runtime given one "
        "host's bounds, address and worker count: v4-16's worker 1 runs as a v4-8); a SPEC that selects every "
        "worker (all, 0-3 of 4) is the whole TPU.",
    ),
]
HangTimeoutOpt = Annotated[
    str | None,
    typer.Option(
        "--hang-timeout",
        help="When no process has printed a line or changed state for this long (90s, 10m, 1h; 0: never), read "
        "every process's stacks and report them, grouped (then --on-hang). Default 30m; attached jobs only "
        "(`tpurun stacks JOB` for a detached one).",
    ),
]
OnHangOpt = Annotated[
    OnHang,
    typer.Option(
        "--on-hang",
        help="After the report: keep waiting (report), or stop the job and exit 124 (stop).",
    ),
]
BudgetOpt = Annotated[
    str | None,
    typer.Option(
        "--budget",
        metavar="USD",
        help="Stop the job (every worker, exit 125) before its TPU's time costs more than USD at its list price, "
        "restarts included; enforced on the workers, detached too.",
    ),
]
AllowSkewOpt = Annotated[
    bool,
    typer.Option(
        "--allow-skew",
        help="Start even where the workers' Python, jax, jaxlib, libtpu, torch, torch_xla or the packages the "
        "script's requirements.txt names differ (refused by default, with a table of who differs).",
    ),
]


@parsing(context_settings={"ignore_unknown_options": True})
def train_cmd(
    script: Annotated[str, typer.Argument(metavar="SCRIPT", help="The training script (relative to this directory).")],
    args: Annotated[list[str] | None, typer.Argument(metavar="[ARGS]...", help="Arguments for the script.")] = None,
    tpu: TpuOpt = None,
    local: LocalOpt = False,
    project: ProjectOpt = None,
    zone: ZoneOpt = None,
    cores: CoresOpt = None,
    oversubscribe: OversubscribeOpt = False,
    core: CoreOpt = None,
    runtime: RuntimeOpt = Runtime.auto,
    launch: LaunchOpt = None,
    precision: PrecisionOpt = Precision.fp32,
    env: EnvOpt = None,
    detach: DetachOpt = False,
    max_restarts: MaxRestartsOpt = 0,
    restarts: RestartsOpt = "",
    on_notice: OnNoticeOpt = None,
    metrics: MetricsOpt = False,
    profile: ProfileOpt = True,
    dry_run: DryRunOpt = False,
    python: PythonOpt = None,
    setup: SetupOpt = None,
    grace: GraceOpt = JOB_GRACE,
    dest: DestOpt = None,
    tpu_ip: TpuIpOpt = None,
    down: DownOpt = False,
    allow_skew: AllowSkewOpt = False,
    hang_timeout: HangTimeoutOpt = None,
    on_hang: OnHangOpt = OnHang.report,
    worker: AloneOpt = None,
    budget: BudgetOpt = None,
    json_out: JsonOpt = False,
    relay: RelayOpt = None,
    via: ViaOpt = None,
) -> None:
    """Sync this directory and run SCRIPT on every worker (once per worker, or once per chip with --launch chip),
    streaming every chip process's lines."""
    _check_inputs(script, cores, core)
    spec = launcher.TrainSpec(
        script=str(Path(script))
        if not Path(script).is_absolute()
        else str(Path(script).resolve().relative_to(Path.cwd().resolve())),
        args=list(args or []),
        cores=cores,
        core=core,
        runtime=runtime,
        launch=launch,
        precision=precision,
        env=launcher.parse_env(env or []),
        detach=detach,
        max_restarts=max_restarts,
        restarts=restarts,
        on_notice=on_notice,
        metrics=metrics,
        profile=profile,
        dry_run=dry_run,
        python=python,
        setup=list(setup or []),
        grace=grace,
        tpu_ip=tpu_ip,
        down=down,
        oversubscribe=oversubscribe,
        allow_skew=allow_skew,
        hang_timeout=_hang_timeout(hang_timeout, detach),
        on_hang=on_hang,
        worker=worker,
        budget=naming.parse_usd(budget) if budget is not None else 0.0,
    )
    flags = {"tpu": tpu, "project": project, "zone": zone, "relay": relay_flag(relay), "via": via}
    raise typer.Exit(_run(spec, flags, local=local, dest=dest, json_out=json_out))


def _run(
    spec: launcher.TrainSpec, flags: dict[str, str | None], *, local: bool, dest: str | None, json_out: bool
) -> int:
    """Run SPEC on the TPU FLAGS name (--tpu, --project, --zone, else the settings), or on this machine."""
    s = settings.resolve(flags)
    out = TerminalOutput(colour=not ui.is_plain(), quiet=json_out, chatter=ui.state.debug)
    if spec.dry_run:
        job = lifecycle.dry_run(s, spec, local=local, dest=dest, local_dir=Path.cwd(), out=out)
        _notes(job)
        _print_dry_run(job, json_out)
        return ExitCode.OK
    cancel = threading.Event()
    try:
        with stop_on_signals(cancel):
            trained = lifecycle.run(s, spec, local=local, dest=dest, local_dir=Path.cwd(), out=out, cancel=cancel)
    except preflight.VersionSkew as exc:
        skew_table(exc.skew)
        raise
    _render(trained.result, json_out)
    if trained.down is not None:
        _render_down(trained.down)
    return trained.exit_code


def _hang_timeout(text: str | None, detach: bool) -> float:
    """--hang-timeout in seconds: the default for an attached job; refused for a detached one (no one watches)."""
    if text is None:
        return 0.0 if detach else attempt.DEFAULT_HANG_TIMEOUT
    if detach:
        raise UsageError(
            "--hang-timeout watches an attached job; for a detached one, `tpurun stacks JOB` shows where it stands"
        )
    return float(naming.parse_duration(text))


def _render_down(down: lifecycle.Down) -> None:
    """What became of a `--down` job's TPU."""
    if down.to_watchdog:
        ui.info(f"{down.name} will be deleted when job {down.job} ends, by the watchdog on the TPU (--down)")
    elif down.busy:
        ui.warn(f"--down: {down.name} is kept, another job runs on it")
    elif down.error is not None:
        _error(f"error: --down: {down.name} was not deleted: {down.error.message}")
    else:
        ui.info(f"deleted {down.name} (--down)")


WAIT_REPEAT = 30.0  # seconds between repeats of an unchanged "waiting at" line, where it cannot stay live
START_REPEAT = 5.0  # seconds at least between two lines of a start's progress, where it cannot stay live


class TerminalOutput:
    """The launcher's reports on this terminal: the processes' lines on stdout, status lines on stderr."""

    def __init__(self, *, colour: bool, quiet: bool, chatter: bool) -> None:
        live = colour and not quiet and sys.stderr.isatty()
        self.renderer = Renderer(colour=colour, quiet=quiet, chatter=chatter, live=live)
        self.worker_line = LineWriter(colour=colour)
        self.waited: tuple[str, tuple[str, ...]] | None = None  # (point, missing) last said, when not live
        self.waited_said = 0.0
        self.start_said = (-1, time.monotonic())  # (workers started, when) last said
        self.start_text = ""  # the live line while the job starts

    def name_workers(self, names: dict[int, str]) -> None:
        self.renderer.names = self.worker_line.names = names

    def info(self, text: str) -> None:
        self.renderer.above(lambda: ui.info(text))

    def warn(self, text: str) -> None:
        self.renderer.above(lambda: ui.warn(text))

    def notice(self, notice: Notice, worker: str) -> None:
        self.warn(ends.notice_line(notice, worker))

    def hung(self, found: Stacks | None, why: str, quiet: float, stopping: bool) -> None:
        """The job made no progress for QUIET seconds: every process's stacks (FOUND; WHY none), on stderr."""
        then = "stopping the job (--on-hang stop)" if stopping else "still waiting (--on-hang report)"
        head = f"no process has printed a line or changed state for {ui.age(quiet)}: {then}"
        if found is None:
            self.warn(f"{head}; no stacks: {why}")
            return

        def report() -> None:
            ui.warn(f"{head}; where every process stands:")
            with contextlib.redirect_stdout(sys.stderr):
                stacks_report(found)
            ui.info(f"the whole dump: {found.path}")

        self.renderer.above(report)

    def waiting(self, waiting: Waiting | None) -> None:
        """Who the job's processes wait for: the live line on a terminal; else a status line when it changes,
        and every WAIT_REPEAT seconds while it lasts."""
        if self.renderer.live:
            self.renderer.set_status(self.start_text if waiting is None else f"tpurun: {waiting.text()}")
            return
        key = None if waiting is None else (waiting.at, tuple(m.name for m in waiting.missing))
        again = waiting is not None and time.monotonic() - self.waited_said > WAIT_REPEAT
        if key == self.waited and not again:
            return
        if waiting is not None:
            self.info(waiting.text())
        elif self.waited is not None:
            self.info(f"no longer waiting at {self.waited[0]}")
        self.waited, self.waited_said = key, time.monotonic()

    def starting(self, started: int, workers: int) -> None:
        """How far the job's start has come, on more than a few workers (the lines say it on a few): the live
        line on a terminal; else a line when it changed, at most every START_REPEAT seconds; then once that
        every worker has started, where its progress was said."""
        said, when = self.start_said
        if workers <= EACH_UP_TO or started == said:
            return
        if started >= workers:
            self.start_text = ""
            if self.renderer.live:
                self.renderer.set_status("")
            if said >= 0:
                self.info(f"started on every worker ({workers:,})")
            self.start_said = (started, time.monotonic())
            return
        text = f"starting: the job has started on {started:,} of {workers:,} workers"
        if self.renderer.live:
            self.start_text = f"tpurun: {text}"
            self.renderer.set_status(self.start_text)
        elif time.monotonic() - when >= START_REPEAT:
            self.info(text)
        else:
            return
        self.start_said = (started, time.monotonic())

    def lines(self, worker: int, lines: list[tuple[int, str]]) -> None:
        self.renderer.lines(worker, lines)

    def flush(self) -> None:
        self.renderer.flush()

    def progress(self) -> AbstractContextManager[Callable[[str], None]]:
        return progress_display()

    def down(self, down: lifecycle.Down) -> None:
        _render_down(down)


def _notes(job: launcher.Job) -> None:
    for kind, text in job.notes():
        (ui.warn if kind == "warn" else ui.info)(text)


def _print_dry_run(job: launcher.Job, json_out: bool) -> None:
    shown = job.dry_run()
    if json_out:
        ui.print_json(shown)
        return
    print(shown["launch_reason"])
    if job.setup:
        print(f"setup (key {job.setup.key}, skipped where it ran before): {job.setup.describe()}")
    for row in shown["processes"]:
        print(f"[{row['name']}] {row['address']}: {shlex.join(row['command'])}")
        for k, v in sorted(row["env"].items()):
            print(f"    {k}={v}")


def _error(text: str) -> None:
    ui.err().print(text, markup=False)


def _render(result: launcher.JobResult, json_out: bool) -> None:
    """What the job's end means for the user: messages on stderr, the summary (its exit code is the result's)."""
    job, run, end = result.job, result.run, result.end
    if run is None:  # it ended in its setup: the job did not start
        _render_setup(result)
        return
    if result.busy:
        workers = listed([job.target.all_workers[w].name for w in sorted(run.busy)], ",")
        _error(f"error: {job.target.name} is busy on {workers}: {run.busy[min(run.busy)]}")
    elif job.spec.detach and run.unreachable:  # a worker could not be reached to start it there
        _unreachable(job, run)
    elif end is None:  # --detach: started and left running
        if json_out:
            ui.print_json({"job_id": job.job_id, "detached": True, "logs": _logs_where(job)})
        else:
            print(job.job_id)
        ui.info(f"detached: `tpurun logs {job.job_id} --follow` to watch, `tpurun cancel {job.job_id}` to stop")
    else:
        _render_ended(result, end, json_out)


def _render_setup(result: launcher.JobResult) -> None:
    """A job that ended in its setup: why it did not start."""
    job = result.job
    if result.end is End.STOPPED:
        _error("error: interrupted during setup; the job did not start")
        return
    assert result.setup is not None and result.setup.failed is not None
    bad = result.setup.failed
    w = job.target.all_workers[bad.worker]
    if bad.error:
        _error(f"error: setup could not run on {w.label()}: {bad.error}")
        return
    tail = "\n".join("    " + line for line in result.setup.last_lines.get(bad.worker, [])) or "    (no output)"
    _error(
        f"error: setup failed on {w.label()} (exit code {bad.exit_code}); the job did not start; its last lines:\n{tail}"
    )


def _logs_where(job: launcher.Job) -> dict[str, str]:
    """Where a job's lines are, for --json (which prints none of them): the command that shows them, and the
    directory of its log files on each worker."""
    return {"command": f"tpurun logs {job.job_id}", "files": f"~/.tpurun/jobs/{job.job_id}/ on each worker"}


def _render_ended(result: launcher.JobResult, end: End, json_out: bool) -> None:
    """An attached job that ran: every process's end (the summary, or --json), then why it did not succeed."""
    job, run = result.job, result.run
    assert run is not None
    if json_out:
        ui.print_json(
            {
                "job_id": job.job_id,
                "end": end.value,
                "exit_code": int(result.exit_code),
                "detail": run.failure_detail() if end is End.FAILED else "",
                "restarts": result.budgets.to_dict() if result.budgets else {},
                "budget": result.spend.usd if result.spend else None,
                "cost": round(result.cost, 6) if result.cost is not None else None,
                "notice": run.notice.to_dict() if run.notice else None,
                "logs": _logs_where(job),
                "cores": [
                    {"worker": o.worker, "core": o.slot, "status": o.shown_status, "exit_code": o.exit_code}
                    for o in sorted(run.outcomes.values(), key=lambda o: (o.worker, o.slot))
                ],
            }
        )
    else:
        _summary(run)
        if result.cost is not None:
            ui.info(f"cost: {ui.usd(result.cost)} of {job.target.name}'s time at list price (`tpurun cost` has them all)")
    if end is End.BUDGET and result.spend is not None:
        _error(f"error: {result.spend.spent_line(job.job_id)}")
    elif end is End.HUNG:
        _error(
            f"error: job {job.job_id} made no progress for {ui.age(job.spec.hang_timeout)} and was "
            "stopped (--on-hang stop); its stacks are above"
        )
    elif end is End.FAILED and run.first_failure is not None:
        f = run.first_failure
        tail = "\n".join("    " + line for line in list(f.last_lines))
        _error(
            f"error: {env_contract.process_name(f.worker, f.slot, job.target.all_workers[f.worker].name)} "
            f"({job.target.all_workers[f.worker].address}) failed first "
            f"({f.ending}); its last lines:\n{tail}"
        )
        hint = launcher.hint_for(list(f.last_lines), python=run.python, local=job.target.local)
        if hint:
            _error(f"hint: {hint}")
    elif end.cut_short:
        _say_end(result, end)
    elif end is End.FAILED:
        _unreachable(job, run)


def _say_end(result: launcher.JobResult, end: End) -> None:
    """Why the infrastructure ended the job (preemption, maintenance, a lost worker), the workers it lost, and
    its restart budget's state."""
    run = result.run
    assert run is not None
    notice = run.notice
    heard = f" (notice: {notice.detail})" if notice is not None and notice.detail else ""
    _error(f"error: job {result.job.job_id} on {result.job.target.name} ended ({end}): {end.describe()}{heard}")
    if end is End.LOST:  # which workers; a preempted or maintained TPU's are all of its hosts that went
        _unreachable(result.job, run)
    budgets = result.budgets
    if budgets is None or not budgets.limit(end):
        _error(f"hint: {ends.hint(end)}")
    else:
        _error(f"error: the {end.cause} restart budget is used up ({budgets.left(end)})")


def _unreachable(job: launcher.Job, run: attempt.JobRun) -> None:
    """Why workers could not be reached: a line each for a few, else each reason once with the workers alike."""
    failures = [(job.target.all_workers[w].name, why) for w, why in sorted(run.unreachable.items())]
    for line in each_or_by_reason(failures):
        _error(f"error: {line}")


def _summary(run: attempt.JobRun) -> None:
    ended = [
        (
            env_contract.process_name(w, slot, run.target.all_workers[w].name),
            o.shown_status,
            o.exit_code,
            o.ended,
            o.last_lines[-1] if o.last_lines else "",
        )
        for (w, slot), o in sorted(run.outcomes.items())
    ]
    grouped.processes(f"job {run.job_id}", ended)


# ---------------------------------------------------------------------------- jobs, logs, cancel


def jobs_cmd(
    tpu: Annotated[str | None, typer.Option("--tpu", help="Only the jobs of this TPU.")] = None,
    project: Annotated[str | None, typer.Option("--project", help="Only the jobs of TPUs in this project.")] = None,
    zone: Annotated[str | None, typer.Option("--zone", help="Only the jobs of TPUs in this zone.")] = None,
    prune: Annotated[
        bool, typer.Option("--prune", help="Forget the jobs of TPUs that no longer exist (after showing them).")
    ] = False,
    json_out: JsonOpt = False,
    relay: RelayOpt = None,
    via: ViaOpt = None,
) -> None:
    """Jobs started with `train` (attached and detached), each with its state over every worker: a failure on
    any worker is failed, naming it; a job whose TPU was deleted is gone."""
    rows = status.jobs(
        settings.resolve({"relay": relay_flag(relay), "via": via}), tpu, project=project, zone=zone, prune=prune
    )
    if json_out:
        ui.print_json([row.to_dict() for row in rows])
        return
    ui.table(
        None,
        ["job", "tpu", "status", "created", "detached", "cost", "command"],
        [
            (
                row.record.job_id,
                row.record.tpu,
                row.state.label(),
                row.record.created,
                "yes" if row.record.detached else "no",
                ui.usd(row.record.cost()),
                " ".join(row.record.command),
            )
            for row in rows
        ],  # fmt: skip
    )
    gone = sum(1 for row in rows if row.state.gone)
    if prune and gone:
        ui.info(f"forgot {gone} job(s) of TPUs that no longer exist")
    elif gone:
        ui.info(f"{gone} job(s) ran on TPUs that no longer exist: `tpurun jobs --prune` forgets them")


def logs_cmd(
    job: JobArg,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until the job ends.")] = False,
    worker: WorkerOpt = "all",
    tail: Annotated[
        int | None,
        typer.Option("--tail", min=0, help="Only the last N lines of each process so far (then --follow goes on)."),
    ] = None,
    tpu: JobTpuOpt = None,
    relay: RelayOpt = None,
    via: ViaOpt = None,
) -> None:
    """Every line of every core of a job, from the per-core files on the workers (reattaches to detached jobs)."""
    s = settings.resolve({"relay": relay_flag(relay), "via": via})
    out = TerminalOutput(colour=not ui.is_plain(), quiet=False, chatter=ui.state.debug)
    stop = threading.Event()
    with stop_on_signals(stop):
        result = control.logs(s, job, out, stop, worker=worker, follow=follow, tail=tail, tpu=tpu)
    if not result.interrupted:
        for line in each_or_by_reason([(name, f"{name}: {why}") for name, why in result.errors.items()]):
            _error(f"error: {line}")
        if result.errors and not result.missing:
            if result.notice is not None and result.ended is None:  # why a worker may be gone now
                ui.warn(ends.notice_line(result.notice, naming.worker_name(result.notice.worker)))
            _error("hint: every other worker's lines are above; `--worker` reads the workers you choose")
    if result.ended is not None and not result.interrupted:
        _say_ended(job, result.ended)
    raise typer.Exit(result.exit_code)


def _say_ended(job: str, ended: status.JobSummary) -> None:
    """How a job ended, said on stderr where it did not finish (as `jobs` says it); the notice of a host event it
    got, if one came."""
    if ended.notice is not None:
        ui.warn(ends.notice_line(ended.notice, naming.worker_name(ended.notice.worker)))
    end = ended.end
    if end is None or end is End.FINISHED:
        return
    if end is End.FAILED:
        _error(f"error: job {job} failed: {ended.detail} failed first")
    else:
        detail = f" ({ended.detail})" if ended.detail else ""
        _error(f"error: job {job} ended ({end}): {end.describe()}{detail}")
    if ended.running:
        _error(f"hint: `tpurun cancel {job}` stops what of it still runs")


def cancel_cmd(
    job: JobArg,
    grace: GraceOpt = JOB_GRACE,
    tpu: JobTpuOpt = None,
    relay: RelayOpt = None,
    via: ViaOpt = None,
) -> None:
    """Stop a job on every worker; returns when none of its processes is left."""
    result = control.cancel(settings.resolve({"relay": relay_flag(relay), "via": via}), job, grace, tpu=tpu)
    if result.end is not None:
        ui.info(f"job {job} had already ended ({result.end}): nothing to stop")
        return
    if result.missing:
        missing = listed(result.missing)
        ui.warn(f"job {job} is not on {missing}: it never started there, or its files were removed")
    if not result.stopped:
        states = ", ".join(sorted({st.value for st in result.ended.values()}))
        where = "every other worker" if result.missing else "every worker"
        ui.info(f"job {job} had already ended ({states}) on {where}: nothing to stop")
    elif result.ended:
        ui.info(f"job {job} stopped on {result.stopped} worker(s); it had already ended on {len(result.ended)}")
    else:
        ui.info(f"job {job} stopped on {result.stopped} worker(s)")


def stacks_cmd(
    job: Annotated[
        str | None,
        typer.Argument(metavar="[JOB]", help="The job (default: the newest started from here on the TPU)."),
    ] = None,
    worker: WorkerOpt = "all",
    json_out: JsonOpt = False,
    relay: RelayOpt = None,
    via: ViaOpt = None,
) -> None:
    """The stack of every thread of every process of a job on every worker, at once: grouped by where each
    process's main thread stands, the odd ones out first; the whole dump kept on disk."""
    s = settings.resolve({"relay": relay_flag(relay), "via": via})
    found = stacks.collect(s, job, worker=worker)
    over = not found.groups and not found.unread
    if json_out:
        ui.print_json(found.to_json())
    elif not over:
        stacks_report(found)
    for line in each_or_by_reason([(name, f"{name}: {why}") for name, why in found.errors.items()]):
        _error(f"error: {line}")
    if over and not found.errors:  # not a mistake: the answer is that nothing of the job runs
        ui.info(
            f"job {found.job_id} has no process left on the workers asked: it has ended (`tpurun jobs` says how, "
            f"`tpurun logs {found.job_id}` what it printed)"
        )
        return
    ui.info(f"the whole dump: {found.path}")
    raise typer.Exit(found.exit_code)
