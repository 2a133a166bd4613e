"""Commands of the job runner: train, jobs, logs, cancel."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from tpurun import config, settings, ui
from tpurun.cli.options import JsonOpt, LocalOpt, TpuOpt, parsing
from tpurun.cli.output import LineWriter, stop_on_signals
from tpurun.errors import ExitCode, TpurunError, UnreachableError, UsageError
from tpurun.job import launcher as train
from tpurun.job import plan as envc
from tpurun.job import setup as job_setup
from tpurun.topology import parse_accelerator_type
from tpurun.transport import targets
from tpurun.transport.runner import each, open_stream, run_capture
from tpurun.worker import bundle_name

RUNTIMES = ("auto", "pjrt", "xrt", "cpu")


def _check_inputs(script: str, cores: int | None, core: int | None, runtime: str, precision: str) -> None:
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
    if cores is not None and cores < 1:
        raise UsageError(f"--cores {cores}: must be at least 1")
    if core is not None and core < 0:
        raise UsageError(f"--core {core}: must be 0 or more")
    if cores is not None and core is not None:
        raise UsageError("choose one of --cores and --core")
    if runtime not in RUNTIMES:
        raise UsageError(f"--runtime {runtime}: use one of {', '.join(RUNTIMES)}")
    if precision not in ("32", "bf16"):
        raise UsageError(f"--precision {precision}: use 32 or bf16")


@parsing(context_settings={"ignore_unknown_options": True})
def train_cmd(
    script: Annotated[str, typer.Argument(help="The training script (relative to this directory).")],
    args: Annotated[list[str] | None, typer.Argument(help="Arguments for the script.")] = None,
    tpu: TpuOpt = None,
    local: LocalOpt = False,
    cores: Annotated[
        int | None, typer.Option(help="Processes per worker: 1, or all (default) per the runtime.")
    ] = None,
    core: Annotated[int | None, typer.Option(help="Run on one specific core index (like devices=[5]).")] = None,
    runtime: Annotated[str, typer.Option(help="auto, pjrt, xrt or cpu.")] = "auto",
    launch: Annotated[
        envc.Launch | None,
        typer.Option(
            help="host: one process per worker, the script's spawner (xmp.spawn, Lightning, ...) makes one per chip "
            "(default on TPUs). chip: one process per chip with torchrun's variables (default on cpu)."
        ),
    ] = None,
    precision: Annotated[str, typer.Option(help="32 or bf16 (sets XLA_USE_BF16=1).")] = "32",
    env: Annotated[list[str] | None, typer.Option("--env", help="NAME=VALUE for every core (repeatable).")] = None,
    detach: Annotated[
        bool, typer.Option("--detach", help="Start and return the job id; `tpurun logs` reattaches.")
    ] = False,
    max_restarts: Annotated[int, typer.Option(help="Recreate a preempted node and relaunch, up to N times.")] = 0,
    metrics: Annotated[
        bool, typer.Option("--metrics", help="torch_xla's metrics report of every process that does the work.")
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Print the launch model and each process's command and env; start nothing."),
    ] = False,
    python: Annotated[str | None, typer.Option(help="Python on the workers (default python3; here: this one).")] = None,
    setup: Annotated[
        list[str] | None,
        typer.Option(
            "--setup",
            help="A shell command run in the job's directory on every worker before the script, once per content "
            "(repeatable; e.g. 'pip install -r requirements.txt'). A requirements.txt beside the script is "
            "installed on TPU workers without asking.",
        ),
    ] = None,
    grace: Annotated[float, typer.Option(help="Seconds between SIGTERM and SIGKILL when stopping.")] = 5.0,
    dest: Annotated[str | None, typer.Option(help="Where the code goes on the workers (default ~/<dir name>).")] = None,
    tpu_ip: Annotated[str | None, typer.Option("--tpu-ip", help="xrt on the old TPU Node architecture.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Sync this directory and run SCRIPT on every worker (once per worker, or once per chip with --launch chip),
    streaming every chip process's lines."""
    _check_inputs(script, cores, core, runtime, precision)
    if max_restarts < 0:
        raise UsageError("--max-restarts must be 0 or more")
    spec = train.TrainSpec(
        script=str(Path(script))
        if not Path(script).is_absolute()
        else str(Path(script).resolve().relative_to(Path.cwd().resolve())),
        args=list(args or []),
        cores=cores,
        core=core,
        runtime=runtime,
        launch=launch.value if launch else None,
        precision=precision,
        env=train.parse_env(env or []),
        detach=detach,
        max_restarts=max_restarts,
        metrics=metrics,
        dry_run=dry_run,
        python=python,
        setup=list(setup or []),
        grace=grace,
        tpu_ip=tpu_ip,
    )
    s = settings.resolve({"tpu": tpu})
    code = run_training(spec, tpu=tpu, local=local, dest=dest, json_out=json_out, home=s.home_path)
    raise typer.Exit(code)


