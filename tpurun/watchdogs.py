"""A TPU's watchdogs set up from this machine: `tpurun autostop` (the setting in the TPU's metadata, the watchdog
started over SSH on every worker where the TPU's boot does not start it) and `train --down`'s arming (the
setting the watchdog reads, and the watchdog started the same way, the job refused before its start where it
cannot be). The watchdog runs as root: started over SSH, it needs passwordless sudo of the user tpurun logs in
as, which OS Login gives only with its admin role (said so, naming the account). Above the cloud layer and `targets`: it reaches workers.
What the setting is and what the watchdogs report is tpurun/cloud/autostop.py's."""

from __future__ import annotations

from collections.abc import Callable

from tpurun.cloud import autostop, provision, startup
from tpurun.cloud.backend import Backend
from tpurun.cloud.client import Cloud
from tpurun.cloud.views import NodeView
from tpurun.errors import ApiError, UnreachableError, UsageError
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
    if idle and not _started_at_boot(view):
        progress(f"{name}: starting the watchdog on every worker")
        _start_watchdogs(cloud, s, view, "autostop is unchanged")
    progress(f"{name}: setting autostop")
    entries = autostop.metadata(_resources(maker, view), idle, action, current.spend if current else None)
    maker.update_metadata(view, lambda _md: entries)
    return autostop.Setting(idle, action)


def _started_at_boot(view: NodeView) -> bool:
    """Whether every slice's boot starts the watchdog (tpurun's startup wrapper carries it: a TPU tpurun made), as
    root, whatever the user tpurun logs in as may do."""
    return all(startup.WATCHDOG_KEY in part.metadata.get("startup-script", "") for part in view.parts)


def _start_watchdogs(cloud: Cloud, s: Settings, view: NodeView, undone: str) -> None:
    """The watchdog started over SSH on every worker of the TPU VIEW shows; refused in one line where it could not
    be, saying what is left UNDONE."""
    # imported here: only a TPU tpurun did not create needs its workers reached (paramiko loaded) for this
    from tpurun.fleet import bundle, targets

    name = view.name
    with targets.resolve(s.naming(name, project=cloud.project, zone=cloud.zone, source="the TPU's watchdog")) as t:
        failed = bundle.start_watchdogs(t)
    if not failed:
        return
    w, why = sorted(failed.items())[0]
    if why == bundle.NO_ROOT_THERE:
        raise _no_root(cloud, s, view, w, undone)
    raise UnreachableError(
        f"{name}: the watchdog could not be started on worker {w}: {why}; {undone}",
        hint=f"`tpurun attach {name}` installs tpurun's ssh key; `tpurun doctor` shows what is wrong",
    )


def _no_root(cloud: Cloud, s: Settings, view: NodeView, worker: int, undone: str) -> UsageError:
    """The watchdog needs root on WORKER, and the user tpurun logs in as has no passwordless sudo there: under OS
    Login, for want of the admin role (what the account lacks named); else the TPU's own setup."""
    from tpurun.cloud import oslogin

    name = view.name
    instead = f"or a TPU made by `tpurun create`, whose boot starts the watchdog as root ({name}'s does not)"
    if oslogin.policy_of(cloud, view.metadata).oslogin:
        account = oslogin.account_for(s, name)
        return UsageError(
            f"{name}: the watchdog needs root on worker {worker}, and OS Login gives {account} no sudo there: that "
            f"takes the Compute OS Admin Login role ({oslogin.ADMIN_ROLE}) in project {cloud.project}; {undone}",
            hint=f"an administrator of the project grants {account} {oslogin.ADMIN_ROLE}; {instead}",
        )
    return UsageError(
        f"{name}: the watchdog needs root on worker {worker}, and the user tpurun logs in as there has no "
        f"passwordless sudo; {undone}",
        hint=f"a user with it (the users of metadata `ssh-keys` have it); {instead}",
    )


def arm_down(cloud: Cloud, name: str, progress: Callable[[str], None], s: Settings) -> None:
    """Before a `train --down` job: every slice of NAME carries a watchdog setting (autostop off where none
    was set), so the watchdog the job's agent starts knows the TPU's slices and the API. Where the TPU's boot does
    not start the watchdog, it is started now over SSH (S: the settings for that), and the job refused where it
    cannot be: the TPU would outlive a job whose tpurun is gone."""
    maker, view = _ready(cloud, name)
    if not _started_at_boot(view):
        progress(f"{name}: starting the watchdog on every worker for --down")
        _start_watchdogs(cloud, s, view, "the job was not started, since nothing would delete the TPU without tpurun")
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
