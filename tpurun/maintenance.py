"""`tpurun maintenance`: the maintenance an API announces for a TPU, and starting it now, on the user's own
time, through the API's own method (Cloud TPU's v2alpha1 nodes.performMaintenance or
queuedResources.performMaintenanceQueuedResource; Compute Engine's instances.performMaintenance). Started
while a job runs, it ends the job: refused then unless forced (the workers' agents say which jobs run)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tpurun.cloud import identity, routing
from tpurun.cloud.client import Cloud
from tpurun.cloud.views import Maintenance
from tpurun.errors import ApiError, TpurunError, UsageError
from tpurun.fleet import targets
from tpurun.job import preflight
from tpurun.job.records import connect
from tpurun.job.status import ACTIVE
from tpurun.settings import Settings


@dataclass
class MaintenanceResult:
    tpu: str
    backend: str
    windows: list[Maintenance]
    started: list[str] = field(default_factory=list)  # where maintenance was started (`--now`)
    jobs: list[str] = field(default_factory=list)  # the jobs that ran then (started anyway: `--force`)

    def to_json(self) -> dict[str, object]:
        return {
            "tpu": self.tpu,
            "backend": self.backend,
            "maintenance": [m.to_dict() for m in self.windows],
            "started": self.started,
            "jobsStopped": self.jobs,
        }


def maintenance(
    s: Settings, *, now: bool = False, force: bool = False, progress: Callable[[str], None] = lambda _: None
) -> MaintenanceResult:
    """The maintenance announced for the TPU S names (where tpurun made or last reached it, unless a zone is
    chosen: `identity.where`); with NOW, started at once (refused while a job runs there, unless FORCE)."""
    name = str(s.tpu.value or "")
    if not name:
        raise UsageError("no TPU named: give one (NAME, --tpu or a default TPU)")
    s = identity.where(s, name)
    cloud = Cloud(s)
    found = routing.locate(cloud, name)
    if found is None:
        raise cloud.no_such_tpu(name, s.tpu)
    maker, view = found
    maker.read_maintenance([view])
    result = MaintenanceResult(name, view.backend, list(view.maintenance))
    if not now:
        return result
    pending = [m for m in view.maintenance if m.status == "PENDING"]
    if not pending:
        said = "under way already" if view.maintenance else "announced"
        raise UsageError(f"{name}: no maintenance is {said}: there is nothing to start")
    try:
        result.jobs = running_jobs(s)
    except UsageError:
        if not force:
            raise  # forced: started without the workers' word
    if result.jobs and not force:
        raise UsageError(
            f"job(s) {', '.join(result.jobs)} run on {name}: maintenance takes the hosts down and ends them",
            hint=f"`tpurun cancel JOB` first, or `tpurun maintenance {name} --now --force` to start it anyway",
        )
    result.started = maker.start_maintenance(view, progress)
    return result


def running_jobs(s: Settings) -> list[str]:
    """The jobs that run (or start) on any worker of the TPU S names, as its workers' agents say; a TPU whose
    workers cannot all be asked is refused (UsageError), since a job may run on those."""
    try:
        with targets.resolve(s) as target:
            connect(target)
            answers = preflight.ask(target, target.python(), [])
    except (TpurunError, ApiError) as exc:
        raise UsageError(
            f"cannot tell whether a job runs on {s.tpu.value}: {exc.message}",
            hint="`--force` starts the maintenance without asking the workers",
        ) from None
    return sorted({j.job_id for a in answers.values() for j in a.jobs if j.status in ACTIVE})