def run_training(
    spec: train.TrainSpec, *, tpu: str | None, local: bool, dest: str | None, json_out: bool, home: Path
) -> int:
    restarts = 0
    while True:
        target = targets.resolve(tpu=tpu, local=local)
        try:
            result = _attempt(spec, target, restarts, dest=dest, json_out=json_out, home=home)
        finally:
            target.close()
        if result != "preempted":
            return int(result)
        if restarts >= spec.max_restarts:
            ui.err().print(
                f"error: {target.name} was preempted and --max-restarts {spec.max_restarts} is used up", markup=False
            )
            return ExitCode.UNREACHABLE
        restarts += 1
        ui.info(f"restart {restarts}/{spec.max_restarts}: recreating {target.name}")
        _recreate(target.name)


def _recreate(name: str) -> None:
    from tpurun.cli.output import progress_display
    from tpurun.cloud import provision
    from tpurun.cloud.client import Cloud

    s = settings.resolve({})
    cloud = Cloud(s)
    targets.forget_node(s.home_path, cloud.project, cloud.zone, name)
    with progress_display() as progress:
        provision.recreate(cloud, s, name, progress)


def _attempt(
    spec: train.TrainSpec, target: targets.Target, restart: int, *, dest: str | None, json_out: bool, home: Path
) -> int | str:
    job_id = train.new_job_id()
    if spec.runtime == "auto" or not spec.dry_run:
        train.connect(target)  # a dry run with an explicit runtime needs no worker at all
    plan = train.plan(target, spec, job_id, restart_count=restart)
    specs = plan.specs
    where = "this machine" if target.local else f"{target.name} ({len(target.all_workers)} workers)"
    ui.info(
        f"job {job_id}: {where}, runtime {plan.runtime} ({plan.runtime_reason}); {plan.launch_reason}; "
        f"{plan.processes} process(es) started by tpurun"
    )
    if plan.runtime == "cpu" and plan.processes > 1:
        ui.info(
            f"note: {plan.processes} CPU processes are {plan.processes} separate XLA worlds (torch_xla has no "
            "cross-process collectives on CPU); a script reduces across them with torch.distributed gloo "
            "(docs/train.md)"
        )
    if spec.core is not None and target.accelerator_type:
        ui.info(envc.explain_core(parse_accelerator_type(target.accelerator_type), spec.core))
    if spec.precision == "bf16":
        ui.warn("XLA_USE_BF16 is deprecated in recent torch_xla; prefer explicit bfloat16 dtypes in the model")
    python = train.worker_python(target, spec)
    cwd = str(Path.cwd()) if target.local else (dest or f"~/{Path.cwd().resolve().name}")
    setup = job_setup.plan(
        spec.setup, script=spec.script, python=python, cwd=cwd, local_dir=Path.cwd(), on_tpu=not target.local
    )
    if spec.dry_run:
        rows = train.dry_run_rows(target, specs)
        if json_out:
            ui.print_json(
                {
                    "job_id": job_id,
                    "runtime": plan.runtime,
                    "reason": plan.runtime_reason,
                    "launch": plan.launch,
                    "launch_reason": plan.launch_reason,
                    "processes": rows,
                    "setup": {"commands": list(setup.commands), "key": setup.key} if setup else None,
                }
            )
        else:
            print(plan.launch_reason)
            if setup:
                print(f"setup (key {setup.key}, skipped where it ran before): {setup.describe()}")
            for row in rows:
                name = train.process_name(row["worker"], envc.HOST if row["core"] is None else row["core"])
                print(f"[{name}] {row['address']}: {train.quote(row['command'])}")
                for k, v in sorted(row["env"].items()):
                    print(f"    {k}={v}")
        return ExitCode.OK
    if not target.local:
        _sync_code(target, cwd, home)
    if setup:
        failed = _run_setup(target, setup, cwd=cwd, python=python, grace=spec.grace)
        if failed:
            return failed
    record = train.JobRecord(
        job_id=job_id,
        tpu=target.name,
        workers=[r.worker.index for r in target.runners],
        cores={w: [c.core for c in per] for w, per in enumerate(specs)},
        created=time.strftime("%Y-%m-%dT%H:%M:%S"),
        detached=spec.detach,
        command=[spec.script, *spec.args],
        python=python,
    )
    record.save(home)
    topo = parse_accelerator_type(target.accelerator_type) if target.accelerator_type else None
    renderer = train.Renderer(colour=not ui.is_plain(), quiet=json_out, chatter=ui.state.debug)
    run = train.JobRun(
        target,
        job_id,
        specs,
        renderer,
        cwd=cwd,
        python=python,
        detach=spec.detach,
        grace=spec.grace,
        pre=lambda w: envc.pre_commands(topo, plan.runtime, w, python),
        launch=plan.launch,
        on_event=ui.info,
    )
    with stop_on_signals(run.stop) as seen:
        run.run()
    if run.busy and not run.lost:
        return train.outcome_code(run, False)  # refused: another job runs there; nothing was started
    if spec.detach:
        if run.lost:
            return train.outcome_code(run, False)
        if json_out:
            ui.print_json({"job_id": job_id, "detached": True})
        else:
            print(job_id)
        ui.info(f"detached: `tpurun logs {job_id} --follow` to watch, `tpurun cancel {job_id}` to stop")
        return ExitCode.OK
    if run.lost and not seen["interrupted"] and run.first_failure is None and _preempted(target):
        if spec.max_restarts:
            ui.warn(f"{target.name} was preempted while job {job_id} ran")
            return "preempted"
        ui.err().print(
            f"error: {target.name} was preempted while job {job_id} ran: its processes are gone on every worker "
            "(--max-restarts 0)",
            markup=False,
        )
        ui.err().print(
            "hint: `tpurun train ... --max-restarts N` recreates a preempted node and relaunches the job", markup=False
        )
        return ExitCode.UNREACHABLE
    if json_out:
        ui.print_json(
            {
                "job_id": job_id,
                "cores": [
                    {"worker": o.worker, "core": o.core, "status": o.status, "exit_code": o.exit_code}
                    for o in sorted(run.outcomes.values(), key=lambda o: (o.worker, o.core))
                ],
            }
        )
    else:
        train.render_summary(run)
    return train.outcome_code(run, seen["interrupted"])


