"""The options several commands share, and how a command states its parsing needs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
TpuOpt = Annotated[str | None, typer.Option("--tpu", help="TPU name (else TPURUN_TPU / tpurun.toml).")]
LocalOpt = Annotated[bool, typer.Option("--local", help="Act on this machine as a one-host pod.")]
WorkerOpt = Annotated[
    str, typer.Option("--worker", "-w", help="Workers: all, N, N,M, N-M or a mix (sS or sS/wN in a multislice TPU).")
]
ProjectOpt = Annotated[str | None, typer.Option("--project", help="GCP project (else settings).")]
RelayOpt = Annotated[
    bool | None,
    typer.Option(
        "--relay/--no-relay",
        help="Reach the workers through relays inside the slice, or never (default: above TPURUN_RELAY_ABOVE).",
        show_default=False,
    ),
]
ViaOpt = Annotated[
    str | None,
    typer.Option(
        "--via",
        metavar="iap|direct|COMMAND",
        help="How this machine reaches the workers: through IAP's TCP forwarding, straight to their addresses, or "
        "through a ProxyCommand of yours (%h %p as OpenSSH expands them), e.g. 'ssh -W %h:%p jumphost' (default: "
        "IAP for workers without an external address, else straight).",
        show_default=False,
    ),
]
ZoneOpt = Annotated[str | None, typer.Option("--zone", help="Zone, e.g. us-central2-b (else settings).")]

# every bounded number declares its range to the parser, which shows it in --help as [x>=0] and refuses
# what is outside it with one line (exit 2)
GraceOpt = Annotated[
    float, typer.Option("--grace", min=0, max=3600, help="Seconds between SIGTERM and SIGKILL when stopping.")
]

# arguments: metavars in capitals, as the docs write them
NameArg = Annotated[str, typer.Argument(metavar="NAME", help="The TPU: a node, or a multislice TPU.")]
JobArg = Annotated[str, typer.Argument(metavar="JOB", help="A job id (from `tpurun jobs`).")]
JobTpuOpt = Annotated[
    str | None, typer.Option("--tpu", help="The TPU the job ran on (its record knows it; checked when given).")
]

F = TypeVar("F", bound=Callable[..., Any])


def relay_flag(relay: bool | None) -> str | None:
    """--relay/--no-relay as the relay setting's flag value (None: not given)."""
    return None if relay is None else "on" if relay else "off"


def parsing(**typer_kwargs: Any) -> Callable[[F], F]:
    """What a command needs of the parser (typer's `app.command` keywords), kept on the function; the
    command's name lives in tpurun.cli.COMMANDS alone."""

    def mark(fn: F) -> F:
        fn.typer_kwargs = typer_kwargs  # type: ignore[attr-defined]
        return fn

    return mark


# train's answers to host events (docs/maintenance.md)
MaxRestartsOpt = Annotated[
    int,
    typer.Option(min=0, help="Relaunch after a preemption (the TPU recreated) or a lost worker: up to N times in all."),
]
RestartsOpt = Annotated[
    str,
    typer.Option(
        "--restarts",
        metavar="KIND=N[,KIND=N...]",
        help="Restart budgets by why the job ended: program, preempted, maintenance, infra (e.g. maintenance=5,program=1).",
    ),
]
OnNoticeOpt = Annotated[
    str | None,
    typer.Option(
        "--on-notice",
        metavar="signal:SIGNAME|file|stop",
        help="When maintenance or preemption is announced for any worker: signal every process, write the file in "
        "$TPURUN_NOTICE_FILE, or stop the job (default: signal:SIGTERM for JAX, file otherwise).",
    ),
]
