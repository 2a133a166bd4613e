"""A TPU's watchdogs set up from this machine: `tpurun autostop` (the setting in the TPU's metadata, the watchdog
started over SSH on every worker where the TPU's boot does not start it) and `train --down`'s arming (the
setting the watchdog a job's agent starts reads). Above the cloud layer and `targets`: it reaches workers.
What the setting is and what the watchdogs report is tpurun/cloud/autostop.py's."""

from __future__ import annotations

from collections.abc import Callable

from tpurun.cloud import autostop, provision, startup
from tpurun.cloud.backend import Backend
from tpurun.cloud.client import Cloud
from tpurun.cloud.views import NodeView
from tpurun.errors import ApiError, UnreachableError
from tpurun.settings import Settings
from tpurun.worker.watchdog_reports import WatchdogConfig


def configure(
    cloud: Cloud,
    name: str,
    idle: int,
    action: str | None,
    progress: Callable[[str], None],
    s: Settings,
) -> autostop.Setting:
    """Set (IDLE > 0) or turn off (0) autostop on the TPU NAME. Where tpurun's startup wrapper does not
    start the watchdog at boot (a TPU tpurun did not create), it is started first over SSH (S: the settings
    for tpurun's key and pinned host keys)."""
    maker, view = _ready(cloud, name)
    current = autostop.read(view.metadata)
    action = action or (current.action if current else "delete")
    autostop.check_action(action, maker.cannot_stop(view, "stop"))
    if idle and any(startup.WATCHDOG_KEY not in part.metadata.get("startup-script", "") for part in view.parts):
        progress(f"{name}: starting the watchdog on every worker")
        failed = _start_watchdogs(s.naming(name, project=cloud.project, zone=cloud.zone, source="autostop"))
        if failed:
            w, why = sorted(failed.items())[0]
            raise UnreachableError(
                f"{name}: the watchdog could not be started on worker {w}: {why}; autostop is unchanged",
                hint=f"`tpurun attach {name}` installs tpurun's ssh key; `tpurun doctor` shows what is wrong",
            )
    progress(f"{name}: setting autostop")
    entries = autostop.metadata(_resources(maker, view), idle, action, current.spend if current else None)
    maker.update_metadata(view, lambda _md: entries)
    return autostop.Setting(idle, action)


def _start_watchdogs(s: Settings) -> dict[int, str]:
    """The watchdog started on every worker of the TPU S names: {worker: why not} where it could not be."""
    # imported here: only a TPU tpurun did not create needs its workers reached (paramiko loaded) for this
    from tpurun.fleet import bundle, targets

    with targets.resolve(s) as target:
        return bundle.start_watchdogs(target)


def arm_down(cloud: Cloud, name: str, progress: Callable[[str], None]) -> None:
    """Before a `train --down` job: every slice of NAME carries a watchdog setting (autostop off where none
    was set), so the watchdog the job's agent starts knows the TPU's slices and the API."""
    maker, view = _ready(cloud, name)
    entries = autostop.metadata(_resources(maker, view), 0, "delete")
    if any(autostop.read(part.metadata) is None for part in view.parts):
        progress(f"{name}: setting up its watchdog for --down")
    maker.update_metadata(view, lambda md: None if autostop.read(md) is not None else entries)


def _ready(cloud: Cloud, name: str) -> tuple[Backend, NodeView]:
    """NAME's backend and view, every slice of it existing."""
    maker, view = provision.whole(cloud, name, "autostop")
    if view.gone:
        raise ApiError(f"{name}: the queued resource is {view.state} and not every slice exists yet")
    return maker, view


def _resources(maker: Backend, view: NodeView) -> WatchdogConfig:
    many_hosts = len(view.workers) > len(view.parts)
    return maker.watchdog_resources(view.name, [p.name for p in view.parts], many_hosts, view)
