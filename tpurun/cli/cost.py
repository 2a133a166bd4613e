"""`tpurun cost`: what every TPU and job tpurun made or ran has cost, deleted ones included."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tpurun import costs, settings, ui
from tpurun.cli.options import JsonOpt


def cost_cmd(
    since: Annotated[str, typer.Option("--since", help="How far back: 90m, 12h, 30d, 2w.", metavar="DURATION")] = "30d",
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Also draw the spend per day into this PNG file.", metavar="FILE")
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """What every TPU and job tpurun made or ran has cost since a while ago (deleted TPUs and pruned jobs
    included): each one's hours, price and cost, and the totals per TPU type and per day. From tpurun's own
    ledger on this machine: list prices, without taxes, discounts, committed use, disks or traffic."""
    window = costs.parse_since(since)
    rep = costs.report(settings.resolve({}).home_path, window)
    if plot is not None:
        costs.plot(rep, plot)
    if json_out:
        ui.print_json(rep.to_dict())
        return
    _tables(rep)
    if plot is not None:
        ui.info(f"spend per day drawn in {plot}")


def _usd(value: float | None) -> str:
    return ui.usd(value)


def _tables(rep: costs.Report) -> None:
    if not rep.tpus and not rep.jobs:
        ui.info(f"tpurun made or ran nothing that billed since {rep.since:%Y-%m-%d %H:%M} UTC")
        return
    ui.table(
        "TPUs",
        ["name", "zone", "accelerator", "provisioning", "created", "ended", "hours", "$/hour", "cost"],
        [
            (
                t.name,
                t.zone,
                t.accelerator_type,
                t.provisioning,
                t.start.strftime("%Y-%m-%d %H:%M") if t.start else "-",
                (t.end.strftime("%Y-%m-%d %H:%M") + (" (seen gone)" if t.ended == "gone" else "")) if t.end else "up",
                f"{t.hours:.2f}",
                _usd(t.per_hour),
                _usd(t.cost) + (" (at most)" if t.ended == "gone" and t.cost is not None else ""),
            )
            for t in rep.tpus
        ],
    )
    if rep.jobs:
        ui.table(
            "jobs",
            ["job", "attempt", "tpu", "started", "end", "hours", "cost"],
            [
                (
                    j.job,
                    j.attempt,
                    j.tpu,
                    j.start.strftime("%Y-%m-%d %H:%M"),
                    j.how or "running",
                    f"{j.hours:.2f}",
                    _usd(j.cost),
                )
                for j in rep.jobs
            ],  # fmt: skip
        )
    ui.table("per TPU type", ["accelerator", "cost"], [(k, _usd(v)) for k, v in rep.by_type().items()])
    ui.table("per day (UTC)", ["day", "cost"], [(k, _usd(v)) for k, v in rep.by_day().items()])
    ui.info(
        f"total since {rep.since:%Y-%m-%d %H:%M} UTC: {_usd(rep.total)} (list prices; jobs are part of their TPUs' cost)"
    )
    if rep.unpriced:
        ui.info(f"no price known for {', '.join(sorted(set(rep.unpriced)))}: their hours are counted, not their cost")
