"""`tpurun kill-stale` and `tpurun doctor`: one exec per worker carrying tpurun.worker.probe, all workers at once.

Exit codes: kill-stale 0 when every selected worker's TPU is free, 1 when a holder is
left (with --dry-run: when one was found); doctor 0 when no check failed, 1 when one did. Both exit 4
when a worker could not be reached (doctor still prints every other worker's rows).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Annotated, Any

import typer

from tpurun import config, health, settings, ui
from tpurun.cli.options import GraceOpt, JsonOpt, LocalOpt, ProjectOpt, TpuOpt, WorkerOpt, ZoneOpt
from tpurun.cloud import keys, startup
from tpurun.errors import ExitCode, TpurunError, UnreachableError
from tpurun.job import env_contract
from tpurun.topology import parse_accelerator_type
from tpurun.transport import targets
from tpurun.transport.fanout import each
from tpurun.transport.runner import Runner, run_capture, worker_names
from tpurun.transport.targets import Target
from tpurun.worker import probe

# Testing hooks (documented in docs/troubleshooting.md): point the scanner at other paths so a test on
# this machine can plant its own fake device and libtpu without touching anything real.


def _scan_config(target: Target) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    if config.DEVICE_GLOBS.raw():
        cfg["device_globs"] = [g for g in config.DEVICE_GLOBS.raw().split(os.pathsep) if g]
    elif target.accelerator_type:
        # the generation's device files: /dev/accel* (v2-v4) or /dev/vfio/* (v5e and later)
        files = parse_accelerator_type(target.accelerator_type).device_files
        cfg["device_globs"] = sorted({"/dev/accel*" if f.startswith("/dev/accel") else "/dev/vfio/*" for f in files})
        cfg["expected_devices"] = list(files)
    if config.LIBTPU_GLOB.raw():
        cfg["libtpu_glob"] = config.LIBTPU_GLOB.raw()
    if config.LOCK_FILES.raw():
        cfg["lock_globs"] = [g for g in config.LOCK_FILES.raw().split(os.pathsep) if g]
    return cfg


def _run_all(
    target: Target, argv_for: Any, timeout: float
) -> tuple[dict[int, dict[str, Any]], dict[int, str], dict[int, tuple[float, float]]]:
    """Run the program on every reachable worker at once: ({worker: JSON}, {worker: error}, {worker: (t0, t1)})."""
    errors = target.connect()
    results: dict[int, dict[str, Any]] = {}
    times: dict[int, tuple[float, float]] = {}
    reachable = [r for r in target.runners if r.worker.index not in errors]

    def one(r: Runner) -> tuple[int, dict[str, Any] | None, str]:
        t0 = time.time()
        try:
            rc, out, err = run_capture(r, argv_for(r), timeout=timeout)
        except (UnreachableError, OSError, EOFError) as exc:
            return r.worker.index, None, str(exc)
        except Exception as exc:  # paramiko's SSHException and friends: the worker dropped us
            return r.worker.index, None, f"worker {r.worker.label()}: {exc}"
        times[r.worker.index] = (t0, time.time())
        lines = out.decode("utf-8", "replace").strip().splitlines()
        if rc == 127 or (rc != 0 and not lines):
            last = err.strip().splitlines()[-1:] or [f"exit {rc}"]
            return r.worker.index, None, f"worker {r.worker.label()}: cannot run python3 there: {last[0]}"
        try:
            return r.worker.index, json.loads(lines[-1]), ""
        except (ValueError, IndexError):
            return r.worker.index, None, f"worker {r.worker.label()}: the probe printed no result"

    for index, data, error in each(reachable, one, name="probe").values():
        if data is None:
            errors[index] = error
        else:
            results[index] = data
    return results, errors, times


def _short(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _tpu_flag(target: Target) -> str:
    return " --local" if target.local else f" --tpu {target.name}"


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
) -> None:
    """Free the TPU: stop the processes holding its device files or libtpu, then remove stale lock files.

    Holders: processes with /dev/accel* or /dev/vfio/* open, or with a libtpu*.so mapped. Nothing else
    is touched. Exit 0 when every selected worker's TPU is free, 1 when a holder is left (--dry-run: found).
    """
    target = targets.resolve(tpu=tpu, local=local, project=project, zone=zone, worker_spec=worker, announce=ui.info)
    cfg = _scan_config(target)
    cfg.update(dry_run=dry_run, grace=grace)
    try:
        results, errors, _ = _run_all(
            target, lambda r: probe.program_argv(target.python(), "kill-stale", cfg), timeout=grace + 120
        )
    finally:
        target.close()
    workers = []
    for r in target.runners:
        i = r.worker.index
        entry: dict[str, Any] = {"worker": i, "name": r.worker.name, "address": r.worker.address}
        if i in errors:
            entry.update(reachable=False, error=errors[i], free=None, holders=[], locks=[])
        else:
            entry.update(reachable=True, **results[i])
        workers.append(entry)
    free = all(w.get("free") for w in workers)
    if json_out:
        ui.print_json({"tpu": target.name, "dry_run": dry_run, "grace": grace, "free": free, "workers": workers})
    else:
        _render_kill_stale(workers, dry_run)
    code = _kill_stale_exit(workers, dry_run, target)
    raise typer.Exit(code)


def _render_kill_stale(workers: list[dict[str, Any]], dry_run: bool) -> None:
    rows = [
        (
            w["name"],
            h["pid"],
            h["user"],
            ui.age(h["age"]),
            _short(h["command"]),
            " ".join(h["holds"]),
            h.get("result", ""),
        )
        for w in workers
        for h in w.get("holders", [])
    ]
    if rows:
        ui.table(None, ["worker", "pid", "user", "age", "command", "holds", "result"], rows)
    lock_rows = [(w["name"], lk["path"], lk["result"]) for w in workers for lk in w.get("locks", [])]
    if lock_rows:
        ui.table(None, ["worker", "lock file", "result"], lock_rows)
    for w in workers:
        label = w["name"]
        for e in w.get("errors", []):
            ui.warn(f"{label}: {e}")
        if not w["reachable"]:
            continue
        n = len(w.get("holders", []))
        if n == 0:
            ui.info(f"{label}: nothing holds the TPU")
        elif dry_run:
            ui.info(f"{label}: {n} process(es) hold the TPU (dry run: nothing was stopped)")
        elif w.get("free"):
            ui.info(f"{label}: TPU free ({n} process(es) stopped)")


def _kill_stale_exit(workers: list[dict[str, Any]], dry_run: bool, target: Target) -> int:
    unreachable = [w for w in workers if not w["reachable"]]
    for w in unreachable:
        ui.err().print(f"error: {w['error']}", markup=False)
    if unreachable:
        return ExitCode.UNREACHABLE
    held = [
        (w, h) for w in workers if not w.get("free") for h in w.get("holders", []) if h["pid"] in w.get("survivors", [])
    ]
    if not held:
        return ExitCode.OK
    w, h = held[0]
    if dry_run:
        ui.info(f"run `tpurun kill-stale{_tpu_flag(target)}` to stop them")
        return ExitCode.PROGRAM_FAILED
    more = f" (and {len(held) - 1} more)" if len(held) > 1 else ""
    ui.err().print(
        f"error: the TPU is still held on {w['name']} by pid {h['pid']} ({_short(h['command'])}){more}",
        markup=False,
    )
    return ExitCode.PROGRAM_FAILED


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
) -> None:
    """Check every worker and say what is wrong and how to fix it (pass/warn/fail per check).

    Exit 0 when no check failed, 1 when one did, 4 when a worker could not be reached.
    """
    target = targets.resolve(tpu=tpu, local=local, project=project, zone=zone, worker_spec=worker, announce=ui.info)
    py = target.python(python)
    cfg = _scan_config(target)
    cfg.update(python=py, probe=env_contract.PROBE_SCRIPT)
    reports = _startup_reports(target)
    try:
        probes, errors, times = _run_all(
            target, lambda r: probe.program_argv("python3" if not target.local else sys.executable, "doctor", cfg), 120
        )
    finally:
        target.close()
    kill_cmd = f"tpurun kill-stale{_tpu_flag(target)}"
    checks: list[health.Check] = []
    home = settings.resolve({}).home_path
    for r in target.runners:
        i = r.worker.index
        if target.local:
            checks.append(health.Check(i, "ssh", "pass", "this machine (no ssh)"))
        else:
            pinned = keys.pinned_key(home, r.worker.host_key)
            detail = (
                f"reachable, host key pinned as {r.worker.host_key} ({pinned.split()[0]})" if pinned else "reachable"
            )
            checks.append(health.check_ssh(i, errors.get(i), detail))
        if reports is not None:
            which = r.worker.name if r.worker.slice is not None else str(i)
            log_cmd = f"tpurun ssh --tpu {target.name} --worker {which} -- cat {startup.LOG_PATH}"
            checks.append(health.check_startup(i, reports[i] if i < len(reports) else None, log_cmd))
        if i not in probes:
            continue
        p = probes[i]
        checks += health.worker_checks(i, p, python=py, named_tpu=not target.local, kill_stale_cmd=kill_cmd)
        if target.local:
            checks.append(health.check_clock(i, None))
        else:
            t0, t1 = times[i]
            offset, unc = health.clock_offset(t0, t1, float(p["clock"]), float(p.get("elapsed", 0)))
            checks.append(health.check_clock(i, offset, unc))
    checks += health.check_same_versions(probes)
    order = {r.worker.index: n for n, r in enumerate(target.runners)}
    names = worker_names(target.all_workers)
    checks.sort(key=lambda c: order.get(c.worker, 0))  # stable: each worker's rows stay in check order
    total = health.summary(checks)
    if errors:
        code = ExitCode.UNREACHABLE
    elif total["fail"]:
        code = ExitCode.PROGRAM_FAILED
    else:
        code = ExitCode.OK
    if json_out:
        ui.print_json(
            {
                "tpu": target.name,
                "accelerator_type": target.accelerator_type,
                "python": py,
                "summary": total,
                "exit_code": code,
                "checks": [c.to_dict() for c in checks],
                "workers": {str(i): probes[i] for i in sorted(probes)},
            }
        )
    else:
        ui.table(
            None,
            ["worker", "check", "status", "detail", "fix"],
            [(names[c.worker], c.name, c.status.upper(), c.detail, c.fix) for c in checks],
        )
        ui.info(f"{total['pass']} passed, {total['warn']} warnings, {total['fail']} failed")
    raise typer.Exit(code)


def _startup_reports(target: Target) -> list[startup.StartupReport] | None:
    """Each worker's startup report from the guest attributes (named TPUs only); [] when unreadable."""
    if target.local:
        return None
    from tpurun.cloud import provision

    try:
        return provision.read_startup_reports(target.cloud(), target.name)
    except TpurunError as exc:
        ui.warn(f"cannot read {target.name}'s guest attributes: {exc}")
        return []
