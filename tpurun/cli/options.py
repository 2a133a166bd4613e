"""The options several commands share, and how a command states its parsing needs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
TpuOpt = Annotated[str | None, typer.Option("--tpu", help="TPU name (else TPURUN_TPU / tpurun.toml).")]
LocalOpt = Annotated[bool, typer.Option("--local", help="Act on this machine as a one-host pod.")]
WorkerOpt = Annotated[str, typer.Option("--worker", "-w", help="all, N, N,M or N-M.")]
ProjectOpt = Annotated[str | None, typer.Option("--project", help="GCP project (else settings).")]
ZoneOpt = Annotated[str | None, typer.Option("--zone", help="Zone, e.g. us-central2-b (else settings).")]

F = TypeVar("F", bound=Callable[..., Any])


def parsing(**typer_kwargs: Any) -> Callable[[F], F]:
    """What a command needs of the parser (typer's `app.command` keywords), kept on the function; the
    command's name lives in tpurun.cli.COMMANDS alone."""

    def mark(fn: F) -> F:
        fn.typer_kwargs = typer_kwargs  # type: ignore[attr-defined]
        return fn

    return mark
