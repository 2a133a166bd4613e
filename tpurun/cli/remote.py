"""Commands that reach the workers: exec and ssh (the third, sync, has its own module: cli/sync.py)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from tpurun import remote, settings, ui
from tpurun.cli.grouped import Gathered, Unreachable
from tpurun.cli.options import (
    GraceOpt,
    LocalOpt,
    ProjectOpt,
    RelayOpt,
    TpuOpt,
    ViaOpt,
    WorkerOpt,
    ZoneOpt,
    parsing,
    relay_flag,
)
from tpurun.cli.output import LineWriter, stop_on_signals, summarize
from tpurun.errors import TpurunError, UsageError
from tpurun.fleet import targets
from tpurun.naming import EACH_UP_TO, NAME_RE

TYPED = "tpurun.typed"  # the key of the command line as typed, in the parser's context


class AsTyped(TyperCommand):
    """A command that keeps its command line as typed (`ctx.meta[TYPED]`): the words the parser gives it
    cannot tell `exec NAME -- CMD` from `exec -- NAME -- CMD`."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # the parser's context (typer's own click)
        args = _name_after_options(args)
        ctx.meta[TYPED] = list(args)
        return super().parse_args(ctx, args)


def _name_after_options(args: list[str]) -> list[str]:
    """gcloud's order with options after the TPU's name, `ssh NAME --worker 1 -- CMD`, as tpurun reads it: the
    name moved to just before `--`, after the options (the parser stops at the first word that is not one)."""
    if "--" not in args or len(args) < 2 or args[0].startswith("-") or not args[1].startswith("-"):
        return args
    end = args.index("--")
    return [*args[1:end], args[0], *args[end:]]


def name_first(
    ctx: typer.Context, verb: str, words: list[str], s: settings.Settings, *, local: bool = False, ask: bool = False
) -> tuple[settings.Settings, list[str]]:
    """gcloud's order, `tpurun VERB NAME -- CMD`: the settings for the TPU and the command. A word typed before
    `--` is the TPU's name: one word, and neither with --tpu nor with --local. With no `--` typed, the first
    word is the TPU when it names one tpurun knows (ASK, for a word alone: or the API has), else the command."""
    typed = ctx.meta.get(TYPED, [])
    flagged = s.tpu.layer is settings.Layer.FLAG
    if "--" not in typed:
        if local or flagged or not words or not targets.names_a_tpu(s, words[0], ask=ask and len(words) == 1):
            return s, words
        return s.with_tpu(words[0], f"`tpurun {verb} {words[0]}`"), words[1:]
    after = len(typed) - typed.index("--") - 1
    before = words[: max(len(words) - after - 1, 0)]
    if not before:
        return s, words
    said = " ".join(before)
    form = f"`tpurun {verb} NAME -- CMD` or `tpurun {verb} --tpu NAME -- CMD`"
    if local:
        raise UsageError(f"`{said}` before -- names a TPU, and --local this machine: choose one", hint=form)
    if flagged:
        raise UsageError(f"`{said}` before -- and --tpu {s.tpu.value}: name the TPU once", hint=form)
    if len(before) > 1 or not NAME_RE.match(before[0]):
        raise UsageError(f"`{said}` before --: only the TPU's name goes there, the command after --", hint=form)
    return s.with_tpu(before[0], f"`tpurun {verb} {before[0]} --`"), words[len(before) + 1 :]


@parsing(cls=AsTyped, context_settings={"allow_interspersed_args": False})
def exec_cmd(
    ctx: typer.Context,
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
    gather: Annotated[
        bool,
        typer.Option(
            "--gather",
            "-b",
            help="Gather identical output, as clush -b: each distinct output printed once, at the end, under the "
            "workers that printed it (w[0-4,6-2047]), instead of lines prefixed \\[wN] as they come.",
        ),
    ] = False,
    by_worker: Annotated[
        bool,
        typer.Option(
            "--by-worker", help=f"A summary row per worker (without it: per outcome above {EACH_UP_TO} workers)."
        ),
    ] = False,
    relay: RelayOpt = None,
    via: ViaOpt = None,
) -> None:
    """Run a command on every selected worker at once, lines prefixed \\[wN]. The TPU's name may come first:
    `tpurun exec NAME -- CMD`."""
    s, command = name_first(
        ctx,
        "exec",
        command,
        settings.resolve({"tpu": tpu, "project": project, "zone": zone, "relay": relay_flag(relay), "via": via}),
        local=local,
    )
    if not command:
        raise UsageError("give a command after --, e.g. `tpurun exec -- hostname`")
    writer = LineWriter(colour=not ui.is_plain())
    gathered = Gathered()
    stop, interrupted = threading.Event(), threading.Event()
    unreachable = Unreachable()

    def name_workers(names: Mapping[int, str]) -> None:
        writer.names = names

    with stop_on_signals(stop, interrupted):
        done = remote.exec_everywhere(
            s, command, gathered if gather else writer, local=local, worker_spec=worker, stop=stop,
            fail_fast=fail_fast, grace=grace, announce=ui.info, name_workers=name_workers, unreachable=unreachable,
            interrupted=interrupted,
        )  # fmt: skip
        if gather:
            gathered.print(done.names)
        summarize(done, done.names, command, by_worker=by_worker, unreachable=unreachable)
    raise typer.Exit(done.exit_code)


@parsing(cls=AsTyped, context_settings={"allow_interspersed_args": False})
def ssh_cmd(
    ctx: typer.Context,
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
    relay: RelayOpt = None,
    via: ViaOpt = None,
) -> None:
    """An interactive shell (or one command) on one worker, through the system ssh with pinned host keys. The
    TPU's name may come first: `tpurun ssh NAME`."""
    s, command = name_first(
        ctx,
        "ssh",
        command or [],
        settings.resolve({"tpu": tpu, "project": project, "zone": zone, "relay": relay_flag(relay), "via": via}),
        ask=True,
    )
    argv = remote.ssh_argv(s, command, worker=worker, forward=forward or [], flags=ssh_flag or [])
    sys.stdout.flush()
    try:
        os.execvp("ssh", argv)
    except OSError as exc:
        raise TpurunError(f"cannot run the system ssh client: {exc.strerror}", hint="install openssh-client") from None


@parsing(hidden=True)
def iap_tunnel_cmd(
    instance: Annotated[str, typer.Argument(metavar="INSTANCE", help="The VM's instance name.")],
    port: Annotated[int, typer.Argument(metavar="PORT", min=1, max=65535, help="Its port.")],
    project: ProjectOpt = None,
    zone: ZoneOpt = None,
) -> None:
    """Carry stdin and stdout through IAP's tunnel to PORT of INSTANCE: the ProxyCommand `tpurun ssh` gives the
    system ssh for a worker without an external address (docs/remote.md)."""
    remote.iap_tunnel(settings.resolve({"project": project, "zone": zone}), instance, port)
