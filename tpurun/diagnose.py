"""`kill-stale` and `doctor` over every selected worker: one exec each of tpurun.worker.probe, all at once,
gathered into what the CLI renders (the judgement of a doctor probe is tpurun.health's)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tpurun import config, health
from tpurun.cloud import keys, startup
from tpurun.errors import ExitCode, TpurunError
from tpurun.fleet import targets
from tpurun.fleet.interface import Call
from tpurun.fleet.targets import Target
from tpurun.job import env_contract, preflight
from tpurun.settings import Settings
from tpurun.transport.runner import Worker
from tpurun.worker import agent_files, probe

A = TypeVar("A")
Probes = dict[int, dict[str, Any]]  # worker index -> the probe's JSON (read as its answer's record by each command)


def scan_config(target: Target) -> dict[str, Any]:
    """Where the probe looks for holders on TARGET: the generation's device files (or the testing hooks'
    paths, TPURUN_DEVICE_GLOBS and friends, documented in docs/troubleshooting.md)."""
    cfg: dict[str, Any] = {}
    if config.DEVICE_GLOBS.raw():
        cfg["device_globs"] = [g for g in config.DEVICE_GLOBS.raw().split(os.pathsep) if g]
    elif target.topology is not None:
        # the generation's device files: /dev/accel* (v2-v4) or /dev/vfio/* (v5e and later)
        files = target.topology.device_files
        cfg["device_globs"] = sorted({"/dev/accel*" if f.startswith("/dev/accel") else "/dev/vfio/*" for f in files})
        cfg["expected_devices"] = list(files)
    if config.LIBTPU_GLOB.raw():
        cfg["libtpu_glob"] = config.LIBTPU_GLOB.raw()
    if config.LOCK_FILES.raw():
        cfg["lock_globs"] = [g for g in config.LOCK_FILES.raw().split(os.pathsep) if g]
    return cfg


@dataclass
class ProbeRun:
    results: Probes = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # worker index -> why it could not be probed
    times: dict[int, tuple[float, float]] = field(default_factory=dict)  # worker index -> (sent, answered)


def run_probe(target: Target, mode: str, cfg: dict[str, Any], python: str, timeout: float) -> ProbeRun:
    """The probe in MODE on every reachable worker of TARGET at once, run by PYTHON."""
    run = ProbeRun(errors=target.fleet.connect())

    # the same command line on every worker (relays carry it once per link, not the probe's 30 KB per worker);
    # on stdin, what tpurun gives every process it starts there of the worker's place (doctor checks it)
    argv = probe.program_argv(python, mode, cfg | {"vm_env_on_stdin": True})

    def call(w: Worker) -> Call:
        return Call.command(argv, input=json.dumps(target.vm_env(w)).encode())

    labels = {w.index: w.label() for w in target.all_workers}
    for index, a in target.fleet.call(call, timeout=timeout).items():
        if a.rc is None:
            run.errors[index] = a.error
            continue
        run.times[index] = (a.sent, a.answered)
        lines = a.out.decode("utf-8", "replace").strip().splitlines()
        if a.rc == 127 or (a.rc != 0 and not lines):
            last = a.err.strip().splitlines()[-1:] or [f"exit {a.rc}"]
            run.errors[index] = f"worker {labels[index]}: cannot run python3 there: {last[0]}"
            continue
        try:
            run.results[index] = json.loads(lines[-1])
        except (ValueError, IndexError):
            run.errors[index] = f"worker {labels[index]}: the probe printed no result"
    return run


def read_answers(run: ProbeRun, read: Callable[[dict[str, Any]], A]) -> dict[int, A]:
    """Each worker's answer in RUN as its record (READ: the record's `from_dict`); an answer that is not one
    becomes that worker's error."""
    answers = {}
    for i, data in run.results.items():
        try:
            answers[i] = read(data)
        except ValueError as exc:
            run.errors[i] = f"the probe's answer cannot be read: {exc}"
    return answers


# ------------------------------------------------------------------ kill-stale


