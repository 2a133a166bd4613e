"""`tpurun kill-stale` and `tpurun doctor`: one exec per worker carrying tpurun.worker.probe, all workers at once.

Exit codes: kill-stale 0 when every selected worker's TPU is free, 1 when a holder is
left (with --dry-run: when one was found); doctor 0 when no check failed, 1 when one did. Both exit 4
when a worker could not be reached (doctor still prints every other worker's rows).
"""

from __future__ import annotations

from typing import Annotated

import typer

from tpurun import diagnose, settings, ui
from tpurun.cli import grouped
from tpurun.cli.options import (
    GraceOpt,
    JsonOpt,
    LocalOpt,
    ProjectOpt,
    RelayOpt,
    TpuOpt,
    ViaOpt,
    WorkerOpt,
    ZoneOpt,
    relay_flag,
)
from tpurun.cli.output import skew_table
from tpurun.naming import EACH_UP_TO, each_or_by_reason, which


def _short(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


# ------------------------------------------------------------------ kill-stale


def kill_stale_cmd(
    tpu: TpuOpt = None,
    local: LocalOpt = False,
    project: ProjectOpt = None,
    zone: ZoneOpt = None,
    worker: WorkerOpt = "all",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only show what holds the TPU; change nothing.")] = False,
    grace: GraceOpt = 10.0,
    json_out: JsonOpt = False,
    relay: RelayOpt = None,
    via: ViaOpt = None,
) -> None:
    """Free the TPU: stop the processes holding its device files or libtpu, then remove stale lock files.

    Holders: processes with /dev/accel* or /dev/vfio/* open, or with a libtpu*.so mapped. Nothing else
    is touched. Exit 0 when every selected worker's TPU is free, 1 when a holder is left (--dry-run: found).
    """
    s = settings.resolve({"tpu": tpu, "project": project, "zone": zone, "relay": relay_flag(relay), "via": via})
    result = diagnose.kill_stale(s, local=local, worker_spec=worker, dry_run=dry_run, grace=grace, announce=ui.info)
    if json_out:
        ui.print_json(result.to_json())
    else:
        _render_kill_stale(result.workers, dry_run)
    _kill_stale_end(result)
    raise typer.Exit(result.exit_code)


def _render_kill_stale(workers: list[diagnose.KillStaleWorker], dry_run: bool) -> None:
    """What holds the TPU where, and what became of it: a row per holder and a line per worker on a few
    workers; on more, alike holders and alike workers grouped, each group with its folded workers."""
    many = len(workers) > EACH_UP_TO
    held = [
        (w.name, (h.user, _short(h.command), " ".join(h.holds), h.result or "")) for w in workers for h in w.holders
    ]
    if held and many:
        alike = grouped.by_outcome(held)
        ui.table(
            None,
            ["processes", "workers", "user", "command", "holds", "result"],
            [(len(names), which(names), *k) for k, names in alike],
        )
    elif held:
        rows = [
            (w.name, h.pid, h.user, ui.age(h.age), _short(h.command), " ".join(h.holds), h.result or "")
            for w in workers
            for h in w.holders
        ]
        ui.table(None, ["worker", "pid", "user", "age", "command", "holds", "result"], rows)
    locks = [(w.name, (lk.path, lk.result or "")) for w in workers for lk in w.locks]
    if locks:
        lock_rows = [(which(names), *k) for k, names in grouped.each_or_grouped(locks, many)]
        ui.table(None, ["worker", "lock file", "result"], lock_rows)
    for line in each_or_by_reason([(w.name, f"{w.name}: {e}") for w in workers for e in w.errors], len(workers)):
        ui.warn(line)
    said = []
    for w in workers:
        n = len(w.holders)
        if not w.reachable:
            continue
        if n == 0:
            said.append((w.name, "nothing holds the TPU"))
        elif dry_run:
            said.append((w.name, f"{n} process(es) hold the TPU (dry run: nothing was stopped)"))
        elif w.free:
            said.append((w.name, f"TPU free ({n} process(es) stopped)"))
    for text, names in grouped.each_or_grouped(said, many):
        ui.info(f"{which(names)}: {text}")


def _kill_stale_end(result: diagnose.KillStale) -> None:
    """Why kill-stale did not leave the TPU free: the workers it could not reach, else what still holds it (with
    --dry-run: the command that stops what was found)."""
    for line in each_or_by_reason([(w.name, w.error) for w in result.unreachable], len(result.workers)):
        ui.err().print(f"error: {line}", markup=False)
    held = result.held()
    if result.unreachable or not held:
        return
    w, h = held[0]
    if result.dry_run:
        ui.info(f"run `{diagnose.kill_stale_command(result.local, result.tpu)}` to stop them")
        return
    more = f" (and {len(held) - 1} more)" if len(held) > 1 else ""
    ui.err().print(
        f"error: the TPU is still held on {w.name} by pid {h.pid} ({_short(h.command)}){more}",
        markup=False,
    )


# ------------------------------------------------------------------ doctor


def doctor_cmd(
    tpu: TpuOpt = None,
    local: LocalOpt = False,
    project: ProjectOpt = None,
    zone: ZoneOpt = None,
    worker: WorkerOpt = "all",
    python: Annotated[
        str | None, typer.Option(help="Python whose torch/torch_xla to check (default python3; here: this one).")
    ] = None,
    json_out: JsonOpt = False,
    relay: RelayOpt = None,
    via: ViaOpt = None,
) -> None:
    """Check every worker and say what is wrong and how to fix it (pass/warn/fail per check).

    Exit 0 when no check failed, 1 when one did, 4 when a worker could not be reached.
    """
    s = settings.resolve({"tpu": tpu, "project": project, "zone": zone, "relay": relay_flag(relay), "via": via})
    result = diagnose.doctor(s, local=local, worker_spec=worker, python=python, announce=ui.info, warn=ui.warn)
    total = result.summary
    if json_out:
        ui.print_json(result.to_dict())
    else:
        _checks(result)
        if result.skew:
            skew_table(result.skew)
        ui.info(f"{total['pass']} passed, {total['warn']} warnings, {total['fail']} failed")
    raise typer.Exit(result.exit_code)


def _checks(result: diagnose.Doctor) -> None:
    """Every check on every worker: a row each on a few workers; on more, a row per check and status with its
    folded workers, in the order of the checks, and its detail where they share it (else one worker's)."""
    checks = [(result.names[c.worker], c) for c in result.checks]
    if len({name for name, _ in checks}) <= EACH_UP_TO:
        each = [(name, c.name, c.status.upper(), c.detail, c.fix) for name, c in checks]
        ui.table(None, ["worker", "check", "status", "detail", "fix"], each)
        return
    order = {c.name: i for i, (_, c) in reversed(list(enumerate(checks)))}
    alike = grouped.by_outcome(((name, c), (c.name, c.status)) for name, c in checks)
    rows = []
    for (check, status), members in sorted(alike, key=lambda kv: order[kv[0][0]]):  # stable: the most common first
        details = {c.detail for _, c in members}
        first, c = members[0]
        detail = c.detail if len(details) == 1 else f"e.g. {first}: {c.detail}"
        fixes = {c.fix for _, c in members}
        names = [name for name, _ in members]
        rows.append(
            (
                check,
                status.upper(),
                f"{len(names):,}",
                which(names),
                detail,
                c.fix if len(fixes) == 1 else f"e.g. {c.fix}",
            )
        )
    ui.table(None, ["check", "status", "workers", "which", "detail", "fix"], rows)
