"""Commands that reach the workers: exec and ssh (the third, sync, has its own module: cli/sync.py)."""

from __future__ import annotations

import os
import shlex
import sys
import threading
from typing import Annotated

import typer

from tpurun import settings, ui
from tpurun.cli.options import GraceOpt, LocalOpt, ProjectOpt, TpuOpt, WorkerOpt, ZoneOpt, parsing
from tpurun.cli.output import LineWriter, stop_on_signals, summarize
from tpurun.cloud import keys
from tpurun.errors import TpurunError, UnreachableError, UsageError
from tpurun.transport import targets
from tpurun.transport.fanout import RunResult, fan_out
from tpurun.transport.runner import DEFAULT_GRACE, worker_names


@parsing(context_settings={"allow_interspersed_args": False})
def exec_cmd(
    command: Annotated[list[str], typer.Argument(metavar="-- CMD [ARGS]...", help="Passed exactly, never through a shell.")],
    tpu: TpuOpt = None,
    local: LocalOpt = False,
    project: ProjectOpt = None,
    zone: ZoneOpt = None,
    worker: WorkerOpt = "all",
    fail_fast: Annotated[bool, typer.Option("--fail-fast", help="Stop every worker at the first failure.")] = False,
    grace: GraceOpt = DEFAULT_GRACE,
) -> None:
    """Run a command on every selected worker at once, lines prefixed \\[wN]."""
    if not command:
        raise UsageError("give a command after --, e.g. `tpurun exec -- hostname`")
    target = targets.resolve(tpu=tpu, local=local, project=project, zone=zone, worker_spec=worker, announce=ui.info)
    names = worker_names(target.all_workers)
    writer = LineWriter(colour=not ui.is_plain(), names=names)
    stop = threading.Event()
    try:
        with stop_on_signals(stop) as seen:
            errors = target.connect()
            for _, error in sorted(errors.items()):
                ui.err().print(f"error: {error}", markup=False)
            reachable = [r for r in target.runners if r.worker.index not in errors]
            results = fan_out(reachable, command, writer, stop=stop, fail_fast=fail_fast, grace=grace)
            results += [RunResult(i, None, error=e) for i, e in errors.items()]
            results.sort(key=lambda r: r.worker)
            code = summarize(results, seen["interrupted"], names)
    finally:
        target.close()
    raise typer.Exit(code)


@parsing(context_settings={"allow_interspersed_args": False})
def ssh_cmd(
    command: Annotated[list[str] | None, typer.Argument(metavar="[-- CMD [ARGS]...]", help="A command to run instead of a shell.")] = None,
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
    target = targets.resolve(tpu=tpu, local=False, project=project, zone=zone, worker_spec=worker)
    try:
        if len(target.runners) != 1:
            raise UsageError(f"--worker {worker}: name one worker")
        # the worker proves it is that worker of that TPU (and a gone TPU is reported) before ssh runs
        errors = target.connect()
        if errors:
            raise UnreachableError(next(iter(errors.values())))
    finally:
        target.close()
    w = target.runners[0].worker
    home = s.home_path
    argv = [
        "ssh",
        "-i", str(keys.key_path(home)),
        "-o", "IdentitiesOnly=yes",
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"UserKnownHostsFile={keys.known_hosts_path(home)}",
        "-o", f"HostKeyAlias={w.host_key}",  # the key pinned for this worker of this TPU, not for its address
        "-o", "LogLevel=ERROR",
        "-p", str(w.port),
    ]  # fmt: skip
    # after tpurun's own options: ssh keeps the first value it gets of each, so these cannot loosen them
    for spec in forward or []:
        argv += ["-L", spec]
    for flag in ssh_flag or []:
        argv += shlex.split(flag)
    if command:
        for arg in command:
            if "\0" in arg:
                raise UsageError("arguments cannot contain NUL bytes")
        # ssh joins its arguments into one line for the remote shell: quote so they arrive exactly
        argv += [f"{w.user}@{w.address}", "--", shlex.join(command)]
    else:
        argv += ["-t", f"{w.user}@{w.address}"]
    sys.stdout.flush()
    try:
        os.execvp("ssh", argv)
    except OSError as exc:
        raise TpurunError(f"cannot run the system ssh client: {exc.strerror}", hint="install openssh-client") from None