@dataclass
class KillStaleWorker:
    """kill-stale on one worker: its probe's ANSWER, or the ERROR that kept it from one."""

    index: int
    name: str
    address: str
    answer: probe.KillStaleAnswer | None = None
    error: str = ""

    @property
    def reachable(self) -> bool:
        return self.answer is not None

    @property
    def free(self) -> bool:
        return self.answer is not None and self.answer.free

    @property
    def holders(self) -> list[probe.Holder]:
        return self.answer.holders if self.answer is not None else []

    @property
    def locks(self) -> list[probe.LockFile]:
        return self.answer.locks if self.answer is not None else []

    @property
    def errors(self) -> list[str]:
        return self.answer.errors if self.answer is not None else []

    def to_json(self) -> dict[str, Any]:
        head = {"worker": self.index, "name": self.name, "address": self.address, "reachable": self.reachable}
        if self.answer is None:
            return head | {"error": self.error, "free": None, "holders": [], "locks": []}
        return head | self.answer.to_dict()


@dataclass
class KillStale:
    """What kill-stale found and did on every selected worker."""

    tpu: str
    local: bool
    dry_run: bool
    grace: float
    workers: list[KillStaleWorker]

    @property
    def free(self) -> bool:
        return all(w.free for w in self.workers)

    @property
    def unreachable(self) -> list[KillStaleWorker]:
        return [w for w in self.workers if not w.reachable]

    def held(self) -> list[tuple[KillStaleWorker, probe.Holder]]:
        """(worker, holder) for every process still holding a TPU after the stop (found, with --dry-run)."""
        return [
            (w, h)
            for w in self.workers
            if w.answer is not None and not w.free
            for h in w.holders
            if h.pid in w.answer.survivors
        ]

    @property
    def exit_code(self) -> ExitCode:
        """`kill-stale`'s exit code: 4 where a worker could not be reached, else 1 where a process still holds a
        TPU (with --dry-run: where one was found), else 0."""
        if self.unreachable:
            return ExitCode.UNREACHABLE
        return ExitCode.PROGRAM_FAILED if self.held() else ExitCode.OK

    def to_json(self) -> dict[str, Any]:
        return {
            "tpu": self.tpu,
            "dry_run": self.dry_run,
            "grace": self.grace,
            "free": self.free,
            "workers": [w.to_json() for w in self.workers],
        }


def kill_stale_command(local: bool, tpu: str) -> str:
    """The kill-stale that frees the TPU a command acted on (this machine, with LOCAL)."""
    return "tpurun kill-stale " + ("--local" if local else f"--tpu {tpu}")


def kill_stale(
    s: Settings,
    *,
    local: bool,
    worker_spec: str,
    dry_run: bool,
    grace: float,
    announce: Callable[[str], None] | None = None,
) -> KillStale:
    """Free the TPU S names (or this machine, LOCAL) on the workers WORKER_SPEC selects: stop what holds their
    devices or libtpu (SIGTERM, SIGKILL after GRACE), then remove stale lock files; with DRY_RUN only find them.
    ANNOUNCE hears that it is this machine."""
    target = targets.resolve(s, local=local, worker_spec=worker_spec, announce=announce)
    with target:
        # a worker held for a `train` about to start is held by the process that has its claim file open
        claim = os.path.join(agent_files.agent_root("~"), agent_files.CLAIM)
        cfg = scan_config(target) | {"dry_run": dry_run, "grace": grace, "claim_files": [claim]}
        run = run_probe(target, "kill-stale", cfg, target.python(), timeout=grace + 120)
    answers = read_answers(run, probe.KillStaleAnswer.from_dict)
    workers = [
        KillStaleWorker(w.index, w.name, w.address, answers.get(w.index)) for w in target.workers
    ]
    for w in workers:
        w.error = run.errors.get(w.index, "")
    return KillStale(target.name, target.local, dry_run, grace, workers)


# ------------------------------------------------------------------ doctor


