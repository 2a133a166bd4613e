"""`tpurun profile`: a running job's processes captured at the same moment by their runtimes' profiler servers,
into one session directory xprof and TensorBoard open (the library's job/profile.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from tpurun import settings, ui
from tpurun.cli.options import JsonOpt, RelayOpt, ViaOpt, relay_flag
from tpurun.job import profile
from tpurun.naming import each_or_by_reason, fold


def profile_cmd(
    job: Annotated[
        str | None,
        typer.Argument(metavar="[JOB]", help="The job (default: the newest started from here on the TPU)."),
    ] = None,
    duration: Annotated[
        str, typer.Option("--duration", "-d", help="How long to capture: 3s, 1.5s, 500ms (at most 600s).")
    ] = "3s",
    worker: Annotated[
        str | None,
        typer.Option(
            "--worker",
            "-w",
            help="Workers: all, N, N,M, N-M or a mix (default: every host, at most TPURUN_PROFILE_HOSTS of a large "
            "pod, spread over it).",
        ),
    ] = None,
    out: Annotated[
        str | None,
        typer.Option("--out", "-o", help="The log directory to write into (default: ./tpurun-profiles/JOB)."),
    ] = None,
    json_out: JsonOpt = False,
    relay: RelayOpt = None,
    via: ViaOpt = None,
) -> None:
    """Capture every process of a running (or hung) job at the same moment with its runtime's profiler: one
    session directory, a file per host (or per process), that xprof and TensorBoard open."""
    seconds = profile.parse_seconds(duration)
    s = settings.resolve({"relay": relay_flag(relay), "via": via})
    got = profile.capture(s, job, seconds, worker=worker, out=out)
    if json_out:
        ui.print_json(got.to_json())
    else:
        for f in got.files:
            print(f"{f.process}\t{ui.size(f.size)}\t{f.path}")
    if got.left_out:
        ui.info(
            f"left out {len(got.left_out)} hosts of the pod ({fold(got.left_out)}): "
            "--worker all profiles every one"
        )
    for line in each_or_by_reason([(p, f"{p}: no capture: {why}") for p, why in got.missing.items()]):
        ui.info(f"warning: {line}")
    for line in each_or_by_reason([(w, f"{w}: {why}") for w, why in got.errors.items()]):
        ui.info(f"error: {line}")
    for w, late in got.late.items():
        ui.info(f"warning: {w} started its capture {late:.2f}s after the others (TPURUN_PROFILE_LEAD)")
    if got.files:
        ui.info(
            f"{len(got.files)} processes, {got.seconds:g}s each, {ui.size(got.total_bytes)} in {got.session} "
            f"({got.wall:.1f}s); open it with: xprof --logdir {got.out}  (or: tensorboard --logdir {got.out})"
        )
    raise typer.Exit(got.exit_code)
