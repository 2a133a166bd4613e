"""Provisioning: create, attach, list, describe, delete, stop and start TPUs, whichever API makes them
(tpurun.cloud.routing finds or chooses the backend; each backend checks what it is asked for).

Everything is validated locally before the first API call, so bad input never creates anything.
`create` only returns when every worker finished its startup script (or one failed, with its log
tail), with host keys pinned from guest attributes and tpurun's key in `ssh-keys`.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tpurun import config, settings, ui
from tpurun.cloud import autostop, identity, keys, multislice, oslogin, routing, spend, startup
from tpurun.cloud.backend import Backend, CreateSpec, Deleted, GuestAttributes, Kind, Request
from tpurun.cloud.client import Cloud
from tpurun.cloud.views import GONE, MAINTENANCE, PREEMPTED, READY, REPAIRING, STOPPED, TERMINATED, NodeView
from tpurun.errors import ApiError, ExitCode, NoSuchTpu, ProgramFailed, TpurunError, UsageError
from tpurun.naming import parse_duration, validate_name
from tpurun.topology import Topology, from_machine_type, parse_accelerator_type, vm_topology
from tpurun.worker.protocol import NOTICE_LEAD

if TYPE_CHECKING:
    from tpurun.cloud.prices import Price

__all__ = ["CreateSpec", "NodeView", "validate_name"]  # what the CLI takes from here besides the functions

LABEL_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")

log = logging.getLogger(__name__)


def parse_labels(items: list[str]) -> dict[str, str]:
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not LABEL_RE.match(key) or not LABEL_VALUE_RE.match(value):
            raise UsageError(
                f"invalid --label '{item}': expected KEY=VALUE, KEY starting with a lowercase letter; "
                "lowercase letters, digits, '_' and '-' only"
            )
        labels[key] = value
    return labels


# ---------------------------------------------------------------------------- progress


class StatusLines:
    """Status lines while waiting, each shown once (a `backend.Progress`): a spinner on a terminal, one line per
    change when piped."""

    def __init__(self, show: Callable[[str], None]) -> None:
        self.show = show
        self.last = ""

    def __call__(self, text: str) -> None:
        if text != self.last:
            self.last = text
            self.show(text)


# ---------------------------------------------------------------------------- create


@dataclass
class CreateResult:
    view: NodeView
    reports: list[startup.StartupReport]
    default_in: Path | None = None  # the tpurun.toml that now names it this directory's default TPU (`create`)


def prepare_create(spec: CreateSpec) -> Request:
    """Everything that can be checked without the API, before the settings' project and zone are: the watchdog's
    setting made for a stand-in of the TPU's resources, of their size (`_watched` sets the TPU's own)."""
    validate_name(spec.name)
    topo = shape_of(spec)
    kind = routing.backend_for(topo, spec.backend)
    maker = routing.backend_class(kind)
    maker.check_create(spec, topo)
    if spec.spot and spec.preemptible:
        raise UsageError("choose one of --spot and --preemptible")
    multislice.check_request(spec.name, topo, spec.slices)
    if spec.max_run_duration and not spec.flex_start:
        raise UsageError("--max-run-duration needs --flex-start")
    max_run = maker.run_limit(spec)
    if spec.valid_until and not (spec.queued or spec.slices > 1 or spec.flex_start):
        raise UsageError("--valid-until only applies with --queued, --flex-start (or --slices)")
    valid_until = parse_duration(spec.valid_until) if spec.valid_until else None
    user_script = None
    if spec.startup_script is not None:
        path = spec.startup_script
        if not path.is_file():
            raise UsageError(f"--startup-script {path}: no such file")
        try:
            user_script = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--startup-script {path}: cannot read it ({exc})") from None
    code = None
    if spec.code:
        directory, _, dest = spec.code.partition(":")
        src = Path(directory).expanduser()
        code = startup.pack_code(src, dest or f"{startup.DEFAULT_CODE_DEST}/{src.resolve().name}")
    data = [startup.parse_data_item(d) for d in spec.data]
    for cmd in spec.setup:
        if not cmd.strip():
            raise UsageError("--setup needs a command")
    labels = parse_labels(spec.labels)
    idle = autostop.parse_idle(spec.autostop) if spec.autostop else 0
    if spec.autostop_action and not spec.autostop:
        raise UsageError("--autostop-action needs --autostop")
    action = spec.autostop_action or "delete"
    autostop.check_action(action, maker.cannot_stop_asked(spec, topo))
    watch = autostop.metadata(autostop.stand_in(_nodes(spec)), idle, action)
    metadata = startup.compose_metadata(user_script=user_script, setup=spec.setup, code=code, data=data, extra=watch)
    return Request(topo, kind, metadata, labels, valid_until, max_run)


def _nodes(spec: CreateSpec) -> list[str]:
    """The Cloud TPU nodes (or slices) SPEC makes: NAME, or each slice of a multislice TPU."""
    return multislice.slice_ids(spec.name, spec.slices) if spec.slices > 1 else [spec.name]


def _watched(cloud: Cloud, spec: CreateSpec, request: Request) -> None:
    """REQUEST's watchdog setting made for the TPU's own resources where CLOUD says (in place of the stand-in's)."""
    resources = routing.of_kind(cloud, request.backend).watchdog_resources(
        spec.name, _nodes(spec), request.topology.multi_host, None
    )
    idle = autostop.parse_idle(spec.autostop) if spec.autostop else 0
    spend = autostop.spend_limit(cloud, spec, request)
    request.metadata.update(autostop.metadata(resources, idle, spec.autostop_action or "delete", spend))
    startup.check_limits(request.metadata)


def shape_of(spec: CreateSpec) -> Topology:
    """The slice asked for, in either spelling: an accelerator type (tpu7x-32), or Compute Engine's machine
    type and topology (tpu7x-standard-4t, 2x2x4; a single VM's topology may be left out)."""
    if spec.accelerator_type and (spec.machine_type or spec.topology):
        raise UsageError("give either --accelerator-type, or --machine-type with --topology")
    if spec.accelerator_type:
        return parse_accelerator_type(spec.accelerator_type)
    if spec.topology and not spec.machine_type:
        raise UsageError("--topology needs --machine-type (e.g. --machine-type tpu7x-standard-4t --topology 2x2x4)")
    if not spec.machine_type:
        raise UsageError("give the TPU's type: --accelerator-type (e.g. v4-8, tpu7x-32) or --machine-type")
    if spec.topology:
        return from_machine_type(spec.machine_type, spec.topology)
    return vm_topology(spec.machine_type)


class CreateInterrupted(TpurunError):
    """Ctrl-C after `create` asked for the TPU NAME, which KIND's API may be making: WHAT it was asked for, in
    the user's words. The command deletes it (`take_back`) before it exits."""

    exit_code = ExitCode.INTERRUPTED

    def __init__(self, name: str, kind: Kind, what: str) -> None:
        super().__init__(f"interrupted while {what} was being made")
        self.name, self.kind, self.what = name, kind, what


@dataclass
class Created:
    """What `tpurun create` came to: the TPU made (MADE: with its startup reports, or, without waiting, its view as
    the API has it), or, after Ctrl-C, what it had asked for deleted (MADE None)."""

    name: str
    made: CreateResult | NodeView | None = None
    taken_back: list[str] | None = None  # interrupted: what went besides the TPU; None when nothing of it was made
    price: Price | None = None  # with `--budget`: the price per hour it is counted at

    @property
    def view(self) -> NodeView | None:
        return self.made.view if isinstance(self.made, CreateResult) else self.made

    @property
    def exit_code(self) -> ExitCode:
        """0 made; 130 interrupted (what it had asked for deleted)."""
        return ExitCode.INTERRUPTED if self.made is None else ExitCode.OK


def create(
    s: settings.Settings,
    spec: CreateSpec,
    progress: Callable[[str], None],
    *,
    delete_on_failure: bool = False,
    announce: Callable[[str], None] | None = None,
) -> Created:
    """`tpurun create`: SPEC checked before the settings' project and zone are (bad input creates nothing), then
    made there (`make`). Ctrl-C once it was asked for deletes what was asked for and waits until it is gone
    (ANNOUNCE hears that it begins); a second Ctrl-C stops at once, raising an error that names the command that
    deletes what is left. A failed startup raises StartupFailed, after deleting the TPU with DELETE_ON_FAILURE."""
    request = prepare_create(spec)
    cloud = Cloud(s)
    try:
        try:
            return Created(spec.name, made=make(cloud, s, spec, request, progress), price=request.price)
        except CreateInterrupted as stopped:
            if announce is not None:
                announce(
                    f"interrupted: deleting what this create asked for ({stopped.what}) and waiting until it is "
                    "gone; Ctrl-C again stops at once"
                )
            return Created(spec.name, taken_back=_taken_back(cloud, s, stopped, progress))
    except KeyboardInterrupt as again:  # wherever it came, it came while the first one's was on its way or handled
        first = again.__context__
        while first is not None and not isinstance(first, CreateInterrupted):
            first = first.__context__
        if first is None:
            raise
        raise TpurunError(
            f"interrupted again: stopped before {spec.name} was deleted",
            hint=f"{delete_command(cloud, spec.name)} deletes what is left of it",
            exit_code=ExitCode.INTERRUPTED,
        ) from None
    except StartupFailed as failed:
        if not delete_on_failure:
            raise
        try:
            take_down(cloud, s, spec.name, progress, "`tpurun create --delete-on-failure`")
        except (TpurunError, OSError) as exc:  # the startup's failure still said, and what is left of the TPU
            why = exc.message if isinstance(exc, TpurunError) else str(exc)
            hint = (
                f"--delete-on-failure could not delete {spec.name}: {why}; "
                f"`tpurun delete {spec.name} --yes` deletes what is left of it"
            )
            raise StartupFailed(failed.message, view=failed.view, reports=failed.reports, hint=hint) from None
        raise StartupFailed(failed.message, view=failed.view, reports=failed.reports, deleted=True) from None


def make(
    cloud: Cloud, s: settings.Settings, spec: CreateSpec, request: Request, progress: Callable[[str], None]
) -> CreateResult | NodeView:
    """Make the TPU SPEC asks for (REQUEST: `prepare_create`'s); with `spec.wait`, return once every worker
    finished its startup script (else its view as the API has it). Ctrl-C once the name is known to be free
    (whatever exists of it then is what this create asked for) raises CreateInterrupted."""
    taken = routing.locate(cloud, spec.name, strict=True)
    if taken is not None:  # one name, one TPU: every command finds a TPU by its name in either API
        owner, view = taken
        the_api = f"the {owner.kind.api_name}" if owner.kind is Kind.TPU_API else owner.kind.api_name
        raise UsageError(
            f"{spec.name}: {the_api} already has a TPU of that name ({view.accelerator_type}, {view.state})",
            hint=f"choose another name, or `tpurun delete {spec.name}` first",
        )
    _watched(cloud, spec, request)
    home = s.home_path
    identity.forget(home, cloud.project, cloud.zone, spec.name)  # a new TPU: a new identity
    _, public = keys.ensure_key(home)
    if not oslogin.policy_of(cloud, request.metadata).oslogin:  # (under OS Login the workers ignore ssh-keys)
        request.metadata["ssh-keys"] = keys.ssh_keys_entry(keys.ssh_user(), public) + "\n"
    maker = routing.of_kind(cloud, request.backend)
    asked = CreateInterrupted(spec.name, maker.kind, maker.asked_for(spec, request.topology))
    try:
        maker.create(spec, request, progress)
        spend.remember(home, cloud.project, cloud.endpoint, "created", view := tpu(cloud, spec.name))
        if not spec.wait:
            return view
        made = until_started(cloud, maker, home, spec.name, progress, timeout=spec.timeout)
    except KeyboardInterrupt:
        raise asked from None
    if not s.tpu.value:  # no TPU named here yet: this one becomes the directory's default
        made.default_in = settings.write_project_setting("tpu", spec.name)
    return made


def delete_command(cloud: Cloud, name: str) -> str:
    """The command that deletes NAME (what is left of it), wherever it is run."""
    return f"`tpurun delete {name} --yes --project {cloud.project} --zone {cloud.zone}`"


def _taken_back(
    cloud: Cloud, s: settings.Settings, stopped: CreateInterrupted, progress: Callable[[str], None]
) -> list[str] | None:
    """`take_back`, its failure an error that names the command deleting what is left (exit as the failure's)."""
    try:
        return take_back(cloud, s, stopped, progress)
    except TpurunError as exc:
        raise TpurunError(
            f"interrupted, and {stopped.name} could not be deleted: {exc.message}",
            hint=f"{delete_command(cloud, stopped.name)} deletes what is left of it",
            exit_code=exc.exit_code,
        ) from None


def take_back(
    cloud: Cloud, s: settings.Settings, stopped: CreateInterrupted, progress: Callable[[str], None]
) -> list[str] | None:
    """Delete whatever exists of what the interrupted create STOPPED asked for, and wait until it is gone: what
    went besides the TPU, as `delete` says it; None when nothing of it had been made."""
    deleted = routing.of_kind(cloud, stopped.kind).take_back(stopped.name, progress)
    if deleted is None:
        return None
    identity.bury(s.home_path, cloud.project, cloud.zone, stopped.name, "Ctrl-C during `tpurun create`")
    return deleted.also


# ---------------------------------------------------------------------------- finding


def locate(cloud: Cloud, name: str) -> tuple[Backend, NodeView]:
    """The TPU NAME and who made it; NoSuchTpu (exit 3, with similar names) when there is none."""
    validate_name(name)
    found = routing.locate(cloud, name)
    if found is None:
        raise cloud.no_such_tpu(name)
    return found


def tpu(cloud: Cloud, name: str) -> NodeView:
    return locate(cloud, name)[1]


def whole(cloud: Cloud, name: str, command: str) -> tuple[Backend, NodeView]:
    """The TPU NAME, refused when NAME is one slice of a multislice TPU (those are acted on together)."""
    maker, view = locate(cloud, name)
    if view.slice_of is not None:
        tpu_name, index = view.slice_of
        raise UsageError(
            f"{name} is slice {index} of the multislice TPU {tpu_name}; its slices are acted on together",
            hint=f"`tpurun {command} {tpu_name}`",
        )
    return maker, view


# ---------------------------------------------------------------------------- waiting


def wait_ready(cloud: Cloud, maker: Backend, name: str, progress: Callable[[str], None], *, timeout: float) -> NodeView:
    """NAME, which MAKER makes, once every slice of it is READY."""
    deadline = time.monotonic() + timeout
    for _ in cloud.iter_poll():
        view = maker.find(name)
        if view is None:
            progress(f"{name}: waiting for it to appear")
        else:
            progress(f"{name}: {view.state}")
            if set(view.states) == {READY}:
                return view
            bad = sorted({st for st in view.states if st in (PREEMPTED, TERMINATED, STOPPED)})
            if bad:
                raise ApiError(f"{name} went {bad[0]} while waiting for it to be READY")
        if time.monotonic() > deadline:
            raise ApiError(f"{name} is not READY after {timeout:.0f} s", hint="check `tpurun describe " + name + "`")
    raise AssertionError("unreachable")


def wait_startup(
    cloud: Cloud, view: NodeView, progress: Callable[[str], None], *, timeout: float
) -> list[startup.StartupReport]:
    """Poll guest attributes until every worker's startup wrapper finished (or one failed)."""
    maker = routing.maker_of(cloud, view)
    name, n = view.name, len(view.workers)
    deadline = time.monotonic() + timeout
    reports: list[startup.StartupReport] = []
    for _ in cloud.iter_poll(max(config.POLL_INTERVAL.number(), 0.2)):
        reports = [startup.parse_report(a) for a in maker.guest_attributes(view, startup.NAMESPACE + "/")]
        done = sum(r.finished for r in reports)
        failed = [i for i, r in enumerate(reports) if r.status is startup.StartupStatus.FAILED]
        steps = ", ".join(sorted({r.step or r.status for r in reports if not r.finished})) or "-"
        progress(f"{name}: startup finished on {done}/{n} workers (running: {steps})")
        if done == n or failed:
            return reports
        if time.monotonic() > deadline:
            waiting = [w.name for w, r in zip(view.workers, reports, strict=True) if not r.finished]
            raise ApiError(
                f"{name}: the startup script has not finished on worker(s) {','.join(waiting)} after {timeout:.0f} s",
                hint=f"look at its log with `tpurun ssh --tpu {name} --worker {waiting[0]} -- cat {startup.LOG_PATH}`",
            )
    raise AssertionError("unreachable")


def _raise_if_startup_failed(view: NodeView, reports: list[startup.StartupReport]) -> None:
    for w, r in zip(view.workers, reports, strict=True):
        if r.status is startup.StartupStatus.FAILED:
            failed_items = "; ".join(v for v in r.data.values() if v.startswith("failed"))
            detail = f" ({failed_items})" if failed_items else ""
            tail = "\n".join("    " + line for line in r.tail.splitlines()[-20:])
            worker = f"worker {w.index}" if w.slice is None else f"worker {w.name}"
            raise StartupFailed(
                f"{view.name}: the startup script failed on {worker} ({w.internal_ip}) with exit code "
                f"{r.exit_code} in step '{r.step}'{detail}; last lines of {startup.LOG_PATH}:\n{tail}",
                view=view,
                reports=reports,
            )


class StartupFailed(ProgramFailed):
    """A worker's startup script failed: VIEW is the TPU then, kept (billing) or, DELETED, deleted
    (`create --delete-on-failure`)."""

    def __init__(
        self,
        message: str,
        *,
        view: NodeView,
        reports: list[startup.StartupReport],
        deleted: bool = False,
        hint: str | None = None,
    ) -> None:
        kept = (
            f"{view.name} is still running, and billing: `tpurun delete {view.name} --yes` deletes it "
            "(`tpurun create --delete-on-failure` does that at once); fix the script and create it again"
        )
        super().__init__(message, hint=hint or (f"{view.name} was deleted (--delete-on-failure)" if deleted else kept))
        self.view = view
        self.reports = reports


def until_started(
    cloud: Cloud, maker: Backend, home: Path, name: str, progress: Callable[[str], None], *, timeout: float
) -> CreateResult:
    """Wait for READY and every worker's startup script, pin the host keys and remember where the workers
    are (the next command reaches them without asking the API); StartupFailed if one failed."""
    ready = wait_ready(cloud, maker, name, progress, timeout=timeout)
    reports = wait_startup(cloud, ready, progress, timeout=timeout)
    pin_host_keys(cloud, home, ready)
    login = oslogin.policy_of(cloud, ready.metadata)
    identity.remember(identity.path(home, cloud.project, cloud.zone, name), identity.Endpoints.of(ready, login))
    ready.with_reports(reports)
    _raise_if_startup_failed(ready, reports)
    return CreateResult(ready, reports)


# ---------------------------------------------------------------------------- attach & keys


def host_keys_from(attrs: GuestAttributes, view: NodeView) -> dict[str, str]:
    """{alias: key} of every worker of VIEW, from its `hostkeys/` guest attributes."""
    pinned = {}
    for w, items in zip(view.workers, attrs, strict=True):
        key = keys.published_host_key(items)
        if not key:
            raise ApiError(
                f"worker {w.name} ({w.internal_ip}) of {view.name} has not published its ssh host key in guest "
                "attributes yet",
                hint="wait a minute after the TPU is READY and try again",
            )
        pinned[w.host_key] = key
    return pinned


def pin_host_keys(cloud: Cloud, home: Path, view: NodeView) -> None:
    """Pin every worker's host key as its VM published it, under the worker's identity; and, from the same answer,
    give each worker the name IAP's tunnel knows its VM by (`instance`): its VM's, where the API names it, else
    its `hostname` guest attribute (every attribute read, as gcloud reads it for its IAP tunnel: a Cloud TPU
    node's workers)."""
    named = all(w.vm for w in view.workers)
    attrs = routing.maker_of(cloud, view).guest_attributes(view, "hostkeys/" if named else "")
    keys.pin_host_keys(home, host_keys_from(attrs, view))
    for w, items in zip(view.workers, attrs, strict=True):
        w.instance = w.vm or next((value for (_, key), value in items.items() if key == "hostname"), "")


def attach(cloud: Cloud, s: settings.Settings, name: str, progress: Callable[[str], None]) -> NodeView:
    """Pin the host keys of NAME's workers (every slice's, for a multislice TPU), add tpurun's key to its
    metadata's ssh-keys, and make NAME this directory's default TPU."""
    maker, view = locate(cloud, name)
    if view.gone:
        listed = ", ".join(map(str, view.gone))
        raise UsageError(f"{name}: slice(s) {listed} do not exist ({view.state})")
    if set(view.states) != {READY}:
        raise UsageError(f"{name} is {view.state}; only a READY TPU can be attached", hint=f"`tpurun start {name}`?")
    pin_host_keys(cloud, s.home_path, view)
    spend.remember(s.home_path, cloud.project, cloud.endpoint, "attached", view)
    login = oslogin.policy_of(cloud, view.metadata)
    if login.oslogin:  # its workers ignore ssh-keys: tpurun's key goes into the login profile instead
        user = oslogin.Login(s, name, login).user()
        progress(f"{name}: its workers take logins through OS Login: tpurun logs in as {user}")
        settings.write_project_setting("tpu", name)
        return tpu(cloud, name)
    _, public = keys.ensure_key(s.home_path)
    entry = keys.ssh_keys_entry(keys.ssh_user(), public)

    def add_key(metadata: dict[str, str]) -> dict[str, str] | None:
        merged, changed = keys.merge_ssh_keys(metadata.get("ssh-keys", ""), entry)
        return {"ssh-keys": merged} if changed else None

    if any(add_key(part.metadata) for part in view.parts):
        progress(f"{name}: adding tpurun's ssh key to its ssh-keys")
    maker.update_metadata(view, add_key)
    settings.write_project_setting("tpu", name)
    return tpu(cloud, name)


# ---------------------------------------------------------------------------- delete, stop, start


def delete(
    cloud: Cloud, s: settings.Settings, name: str, progress: Callable[[str], None], by: str = "`tpurun delete`"
) -> Deleted:
    """Delete NAME and what tpurun made with it (its queued resource; every slice of a multislice TPU), and
    remember that BY (the command, for a later one naming NAME) deleted it; no longer this directory's default
    TPU. Returns what else went, what NAME used that tpurun did not make and left, and the tpurun.toml that no
    longer names it. Where no TPU NAME exists, what an interrupted create or delete left of it goes."""
    try:
        maker, view = whole(cloud, name, "delete")
    except NoSuchTpu:
        deleted = next((d for b in routing.backends(cloud) if (d := b.take_back(name, progress)) is not None), None)
        if deleted is None:
            raise
    else:
        deleted = maker.delete(view, progress)
        spend.remember(s.home_path, cloud.project, cloud.endpoint, "deleted", view)
    deleted.default_in = _gone(cloud, s, name, by)
    return deleted


def _gone(cloud: Cloud, s: settings.Settings, name: str, by: str) -> Path | None:
    """NAME was deleted BY a command: remembered as deleted, and no longer the default TPU (the tpurun.toml
    that named it, if one did)."""
    identity.bury(s.home_path, cloud.project, cloud.zone, name, by)
    return settings.clear_project_setting("tpu", name)


def take_down(cloud: Cloud, s: settings.Settings, name: str, progress: Callable[[str], None], by: str) -> None:
    """`train --down` after its job, or `create --delete-on-failure`: delete NAME as `delete` does. The TPU's
    watchdog may have begun that already (a client that came back late); then wait until NAME is gone."""
    try:
        delete(cloud, s, name, progress, by)
        return
    except ApiError:
        found = routing.locate(cloud, name)
        states = found[1].states + [found[1].state] if found else []
        if found and "DELETING" not in states:
            raise
    cloud.wait_gone(
        name,
        lambda: routing.locate(cloud, name) is None,
        on_poll=lambda: progress(f"{name}: DELETING (by its watchdog)"),
    )
    _gone(cloud, s, name, by)


def _stoppable(cloud: Cloud, name: str, verb: str) -> tuple[Backend, NodeView]:
    maker, view = whole(cloud, name, verb)
    why = maker.cannot_stop(view, verb)
    if why:
        raise UsageError(why, hint=f"delete it with `tpurun delete {name}` and create it again when needed")
    return maker, view


def stop(cloud: Cloud, s: settings.Settings, name: str, progress: Callable[[str], None]) -> NodeView:
    maker, view = _stoppable(cloud, name, "stop")
    with autostop.spend_paused(maker, view):  # a --budget counts no time stopped
        maker.stop(view, progress)
    spend.remember(s.home_path, cloud.project, cloud.endpoint, "stopped", view)
    identity.forget(s.home_path, cloud.project, cloud.zone, name)  # its VMs may come back elsewhere
    return tpu(cloud, name)


def start(cloud: Cloud, s: settings.Settings, name: str, progress: Callable[[str], None]) -> CreateResult:
    maker, view = _stoppable(cloud, name, "start")
    identity.forget(s.home_path, cloud.project, cloud.zone, name)  # its VMs come back, maybe elsewhere
    maker.start(view, progress)
    maker.update_metadata(view, autostop.resumed)
    spend.remember(s.home_path, cloud.project, cloud.endpoint, "started", view)
    # guest attributes start empty at boot, so the startup report read now is this boot's
    return until_started(cloud, maker, s.home_path, name, progress, timeout=1800)


def recreate(cloud: Cloud, s: settings.Settings, name: str, progress: Callable[[str], None]) -> CreateResult:
    """Delete a preempted TPU and make it again with the same settings (for train --max-restarts)."""
    maker, view = whole(cloud, name, "delete")
    identity.forget(s.home_path, cloud.project, cloud.zone, name)  # a new TPU: a new identity
    maker.recreate(view, progress)
    spend.remember(s.home_path, cloud.project, cloud.endpoint, "deleted", view)
    spend.remember(s.home_path, cloud.project, cloud.endpoint, "created", tpu(cloud, name))
    return until_started(cloud, maker, s.home_path, name, progress, timeout=1800)


WINDOW_MARGIN = 3.0  # seconds past a maintenance window's start by which the API tells it begun


def wait_usable(
    cloud: Cloud,
    name: str,
    progress: Callable[[str], None],
    *,
    timeout: float,
    after: float | None = None,
    cancelled: Callable[[], bool] = lambda: False,
) -> NodeView:
    """NAME once it can run a job again after a host event: every slice READY, none unhealthy for maintenance,
    no maintenance under way or due within a job's notice lead (it would cut the next run short at once), and
    (AFTER: epoch seconds, a maintenance window's start) that window begun (a few seconds past its start: the API
    tells it begun). ApiError if NAME went (preempted, deleted) or the wait outlasted TIMEOUT; KeyboardInterrupt
    once CANCELLED."""
    deadline = time.monotonic() + timeout
    for _ in cloud.iter_poll():
        if cancelled():
            raise KeyboardInterrupt
        if after is not None and time.time() < after + WINDOW_MARGIN:
            progress(f"{name}: waiting for its maintenance window to start ({ui.age(after - time.time())})")
            continue
        found = routing.locate(cloud, name)
        if found is None:
            raise ApiError(f"{name} no longer exists")
        maker, view = found
        if set(view.states) & {GONE, PREEMPTED, TERMINATED}:
            raise ApiError(f"{name} is {view.state}: it will not come back by itself")
        if view.ready and all(part.health != "UNHEALTHY_MAINTENANCE" for part in view.parts):
            maker.read_maintenance([view])
            soon = time.time() + NOTICE_LEAD
            if not any(m.status == "ONGOING" or (m.start and m.start.timestamp() <= soon) for m in view.maintenance):
                return view
        progress(f"{name}: {view.state}, {view.health}: waiting for it to be usable again")
        if time.monotonic() > deadline:
            raise ApiError(f"{name} is not usable after {timeout:.0f} s", hint=f"check `tpurun describe {name}`")
    raise AssertionError("unreachable")


def why_down(cloud: Cloud, name: str) -> str | None:
    """What the API says of NAME after its workers vanished: PREEMPTED when it (a slice of it) is preempted or
    gone, MAINTENANCE when a host of it is being maintained (REPAIRING, UNHEALTHY_MAINTENANCE, or maintenance
    ONGOING), "" when it is in another state than READY, None while every slice is READY (the API may not
    have seen it yet)."""
    found = routing.locate(cloud, name)
    if found is None:
        return PREEMPTED
    maker, view = found
    states = set(view.states)
    if states & {GONE, PREEMPTED, TERMINATED}:
        return PREEMPTED
    healths = {part.health for part in view.parts}
    if REPAIRING in states or "UNHEALTHY_MAINTENANCE" in healths:
        return MAINTENANCE
    if states == {READY}:
        maker.read_maintenance([view])
        return MAINTENANCE if any(m.status == "ONGOING" for m in view.maintenance) else None
    return ""