@dataclass
class Doctor:
    tpu: str
    accelerator_type: str | None
    python: str
    checks: list[health.Check]  # every worker's rows, workers in order, each worker's rows in check order
    probes: dict[int, probe.DoctorAnswer]  # worker index -> its probe's answer
    unreachable: bool  # a worker could not be reached
    names: dict[int, str]  # worker index -> its name
    skew: preflight.Skew  # who differs from whom in Python and decisive packages (as `train` refuses it)

    @property
    def summary(self) -> dict[str, int]:
        return health.summary(self.checks)

    @property
    def failed(self) -> bool:
        return bool(self.summary["fail"])

    @property
    def exit_code(self) -> ExitCode:
        """`doctor`'s exit code: 4 where a worker could not be reached, else 1 where a check failed, else 0."""
        return ExitCode.UNREACHABLE if self.unreachable else ExitCode.PROGRAM_FAILED if self.failed else ExitCode.OK

    def to_dict(self) -> dict[str, Any]:
        """`doctor --json`: every check of every worker, each worker's probe, who differs, the exit code."""
        return {
            "tpu": self.tpu,
            "accelerator_type": self.accelerator_type,
            "python": self.python,
            "summary": self.summary,
            "exit_code": self.exit_code,
            "checks": [c.to_dict() for c in self.checks],
            "workers": {str(i): self.probes[i].to_dict() for i in sorted(self.probes)},
            "skew": self.skew.to_json(),
        }


def doctor(
    s: Settings,
    *,
    local: bool,
    worker_spec: str,
    python: str | None,
    announce: Callable[[str], None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> Doctor:
    """Every check of every worker WORKER_SPEC selects of the TPU S names (or this machine, LOCAL), its Python
    PYTHON, else the workers'; ANNOUNCE hears that it is this machine, WARN that the startup reports cannot be
    read."""
    target = targets.resolve(s, local=local, worker_spec=worker_spec, announce=announce)
    home, kill_stale_cmd = s.home_path, kill_stale_command(target.local, target.name)
    py = target.python(python)
    with target:
        cfg = scan_config(target) | {"python": py, "probe": env_contract.PROBE_SCRIPT}
        reports = _startup_reports(target, warn)
        run = run_probe(target, "doctor", cfg, "python3" if not target.local else sys.executable, timeout=120)
    probes = read_answers(run, probe.DoctorAnswer.from_dict)
    checks: list[health.Check] = []
    for w in target.workers:
        checks += _worker_rows(target, w, run, probes.get(w.index), reports, home, py, kill_stale_cmd)
    answers = {w: a for w, a in ((w, preflight.from_probe(p)) for w, p in probes.items()) if a is not None}
    skew = preflight.compare(target, answers)
    if len(answers) > 1:
        checks += health.check_same_versions(skew, {w: target.all_workers[w].name for w in sorted(answers)})
    order = {w.index: n for n, w in enumerate(target.workers)}
    checks.sort(key=lambda c: order.get(c.worker, 0))  # stable: each worker's rows stay in check order
    return Doctor(target.name, target.accelerator_type, py, checks, probes, bool(run.errors), target.worker_names, skew)


def _worker_rows(
    target: Target,
    w: Worker,
    run: ProbeRun,
    answer: probe.DoctorAnswer | None,
    reports: list[startup.StartupReport] | None,
    home: Path,
    python: str,
    kill_stale_cmd: str,
) -> list[health.Check]:
    i = w.index
    checks = []
    if target.local:
        checks.append(health.Check(i, "ssh", "pass", "this machine (no ssh)"))
    else:
        pinned = keys.pinned_key(home, w.host_key)
        detail = f"reachable, host key pinned as {w.host_key} ({pinned.split()[0]})" if pinned else "reachable"
        checks.append(health.check_ssh(i, run.errors.get(i), detail))
    if reports is not None:
        which = w.name if w.slice is not None else str(i)
        log_cmd = f"tpurun ssh --tpu {target.name} --worker {which} -- cat {startup.LOG_PATH}"
        checks.append(health.check_startup(i, reports[i] if i < len(reports) else None, log_cmd))
    if answer is None:
        return checks
    checks += health.worker_checks(i, answer, python=python, named_tpu=not target.local, kill_stale_cmd=kill_stale_cmd)
    if target.local:
        checks.append(health.check_clock(i, None))
    else:
        t0, t1 = run.times[i]
        offset, unc = health.clock_offset(t0, t1, answer.clock, answer.elapsed)
        checks.append(health.check_clock(i, offset, unc))
    return checks


def _startup_reports(target: Target, warn: Callable[[str], None] | None) -> list[startup.StartupReport] | None:
    """Each worker's startup report from the guest attributes (named TPUs only); [] when unreadable."""
    if target.local:
        return None
    from tpurun.cloud import listing

    try:
        return listing.read_startup_reports(target.cloud(), target.name)
    except TpurunError as exc:
        if warn is not None:
            warn(f"cannot read {target.name}'s guest attributes: {exc}")
        return []