def _run_setup(target: targets.Target, setup: job_setup.Setup, *, cwd: str, python: str, grace: float) -> int:
    """Run the job's setup where it has not run before; 0, or the exit code that ends the job."""
    stop = threading.Event()
    started = time.monotonic()

    def announce(todo: list[int], skipped: list[int]) -> None:
        if skipped:
            ui.info(f"setup: unchanged on {len(skipped)} worker(s), skipped")
        if todo:
            ui.info(f"setup on {len(todo)} worker(s): {setup.describe()}")

    with stop_on_signals(stop) as seen:
        res = job_setup.run(
            target.runners,
            setup,
            cwd=cwd,
            python=python,
            sink=LineWriter(colour=not ui.is_plain()),
            stop=stop,
            grace=grace,
            on_start=announce,
        )
    if seen["interrupted"]:
        ui.err().print("error: interrupted during setup; the job did not start", markup=False)
        return ExitCode.INTERRUPTED
    bad = res.failed
    if bad is not None:
        w = target.all_workers[bad.worker]
        if bad.error:
            raise UnreachableError(f"setup could not run on {w.label()}: {bad.error}")
        tail = "\n".join("    " + line for line in res.last_lines.get(bad.worker, [])) or "    (no output)"
        ui.err().print(
            f"error: setup failed on {w.label()} (exit code {bad.exit_code}); the job did not start; its last "
            f"lines:\n{tail}",
            markup=False,
        )
        return ExitCode.PROGRAM_FAILED
    if res.ran:
        ui.info(f"setup done on {len(res.ran)} worker(s) in {time.monotonic() - started:.1f} s")
    return ExitCode.OK


