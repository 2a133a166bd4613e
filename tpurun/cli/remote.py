"""Commands that reach the workers: exec and ssh (the third, sync, has its own module: cli/sync.py)."""

from __future__ import annotations

import os
import sys
import threading
from typing import Annotated

import typer

from tpurun import remote, settings, targets, ui
from tpurun.cli.options import GraceOpt, LocalOpt, ProjectOpt, TpuOpt, WorkerOpt, ZoneOpt, parsing
from tpurun.cli.output import LineWriter, stop_on_signals, summarize
from tpurun.errors import TpurunError, UsageError


@parsing(context_settings={"allow_interspersed_args": False})
def exec_cmd(
    command: Annotated[
        list[str], typer.Argument(metavar="-- CMD [ARGS]...", help="Passed exactly, never through a shell.")
    ],
    tpu: TpuOpt = None,
    local: LocalOpt = False,
    project: ProjectOpt = None,
    zone: ZoneOpt = None,
    worker: WorkerOpt = "all",
    fail_fast: Annotated[bool, typer.Option("--fail-fast", help="Stop every worker at the first failure.")] = False,
    grace: GraceOpt = remote.RUN_GRACE,
) -> None:
    """Run a command on every selected worker at once, lines prefixed \\[wN]."""
    if not command:
        raise UsageError("give a command after --, e.g. `tpurun exec -- hostname`")
    s = settings.resolve({"tpu": tpu, "project": project, "zone": zone})
    target = targets.resolve(s, local=local, worker_spec=worker, announce=ui.info)
    one = target.alone
    if one is not None:
        name = target.runners[0].worker.name
        ui.info(f"{name} alone: its runtime sees the {one.name} single-host slice it is on its own (docs/remote.md)")
    writer = LineWriter(colour=not ui.is_plain(), names=target.worker_names)
    stop = threading.Event()

    def unreachable(why: str) -> None:
        ui.err().print(f"error: {why}", markup=False)

    with stop_on_signals(stop) as seen:
        done = remote.exec_everywhere(
            target, command, writer, stop=stop, fail_fast=fail_fast, grace=grace, unreachable=unreachable
        )
        code = summarize(done, seen["interrupted"], target.worker_names, command)
    raise typer.Exit(code)


@parsing(context_settings={"allow_interspersed_args": False})
def ssh_cmd(
    command: Annotated[
        list[str] | None, typer.Argument(metavar="[-- CMD [ARGS]...]", help="A command to run instead of a shell.")
    ] = None,
    tpu: TpuOpt = None,
    project: ProjectOpt = None,
    zone: ZoneOpt = None,
    worker: Annotated[str, typer.Option("--worker", "-w", help="Worker index (sS/wN in a multislice TPU).")] = "0",
    forward: Annotated[
        list[str] | None,
        typer.Option(
            "--forward", "-L", help="[BIND:]PORT:HOST:HOSTPORT: forward a local port through the worker, as ssh -L."
        ),
    ] = None,
    ssh_flag: Annotated[
        list[str] | None,
        typer.Option("--ssh-flag", help="One more option for the system ssh, e.g. '-D 1080' (repeatable)."),
    ] = None,
) -> None:
    """An interactive shell (or one command) on one worker, through the system ssh with pinned host keys."""
    s = settings.resolve({"tpu": tpu, "project": project, "zone": zone})
    if not s.tpu.value:
        raise UsageError("no TPU named: pass --tpu NAME (or `tpurun attach NAME` to set a default)")
    argv = remote.ssh_argv(
        targets.resolve(s, worker_spec=worker),
        s.home_path,
        command,
        worker=worker,
        forward=forward or [],
        flags=ssh_flag or [],
    )
    sys.stdout.flush()
    try:
        os.execvp("ssh", argv)
    except OSError as exc:
        raise TpurunError(f"cannot run the system ssh client: {exc.strerror}", hint="install openssh-client") from None
