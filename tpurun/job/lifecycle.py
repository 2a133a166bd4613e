"""A `train` command's whole course around the launcher: the TPU the settings name resolved (again after each
restart), the job only shown (--dry-run) or run, relaunched after each end its restart budget allows (job.ends),
and with --down the TPU armed for deletion before and deleted after."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tpurun.errors import ExitCode, Preempted, TpuBusy, TpurunError, UnreachableError, UsageError
from tpurun.fleet import targets
from tpurun.job.attempt import Output
from tpurun.job.ends import Budgets, End, on_notice
from tpurun.job.launcher import Job, JobResult, TrainSpec, prepare, start
from tpurun.job.spend_limit import SpendLimit, limit
from tpurun.settings import Settings


def dry_run(s: Settings, spec: TrainSpec, *, local: bool, dest: str | None, local_dir: Path, out: Output) -> Job:
    """The job SPEC would be on the TPU S names (or this machine): runtime, launch model, every process's
    argv and environment, the setup; nothing is started."""
    check(spec)
    with targets.resolve(s, local=local, worker_spec=_workers(spec), announce=out.info) as target:
        return prepare(spec, target, 0, dest=dest, local_dir=local_dir)


def check(spec: TrainSpec) -> None:
    """SPEC's restart budgets and --on-notice, refused (UsageError) before anything is asked or started."""
    Budgets.parse(spec.restarts, spec.max_restarts)
    on_notice(spec.on_notice, "")
    if spec.restarts and spec.detach:
        raise UsageError("--restarts relaunches an attached job: a detached one is not followed (`tpurun logs`)")


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
) -> Trained:
    """A `train` command: `train`, and with `--down` its TPU armed before (so its watchdog deletes it should
    tpurun be gone when the job ends) and taken down after, whatever became of the job (`take_down`); a launch
    that failed takes the TPU down too, reported through OUT before its error is raised, unless another job
    holds the TPU. The job's result, and with `--down` what became of the TPU."""
    check(spec)
    spend = None
    if spec.budget:  # its price asked before anything is armed or started: a TPU without one is refused
        spend = limit(s, spec.budget, local=local)
        out.info(spend.line())
    if spec.down:
        arm_down(s, local=local, out=out)
        if cancel.is_set():  # Ctrl-C while arming: nothing started, nothing deleted
            raise KeyboardInterrupt
    try:
        result = train(s, spec, local=local, dest=dest, local_dir=local_dir, out=out, cancel=cancel, spend=spend)
    except TpuBusy:
        if spec.down:
            out.down(Down(str(s.tpu.value), busy=True))
        raise
    except BaseException:
        if spec.down:  # the launch itself failed (a worker unreachable, ...): --down holds
            out.down(take_down(s, None, out))
        raise
    return Trained(result, take_down(s, result, out) if spec.down else None)


@dataclass
class Trained:
    """A `train` command's end: its job's (RESULT), and with `--down` what became of its TPU (DOWN)."""

    result: JobResult
    down: Down | None = None

    @property
    def exit_code(self) -> int:
        """`train`'s exit code: the job's end's (`JobResult.exit_code`); after a job that succeeded, a `--down`
        that could not delete the TPU gives its error's."""
        code = self.result.exit_code
        if code is ExitCode.OK and self.down is not None and self.down.error is not None:
            return self.down.error.exit_code
        return code


def train(
    s: Settings,
    spec: TrainSpec,
    *,
    local: bool,
    dest: str | None,
    local_dir: Path,
    out: Output,
    cancel: threading.Event,
    spend: SpendLimit | None = None,
) -> JobResult:
    """SPEC on the TPU S names (or this machine, LOCAL), relaunched after each end its budget allows (job.ends:
    on a recreated TPU after a preemption, once the TPU is usable again after maintenance or a lost worker, at
    once after a program failure); reported through OUT, stopped by CANCEL or when SPEND, its --budget, is
    spent (its clock started at the first start, shared by the restarts)."""
    budgets = Budgets.parse(spec.restarts, spec.max_restarts)
    reason = ""  # why the attempt before ended
    spent: list[float | None] = []  # each attempt's cost
    while True:
        try:
            target = targets.resolve(s, local=local, worker_spec=_workers(spec), announce=out.info)
            try:
                job = prepare(spec, target, budgets.total, dest=dest, local_dir=local_dir, reason=reason)
            except BaseException:
                target.close()
                raise
        except (Preempted, UnreachableError) as exc:  # before the job started: recovered as one that ended so
            kind = End.PREEMPTED if isinstance(exc, Preempted) else End.LOST
            if (kind is End.LOST and not budgets.total) or cancel.is_set() or not budgets.spend(kind):
                raise
            reason = kind.cause
            out.warn(exc.message)
            _recover(s, str(s.tpu.value or ""), kind, budgets, out, cancel=cancel)
            continue
        try:
            for note_kind, text in job.notes():
                (out.warn if note_kind == "warn" else out.info)(text)
            began = threading.Event()
            said = threading.Thread(target=_say_maintenance, args=(target, out, began), daemon=True)
            if not target.local:
                said.start()
            try:
                result = start(job, home=s.home_path, local_dir=local_dir, out=out, cancel=cancel, spend=spend,
                               began=began)  # fmt: skip
            finally:
                began.set()
            if said.is_alive():
                said.join(timeout=20)  # (its import and API call follow the start now)
        finally:
            job.release()
            target.close()
        result.budgets, result.spend = budgets, spend
        spent.append(result.cost)
        result.cost = None if None in spent else sum(c for c in spent if c is not None)  # every attempt's
        end = result.end
        if end is None or spec.detach or cancel.is_set() or not budgets.spend(end):
            return result
        reason = end.cause
        out.warn(ended_line(end, target.name, job.job_id))
        notice = result.run.notice if result.run is not None else None
        after = notice.deadline if notice is not None and end is End.MAINTENANCE else None
        _recover(s, target.name, end, budgets, out, after=after, cancel=cancel)  # KeyboardInterrupt once stopped