def _preempted(target: targets.Target) -> bool:
    if target.local:
        return False
    from tpurun.cloud.client import Cloud
    from tpurun.cloud.provision import STATE

    # the API may report the preemption a little after the workers vanished: look for a while
    deadline = time.monotonic() + config.PREEMPT_CHECK.number()
    while True:
        try:
            node = Cloud(settings.resolve({})).find_node(target.name)
        except TpurunError:
            return False
        if node is None or STATE(node.state).name in ("PREEMPTED", "TERMINATED"):
            return True
        if STATE(node.state).name != "READY" or time.monotonic() > deadline:
            return False
        time.sleep(1.0)


def _sync_code(target: targets.Target, dest: str, home: Path) -> None:
    """This directory to DEST on every worker (incremental: unchanged files cost nothing)."""
    from tpurun.sync import sender as sync

    src = Path.cwd()
    started = time.monotonic()
    manifest = sync.build_manifest(src, cache_dir=home / "sync-cache")
    stats = sync.sync(target.runners, src, dest, manifest=manifest)
    failed = [st for st in stats if st.error or st.errors]
    if failed:
        raise UnreachableError(
            "could not sync the code: "
            + "; ".join(f"w{st.worker} ({st.address}): {st.error or st.errors[0]}" for st in failed)
        )
    sent = sum(st.files_sent for st in stats)
    ui.info(
        f"synced {src} to {dest} on {len(stats)} worker(s): {sent} file(s) sent in {time.monotonic() - started:.1f} s"
    )


# ---------------------------------------------------------------------------- jobs, logs, cancel


def _record_target(record: train.JobRecord) -> targets.Target:
    if record.tpu == "local":
        return targets.resolve(tpu=None, local=True, announce=False)
    spec = ",".join(str(w) for w in record.workers)
    return targets.resolve(tpu=record.tpu, local=False, worker_spec=spec, announce=False)


def _agent_argv(record: train.JobRecord, *args: str) -> list[str]:
    script = 'p=$1; a=$2; shift 2; exec "$p" "$HOME/.tpurun/bin/$a/agent.py" "$@"'
    return ["sh", "-c", script, "tpurun", record.python, bundle_name(), *args]


def jobs_cmd(tpu: TpuOpt = None, json_out: JsonOpt = False) -> None:
    """Jobs started with `train` (attached and detached), with their state on worker 0."""
    s = settings.resolve({"tpu": tpu})
    records = [r for r in train.list_records(s.home_path) if not tpu or r.tpu == tpu]
    rows: list[dict[str, Any]] = []
    for r in records:
        status = "unknown"
        try:
            target = _record_target(r)
            try:
                train.connect(target)
                rc, out, _ = run_capture(target.runners[0], _agent_argv(r, "state", r.job_id), timeout=30)
                if rc == 0:
                    status = json.loads(out.decode()).get("status", "unknown")
            finally:
                target.close()
        except TpurunError as exc:
            status = f"unknown: {exc.message}"  # whole: a table wraps it between words
        rows.append(
            {
                "job_id": r.job_id,
                "tpu": r.tpu,
                "status": status,
                "created": r.created,
                "detached": r.detached,
                "command": " ".join(r.command),
            }
        )
    if json_out:
        ui.print_json(rows)
        return
    ui.table(
        None,
        ["job", "tpu", "status", "created", "detached", "command"],
        [
            (d["job_id"], d["tpu"], d["status"], d["created"], "yes" if d["detached"] else "no", d["command"])
            for d in rows
        ],
    )


