"""A `train` command's whole course around the launcher: the TPU the settings name resolved (again after each
recreation), the job only shown (--dry-run) or run, relaunched on a recreated TPU after each preemption up
to --max-restarts, and with --down the TPU armed for deletion before and deleted after."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tpurun import targets
from tpurun.errors import Preempted, TpuBusy, TpurunError, UsageError
from tpurun.job.attempt import Output
from tpurun.job.launcher import Job, JobResult, TrainSpec, prepare, start
from tpurun.settings import Settings
from tpurun.worker.protocol import JobStatus


def dry_run(s: Settings, spec: TrainSpec, *, local: bool, dest: str | None, local_dir: Path, out: Output) -> Job:
    """The job SPEC would be on the TPU S names (or this machine): runtime, launch model, every process's
    argv and environment, the setup; nothing is started."""
    with targets.resolve(s, local=local, worker_spec=_workers(spec), announce=out.info) as target:
        return prepare(spec, target, 0, dest=dest, local_dir=local_dir)


class TrainOutput(Output, Protocol):
    """How a `train` command reports: the launcher's reports, and what became of a `--down` job's TPU when the
    job could not be launched (the launch's error is raised after it)."""

    def down(self, down: Down) -> None: ...


def run(
    s: Settings,
    spec: TrainSpec,
    *,
    local: bool,
    dest: str | None,
    local_dir: Path,
    out: TrainOutput,
    cancel: threading.Event,
) -> tuple[JobResult, Down | None]:
    """A `train` command: `train`, and with `--down` its TPU armed before (so its watchdog deletes it should
    tpurun be gone when the job ends) and taken down after, whatever became of the job (`take_down`); a launch
    that failed takes the TPU down too, reported through OUT before its error is raised, unless another job
    holds the TPU. The job's result, and with `--down` what became of the TPU."""
    if spec.down:
        arm_down(s, local=local, out=out)
        if cancel.is_set():  # Ctrl-C while arming: nothing started, nothing deleted
            raise KeyboardInterrupt
    try:
        result = train(s, spec, local=local, dest=dest, local_dir=local_dir, out=out, cancel=cancel)
    except TpuBusy:
        if spec.down:
            out.down(Down(str(s.tpu.value), busy=True))
        raise
    except BaseException:
        if spec.down:  # the launch itself failed (a worker unreachable, ...): --down holds
            out.down(take_down(s, None, out))
        raise
    return result, take_down(s, result, out) if spec.down else None


def train(
    s: Settings,
    spec: TrainSpec,
    *,
    local: bool,
    dest: str | None,
    local_dir: Path,
    out: Output,
    cancel: threading.Event,
) -> JobResult:
    """SPEC on the TPU S names (or this machine, LOCAL), relaunched on a recreated TPU after each preemption,
    up to spec.max_restarts times; reported through OUT, stopped by CANCEL."""
    restarts = 0
    while True:
        try:
            target = targets.resolve(s, local=local, worker_spec=_workers(spec), announce=out.info)
            try:
                job = prepare(spec, target, restarts, dest=dest, local_dir=local_dir)
            except BaseException:
                target.close()
                raise
        except Preempted as exc:  # preempted before the job started: recovered like one preempted under it
            if restarts >= spec.max_restarts:
                raise
            restarts += 1
            out.warn(exc.message)
            out.info(f"restart {restarts}/{spec.max_restarts}: recreating {exc.tpu}")
            _recreate(s, exc.tpu, out)
            continue
        try:
            for kind, text in job.notes():
                (out.warn if kind == "warn" else out.info)(text)
            result = start(job, home=s.home_path, local_dir=local_dir, out=out, cancel=cancel)
        finally:
            job.release()
            target.close()
        result.restarts = restarts
        if result.state is not JobStatus.PREEMPTED or restarts >= spec.max_restarts:
            return result
        out.warn(f"{target.name} was preempted while job {job.job_id} ran")
        restarts += 1
        out.info(f"restart {restarts}/{spec.max_restarts}: recreating {target.name}")
        _recreate(s, target.name, out)


def _workers(spec: TrainSpec) -> str:
    """The workers a job runs on: every one, or those `--worker` selects (one, or all: launcher.plan)."""
    return spec.worker or "all"


def _recreate(s: Settings, name: str, out: Output) -> None:
    from tpurun.cloud import provision
    from tpurun.cloud.client import Cloud

    with out.progress() as progress:
        provision.recreate(Cloud(s), s, name, progress)


# ---------------------------------------------------------------------------- --down


def arm_down(s: Settings, *, local: bool, out: Output) -> None:
    """Before a `--down` job: the TPU S names carries what its watchdog needs to delete it, should tpurun be
    gone when the job ends."""
    from tpurun import watchdogs
    from tpurun.cloud.client import Cloud

    if local or not s.tpu.value:
        raise UsageError("--down deletes the TPU the job runs on: give one with --tpu (not with --local)")
    with out.progress() as progress:
        watchdogs.arm_down(Cloud(s), s.tpu.value, progress)


@dataclass
class Down:
    """What became of a `--down` job's TPU."""

    name: str
    job: str = ""  # the job's id ("" when its launch failed)
    deleted: bool = False
    to_watchdog: bool = False  # the job runs on detached: the TPU's watchdog deletes it when the job ends
    busy: bool = False  # kept: another job runs there, this one never started
    error: TpurunError | None = None  # the deletion failed


def take_down(s: Settings, result: JobResult | None, out: Output) -> Down:
    """After a `--down` job (RESULT None: its launch failed): delete its TPU, unless the job runs on
    (detached: its watchdog deletes the TPU when it ends) or never started because another job holds it."""
    from tpurun.cloud import provision
    from tpurun.cloud.client import Cloud

    name = s.tpu.value
    assert name, "--down is refused without a TPU"
    job = result.job.job_id if result is not None else ""
    if result is not None and result.state is JobStatus.RUNNING:
        return Down(name, job, to_watchdog=True)
    if result is not None and result.state is JobStatus.BUSY:
        return Down(name, job, busy=True)
    cloud = Cloud(s)
    by = f"`tpurun train --down` (job {job})" if job else "`tpurun train --down`"
    try:
        with out.progress() as progress:
            provision.take_down(cloud, s, name, progress, by)
    except TpurunError as exc:
        return Down(name, job, error=exc)
    return Down(name, job, deleted=True)  # and no longer the default TPU: provision.take_down forgot it