def _say_maintenance(target: targets.Target, out: Output, began: threading.Event) -> None:
    """Warn of the maintenance the API announces for TARGET: the job may be interrupted by it. Asked once the job
    BEGAN everywhere (or its start ended), not during its start: Google's client alone takes a third of a second
    of this process's CPU to import, which the start's own threads would wait for."""
    began.wait()
    from tpurun.cloud import routing

    try:
        found = routing.locate(target.cloud(), target.name)
        if found is None:
            return
        maker, view = found
        maker.read_maintenance([view])
    except TpurunError:
        return
    for m in view.maintenance:
        out.warn(f"{target.name}: {m.summary()}: a job running then is interrupted (`tpurun maintenance` shows it)")


def ended_line(end: End, name: str, job: str) -> str:
    """What ended job JOB on NAME, in one line."""
    return {
        End.PREEMPTED: f"{name} was preempted while job {job} ran",
        End.MAINTENANCE: f"maintenance of a host of {name} cut job {job} short",
        End.LOST: f"job {job} lost a worker of {name} (the TPU is neither preempted nor in maintenance)",
    }.get(end, f"job {job} on {name} ended ({end}): {end.describe()}")


def _recover(
    s: Settings,
    name: str,
    kind: End,
    budgets: Budgets,
    out: Output,
    *,
    after: float | None = None,
    cancel: threading.Event,
) -> None:
    """Make NAME fit to run the job again after an end of KIND: recreated after a preemption (a spot TPU cannot
    be restarted), waited for after maintenance (its window begun, AFTER: when its notice said) or a lost worker,
    as it is after a program failure."""
    from tpurun import config
    from tpurun.cloud import provision
    from tpurun.cloud.client import Cloud

    program = kind.cause == End.FAILED.cause  # failed or hung: the TPU is as it was
    if kind is End.PREEMPTED:
        what = f"recreating {name}"
    else:
        what = "relaunching" if program else f"waiting for {name} to be usable again"
    out.info(f"restart {budgets.left(kind)}: {what} (the {kind.cause} budget; restart {budgets.total} in all)")
    try:
        if not program and name:
            with out.progress() as progress:
                if kind is End.PREEMPTED:
                    provision.recreate(Cloud(s), s, name, progress)
                else:
                    timeout = config.RECOVER_TIMEOUT.number()
                    provision.wait_usable(
                        Cloud(s), name, progress, timeout=timeout, after=after, cancelled=cancel.is_set
                    )
    except KeyboardInterrupt:
        cancel.set()
    if cancel.is_set():  # Ctrl-C (or SIGTERM) during the wait: said, and nothing relaunched
        out.warn(f"interrupted while {what}: the job was not relaunched")
        raise KeyboardInterrupt


def _workers(spec: TrainSpec) -> str:
    """The workers a job runs on: every one, or those `--worker` selects (one, or all: launcher.plan)."""
    return spec.worker or "all"


# ---------------------------------------------------------------------------- --down


def arm_down(s: Settings, *, local: bool, out: Output) -> None:
    """Before a `--down` job: the TPU S names carries what its watchdog needs to delete it, should tpurun be
    gone when the job ends, and its watchdog runs (or the job is refused here, before it starts)."""
    from tpurun import watchdogs
    from tpurun.cloud.client import Cloud

    if local or not s.tpu.value:
        raise UsageError("--down deletes the TPU the job runs on: give one with --tpu (not with --local)")
    with out.progress() as progress:
        watchdogs.arm_down(Cloud(s), s.tpu.value, progress, s)


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
    if result is not None and result.busy:
        return Down(name, job, busy=True)
    started = result is not None and result.run is not None and not result.run.unreachable
    if result is not None and result.end is None and started:  # --detach: started and left running
        return Down(name, job, to_watchdog=True)
    cloud = Cloud(s)
    by = f"`tpurun train --down` (job {job})" if job else "`tpurun train --down`"
    try:
        with out.progress() as progress:
            provision.take_down(cloud, s, name, progress, by)
    except TpurunError as exc:
        return Down(name, job, error=exc)
    return Down(name, job, deleted=True)  # and no longer the default TPU: provision.take_down forgot it