def logs_cmd(
    job: Annotated[str, typer.Argument(help="Job id (from `tpurun jobs`).")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until the job ends.")] = False,
) -> None:
    """Every line of every core of a job, from the per-core files on the workers (reattaches to detached jobs)."""
    s = settings.resolve({})
    record = train.JobRecord.load(s.home_path, job)
    target = _record_target(record)
    renderer = train.Renderer(colour=not ui.is_plain(), chatter=ui.state.debug)
    offsets: dict[int, dict[int, int]] = {w: {} for w in record.workers}
    stop = threading.Event()
    done: set[int] = set()
    errors: dict[int, str] = {}
    replay: list[tuple[float, int, int, int, str]] = []  # (time, worker, core, offset, line)
    replay_lock = threading.Lock()
    try:
        train.connect(target)

        def one(runner: Any) -> None:
            w = runner.worker.index
            attempts = 0
            while w not in done and not stop.is_set():
                args = ["stream", job, "--offsets", json.dumps(offsets[w])]
                if follow:
                    args.append("--follow")
                try:
                    stream = open_stream(runner, _agent_argv(record, *args))
                    buf = b""
                    while True:
                        data = stream.read(0.2)
                        if stop.is_set():
                            stream.kill()  # a viewer only ends its own stream: the job goes on
                            return
                        if data is None:
                            break
                        buf += data
                        *lines, buf = buf.split(b"\n")
                        for raw in lines:
                            rec = json.loads(raw)
                            if rec.get("event") == "done":
                                done.add(w)
                            elif rec.get("event") is None:
                                if follow:
                                    renderer.line(w, rec["c"], rec.get("l", ""))
                                else:  # a replay: every worker's lines first, then in time order
                                    with replay_lock:
                                        replay.append((float(rec.get("t", 0)), w, rec["c"], rec["o"], rec.get("l", "")))
                                offsets[w][rec["c"]] = rec["o"]
                    rc = stream.wait()
                    if rc == 2:
                        errors[w] = stream.stderr_text().strip() or f"job {job} is not on w{w}"
                        return
                    if not follow:
                        return
                except (OSError, EOFError, TpurunError) as exc:
                    attempts += 1
                    if attempts > 5:
                        errors[w] = str(exc)
                        return
                    # reconnect and resume from the offsets already printed: no line lost, none twice
                    time.sleep(1)
                    try:
                        runner.close()
                        train.connect(
                            targets.Target(
                                target.name, target.accelerator_type, [runner], target.all_workers, target.local
                            )
                        )
                    except TpurunError:
                        continue

        with stop_on_signals(stop):
            each(target.runners, one, name="logs")
        for _, w, c, _, line in sorted(replay):
            renderer.line(w, c, line)
        renderer.flush()
    finally:
        target.close()
    if stop.is_set():
        raise typer.Exit(ExitCode.INTERRUPTED)
    for w, e in sorted(errors.items()):
        ui.err().print(f"error: w{w}: {e}", markup=False)
    if errors:
        raise typer.Exit(ExitCode.UNREACHABLE if not any("not" in e for e in errors.values()) else ExitCode.USAGE)


def cancel_cmd(
    job: Annotated[str, typer.Argument(help="Job id.")],
    grace: Annotated[float, typer.Option(help="Seconds between SIGTERM and SIGKILL.")] = 5.0,
) -> None:
    """Stop a job on every worker; returns when none of its processes is left."""
    s = settings.resolve({})
    record = train.JobRecord.load(s.home_path, job)
    target = _record_target(record)
    failures = []
    try:
        train.connect(target)
        results: dict[int, tuple[int, str]] = {}
        before: dict[int, str] = {}  # worker -> the job's status there when the stop came

        def one(runner: Any) -> None:
            rc, out, err = run_capture(
                runner, _agent_argv(record, "stop", job, "--grace", str(grace)), timeout=grace + 120
            )
            try:
                before[runner.worker.index] = str(json.loads(out.decode()).get("status_before_stop", ""))
            except ValueError:
                pass
            results[runner.worker.index] = (rc, err)

        each(target.runners, one, name="cancel")
        failures = [f"w{w}: {err.strip() or rc}" for w, (rc, err) in sorted(results.items()) if rc != 0]
    finally:
        target.close()
    if failures:
        raise UnreachableError("could not stop the job everywhere: " + "; ".join(failures))
    ended = {w: st for w, st in before.items() if st in ("finished", "stopped", "failed")}
    stopped = len(target.runners) - len(ended)
    if not stopped:
        states = ", ".join(sorted(set(ended.values())))
        ui.info(f"job {job} had already ended ({states}) on every worker: nothing to stop")
    elif ended:
        ui.info(f"job {job} stopped on {stopped} worker(s); it had already ended on {len(ended)}")
    else:
        ui.info(f"job {job} stopped on {stopped} worker(s)")
