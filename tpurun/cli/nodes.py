"""Commands of the control plane: create, attach, list, describe, delete, stop, start, autostop."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from tpurun import naming, settings, ui, watchdogs
from tpurun.cli import grouped
from tpurun.cli.options import JsonOpt, NameArg, ProjectOpt, ViaOpt, ZoneOpt
from tpurun.cli.output import progress_display
from tpurun.cloud import autostop, identity, listing, provision, startup
from tpurun.cloud.client import Cloud
from tpurun.cloud.views import WorkerView
from tpurun.errors import ExitCode, UsageError
from tpurun.naming import EACH_UP_TO, which


def cloud_for(
    project: str | None,
    zone: str | None,
    *,
    every_zone: bool = False,
    tpu: str | None = None,
    via: str | None = None,
) -> tuple[Cloud, settings.Settings]:
    """The APIs where the settings say, or, for the existing TPU named TPU, where tpurun made it unless a zone is
    chosen (`identity.where`); VIA: --via, for a command that reaches its workers."""
    s = settings.resolve({"project": project, "zone": zone, "via": via})
    if tpu is not None:
        s = identity.where(s, tpu)
    return Cloud(s, every_zone=every_zone), s


def _workers_table(view: provision.NodeView, every: bool = False) -> None:
    """The TPU's workers: a row each (a few of them, or EVERY: describe), else a row per startup outcome with
    its folded workers, and where to see each."""
    shape = f"{len(view.slices)} x {view.accelerator_type}" if view.slices else view.accelerator_type
    title = f"{view.name} ({shape}, {view.state})"
    rows = []
    for w in view.workers:
        r = w.report
        status = r.status if r else "-"
        if r and r.duration is not None:
            status += f" ({r.duration:.0f} s)"
        rows.append((w.name, w.internal_ip, w.external_ip or "-", status))
    if every or len(rows) <= EACH_UP_TO:
        ui.table(title, ["worker", "internal ip", "external ip", "startup"], rows)
        return
    alike = grouped.by_outcome((w, (w.report.status if w.report else "-")) for w in view.workers)
    ui.table(
        title,
        ["startup", "workers", "which", "time"],
        [(status, f"{len(ws):,}", which([w.name for w in ws]), _took(ws)) for status, ws in alike],
    )
    ui.info(f"`tpurun describe {view.name}` lists every worker and its addresses")


def _took(workers: list[WorkerView]) -> str:
    """How long the WORKERS' startup took: `12 s`, or `10–40 s`."""
    times = [w.report.duration for w in workers if w.report and w.report.duration is not None]
    if not times:
        return "-"
    lo, hi = f"{min(times):.0f}", f"{max(times):.0f}"
    return f"{lo} s" if lo == hi else f"{lo}–{hi} s"


# create's options
AcceleratorTypeOpt = Annotated[
    str | None, typer.Option("--accelerator-type", "-t", help="e.g. v4-16, v5litepod-8, tpu7x-32.")
]
MachineTypeOpt = Annotated[
    str | None,
    typer.Option("--machine-type", help="Compute Engine's spelling, with --topology: e.g. tpu7x-standard-4t."),
]
TopologyOpt = Annotated[
    str | None, typer.Option("--topology", help="With --machine-type: the slice's chips, e.g. 2x2x4.")
]
BackendOpt = Annotated[
    str | None,
    typer.Option(
        "--backend",
        help="Who makes it: tpu-api (Cloud TPU API) or compute (Compute Engine). Default: the Cloud TPU API "
        "where it offers the type, else Compute Engine (TPU7x).",
    ),
]
VersionOpt = Annotated[str | None, typer.Option(help="Runtime version (default per generation).")]
SpotOpt = Annotated[bool, typer.Option("--spot", help="Spot VM (cheaper, can be preempted).")]
PreemptibleOpt = Annotated[bool, typer.Option("--preemptible", help="Preemptible VM.")]
QueuedOpt = Annotated[bool, typer.Option("--queued", help="Wait in line through a queued resource.")]
SlicesOpt = Annotated[
    int,
    typer.Option(
        min=1,
        help="Several slices joined over the data-center network (multislice, v4 and newer): one queued "
        "resource NAME makes NAME-0 … NAME-(N-1); NAME then stands for all of them.",
    ),
]
ValidUntilOpt = Annotated[
    str | None,
    typer.Option("--valid-until", help="With --queued or --flex-start: give up waiting for capacity after e.g. 6h."),
]
FlexStartOpt = Annotated[
    bool,
    typer.Option(
        "--flex-start",
        help="Compute Engine's flex-start capacity: wait until every VM of the slice can be made at once, "
        "then run for at most --max-run-duration.",
    ),
]
MaxRunDurationOpt = Annotated[
    str | None,
    typer.Option(
        "--max-run-duration",
        help="With --flex-start: how long the VMs run before Compute Engine deletes them (10m to 7d).",
    ),
]
StartupScriptOpt = Annotated[
    Path | None, typer.Option("--startup-script", help="Script every worker runs as root at every boot.")
]
SetupOpt = Annotated[list[str] | None, typer.Option("--setup", help="A shell command to run at boot (repeatable).")]
LabelOpt = Annotated[list[str] | None, typer.Option("--label", help="KEY=VALUE (repeatable).")]
NetworkOpt = Annotated[str | None, typer.Option(help="VPC network.")]
SubnetworkOpt = Annotated[str | None, typer.Option(help="VPC subnetwork.")]
InternalIpsOpt = Annotated[bool, typer.Option("--internal-ips", help="No external IPs.")]
CodeOpt = Annotated[
    str | None, typer.Option("--code", help="DIR[:DEST] unpacked on every worker at boot (small dirs).")
]
DataOpt = Annotated[
    list[str] | None, typer.Option("--data", help="URL[#sha256=HEX]=DEST downloaded at boot (repeatable).")
]
AutostopIdleOpt = Annotated[
    str | None,
    typer.Option(
        "--autostop",
        help="Delete the TPU (and its queued resource) once every worker has been idle this long, e.g. 30m: "
        "no tpurun job and no process holding a TPU device. Done by a watchdog on the TPU itself.",
    ),
]
AutostopActionOpt = Annotated[
    str | None, typer.Option("--autostop-action", help="delete (default), or stop for a single-host TPU VM.")
]
BudgetOpt = Annotated[
    str | None,
    typer.Option(
        "--budget",
        metavar="USD",
        help="Delete the TPU once its time has cost USD at its list price, whatever runs on it. Done by the "
        "watchdog on the TPU itself.",
    ),
]
NoWaitOpt = Annotated[bool, typer.Option("--no-wait", help="Return once the request is accepted.")]
DeleteOnFailureOpt = Annotated[
    bool,
    typer.Option(
        "--delete-on-failure", help="Delete the TPU when its startup script fails (else it is kept, and bills)."
    ),
]
TimeoutOpt = Annotated[float, typer.Option(min=0, help="Seconds to wait for READY and startup.")]


def create_cmd(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The new TPU's name: lowercase letters, digits and '-'.")],
    accelerator_type: AcceleratorTypeOpt = None,
    machine_type: MachineTypeOpt = None,
    topology: TopologyOpt = None,
    backend: BackendOpt = None,
    version: VersionOpt = None,
    spot: SpotOpt = False,
    preemptible: PreemptibleOpt = False,
    queued: QueuedOpt = False,
    slices: SlicesOpt = 1,
    valid_until: ValidUntilOpt = None,
    flex_start: FlexStartOpt = False,
    max_run_duration: MaxRunDurationOpt = None,
    startup_script: StartupScriptOpt = None,
    setup: SetupOpt = None,
    label: LabelOpt = None,
    network: NetworkOpt = None,
    subnetwork: SubnetworkOpt = None,
    internal_ips: InternalIpsOpt = False,
    code: CodeOpt = None,
    data: DataOpt = None,
    autostop_idle: AutostopIdleOpt = None,
    autostop_action: AutostopActionOpt = None,
    budget: BudgetOpt = None,
    no_wait: NoWaitOpt = False,
    delete_on_failure: DeleteOnFailureOpt = False,
    timeout: TimeoutOpt = 1800.0,
    project: ProjectOpt = None,
    zone: ZoneOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Provision a TPU VM or pod slice; waits until every worker finished its startup script."""
    spec = provision.CreateSpec(
        name=name,
        accelerator_type=accelerator_type,
        machine_type=machine_type,
        topology=topology,
        backend=backend,
        version=version,
        spot=spot,
        preemptible=preemptible,
        queued=queued,
        slices=slices,
        valid_until=valid_until,
        flex_start=flex_start,
        max_run_duration=max_run_duration,
        startup_script=startup_script,
        setup=setup or [],
        labels=label or [],
        network=network,
        subnetwork=subnetwork,
        internal_ips=internal_ips,
        code=code,
        data=data or [],
        autostop=autostop_idle,
        autostop_action=autostop_action,
        budget=naming.parse_usd(budget) if budget is not None else 0.0,
        wait=not no_wait,
        timeout=timeout,
    )
    s = settings.resolve({"project": project, "zone": zone})
    try:
        with progress_display() as progress:
            created = provision.create(s, spec, progress, delete_on_failure=delete_on_failure, announce=ui.info)
    except provision.StartupFailed as exc:
        if not json_out:
            _workers_table(exc.view)
        raise
    if created.view is None:  # interrupted: what it had asked for was deleted
        also = created.taken_back
        ui.info(
            " and ".join([f"deleted {name}", *also]) if also is not None else f"nothing of {name} had been made yet"
        )
        raise typer.Exit(created.exit_code)
    _say_created(name, created, created.view)
    if json_out:
        ui.print_json(created.view.to_dict(full=True))
        return
    _workers_table(created.view)


def _say_created(name: str, created: provision.Created, view: provision.NodeView) -> None:
    """What a create set up besides the TPU: its budget (and the price it counts at), its place as the default."""
    setting, price = view.autostop_setting, created.price
    if setting is not None and setting.spend is not None and price is not None:
        where = f"{ui.usd(price.per_hour)}/h, {price.source} price as of {price.as_of}"
        ui.info(f"{name}: --budget {setting.spend.label()} by its watchdog ({where})")
    if isinstance(created.made, provision.CreateResult) and created.made.default_in is not None:
        ui.info(f"{name} is now the default TPU here (recorded in {created.made.default_in})")


def attach_cmd(
    name: NameArg,
    project: ProjectOpt = None,
    zone: ZoneOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Adopt an existing TPU: pin its host keys, add tpurun's ssh key, make it this directory's default."""
    provision.validate_name(name)
    cloud, s = cloud_for(project, zone)
    with progress_display() as progress:
        view = provision.attach(cloud, s, name, progress)
    if json_out:
        ui.print_json(view.to_dict(full=True))
        return
    ui.info(f"attached {name}: host keys pinned, ssh key installed, default TPU in tpurun.toml")
    _workers_table(view)


def list_cmd(
    project: ProjectOpt = None,
    zone: ZoneOpt = None,
    all_zones: Annotated[
        bool, typer.Option("--all-zones", help="The TPUs of every zone of the project, with a zone column.")
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """List the TPUs in the zone (or in every zone), with their state, idleness and jobs."""
    if all_zones and zone:
        raise UsageError("choose one of --zone and --all-zones")
    cloud, _ = cloud_for(project, zone, every_zone=all_zones)
    listed = listing.list_tpus(cloud)
    if json_out:
        ui.print_json(listed.to_dict())
    else:
        _list_table(listed.views, all_zones)
    if listed.elsewhere:  # after the table, on stderr
        known = ", ".join(f"{name} ({there})" for name, there in listed.elsewhere)
        ui.info(f"tpurun knows TPUs in other zones too: {known}; `tpurun list --all-zones` lists every zone")


def _list_table(views: list[provision.NodeView], all_zones: bool) -> None:
    ui.table(
        None,
        [
            *(["zone"] if all_zones else []),
            "name",
            "backend",
            "accelerator",
            "state",
            "health",
            "workers",
            "spot/preemptible",
            "slice of",
            "age",
            "maintenance",
            "autostop",
            "budget",
            "idle",
            "job",
            "cost",
        ],
        [
            (
                *([v.zone] if all_zones else []),
                v.name,
                v.backend,
                v.accelerator_type,
                v.state,
                v.health,
                len(v.workers),
                _capacity(v),
                _slice_of(v),
                v.age(),
                _maintenance(v),
                v.activity.autostop_label(v.autostop_setting),
                _budget(v),
                v.activity.idle_label(),
                ", ".join(v.activity.jobs) or "-",
                _cost(v),
            )
            for v in views
        ],
    )


def _cost(v: provision.NodeView) -> str:
    """`$3.10 at $19.20/h` so far; `-` where no price is known."""
    if v.spend is None or v.spend.price is None:
        return "-"
    return f"{v.spend.cost_label()} at {v.spend.label()}"


def _price(v: provision.NodeView) -> str:
    """Where the price came from, and how it is made: `$19.20/h (16 chips at $1.20, on-demand; catalog 2026-11-28)`."""
    price = v.spend.price if v.spend else None
    if price is None:
        return "no published price for this TPU"
    where = "Billing Catalog" if price.source == "catalog" else "tpurun's bundled table"
    return (
        f"{ui.usd(price.per_hour)}/h ({price.chips} chips at ${price.per_chip_hour:,.3f}, {price.provisioning}; "
        f"{where} of {price.as_of})"
    )


def _budget(v: provision.NodeView) -> str:
    """Its `create --budget` and when the watchdog deletes it, or `-`."""
    setting = v.autostop_setting
    return setting.spend.label() if setting is not None and setting.spend is not None else "-"


def _capacity(v: provision.NodeView) -> str:
    return "spot" if v.spot else "preemptible" if v.preemptible else "-"


def _maintenance(v: provision.NodeView) -> str:
    """The soonest maintenance announced for V, in a few words (`UNSCHEDULED in 2h13m`), or `-`."""
    if not v.maintenance:
        return "-"
    first = min(v.maintenance, key=lambda m: (m.status != "ONGOING", m.start.timestamp() if m.start else 1e12))
    more = f" (+{len(v.maintenance) - 1})" if len(v.maintenance) > 1 else ""
    return f"{first.kind} {first.when()}{more}"


def _slice_of(v: provision.NodeView) -> str:
    return f"{v.slice_of[0]} (s{v.slice_of[1]})" if v.slice_of else "-"


def describe_cmd(
    name: NameArg,
    project: ProjectOpt = None,
    zone: ZoneOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Everything about one TPU: workers, IPs, startup status, labels (ssh keys shortened)."""
    provision.validate_name(name)
    cloud, _ = cloud_for(project, zone, tpu=name)
    view = listing.describe(cloud, name)
    if json_out:
        ui.print_json(view.to_dict(full=True))
        return
    _describe_table(view)
    _workers_table(view, every=True)


def _describe_table(view: provision.NodeView) -> None:
    act = view.activity
    rows: list[tuple[str, object]] = [
        ("name", view.name),
        ("backend", view.backend),
        ("id", view.id or "-"),
        ("zone", view.zone or "-"),
        ("accelerator", view.accelerator_type),
        ("state", view.state),
        ("health", view.health),
        ("workers", len(view.workers)),
        ("spot/preemptible", _capacity(view)),
        ("slice of", _slice_of(view)),
        ("age", view.age()),
        ("created", view.created.isoformat() if view.created else "-"),
        ("runtime version", view.runtime_version or "-"),
        ("queued resource", view.queued_resource or "-"),
        ("maintenance", "\n".join(m.summary() for m in view.maintenance) or "-"),
        ("autostop", act.autostop_label(view.autostop_setting)),
        ("budget", _budget(view)),
        ("idle", act.idle_label() + (f" ({act.why_busy})" if act.why_busy and act.why_busy not in act.silent else "")),
        ("jobs", ", ".join(act.jobs) or "-"),
        ("watchdog", act.decision or "-"),
        ("price", _price(view)),
        ("cost so far", (_cost(view) + (f" ({view.spend.note})" if view.spend and view.spend.note else ""))),
    ]
    if view.slices:
        rows.append(("slices", ", ".join(f"s{i}: {v.name} ({v.state})" for i, v in enumerate(view.slices))))
    rows.append(("labels", ", ".join(f"{k}={v}" for k, v in view.labels.items()) or "-"))
    for k, v in view.shown_metadata.items():
        if k not in (autostop.KEY, startup.WATCHDOG_KEY):  # shown above; the watchdog's program
            rows.append((f"metadata {k}", v))
    ui.table(view.name, ["field", "value"], rows)


def delete_cmd(
    name: NameArg,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
    project: ProjectOpt = None,
    zone: ZoneOpt = None,
) -> None:
    """Delete a TPU (and the queued resource it came from); asks unless --yes."""
    provision.validate_name(name)
    cloud, s = cloud_for(project, zone, tpu=name)
    if not yes:
        if not sys.stdin.isatty():
            raise UsageError(f"refusing to delete {name} without confirmation: pass --yes")
        if not typer.confirm(f"Delete {name} in {cloud.project}/{cloud.zone}?", default=False):
            raise typer.Exit(ExitCode.USAGE)  # declined: nothing was deleted, as without --yes and no terminal
    with progress_display() as progress:
        deleted = provision.delete(cloud, s, name, progress)
    ui.info(" and ".join([f"deleted {name}", *deleted.also]))
    if deleted.left:
        ui.info(f"left {' and '.join(deleted.left)}: {deleted.why_left}")
    if deleted.default_in is not None:
        ui.info(f"{name} is no longer the default TPU in {deleted.default_in}")


def stop_cmd(name: NameArg, project: ProjectOpt = None, zone: ZoneOpt = None) -> None:
    """Stop a single-host TPU VM (pod slices can only be deleted)."""
    provision.validate_name(name)
    cloud, s = cloud_for(project, zone, tpu=name)
    with progress_display() as progress:
        view = provision.stop(cloud, s, name, progress)
    ui.info(f"{name} is {view.state}")


def start_cmd(name: NameArg, project: ProjectOpt = None, zone: ZoneOpt = None, json_out: JsonOpt = False) -> None:
    """Start a stopped single-host TPU VM and wait for its startup script."""
    provision.validate_name(name)
    cloud, s = cloud_for(project, zone, tpu=name)
    with progress_display() as progress:
        result = provision.start(cloud, s, name, progress)
    if json_out:
        ui.print_json(result.view.to_dict(full=True))
        return
    _workers_table(result.view)


def autostop_cmd(
    name: NameArg,
    idle: Annotated[
        str, typer.Argument(metavar="IDLE|off", help="How long every worker must be idle first, e.g. 30m, 2h; or off.")
    ],
    action: Annotated[
        str | None,
        typer.Option(
            "--action", help="delete, or stop for a single-host TPU VM (default: as set before, else delete)."
        ),
    ] = None,
    project: ProjectOpt = None,
    zone: ZoneOpt = None,
    via: ViaOpt = None,
) -> None:
    """Delete (or stop) a TPU once it has been idle for IDLE, or turn that off. Idle: no tpurun job on any
    worker and no process holding a TPU device. A watchdog on the TPU itself acts, with its own credentials."""
    provision.validate_name(name)
    seconds = autostop.parse_idle(idle, "autostop")
    if action is not None:
        autostop.check_action(action)
    cloud, s = cloud_for(project, zone, tpu=name, via=via)
    with progress_display() as progress:
        setting = watchdogs.configure(cloud, name, seconds, action, progress, s)
    ui.info(f"{name}: autostop {setting.label()}")


def maintenance_cmd(
    name: NameArg,
    now: Annotated[
        bool, typer.Option("--now", help="Start the pending maintenance now (refused while a job runs there).")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="With --now: start it even while a job runs.")] = False,
    project: ProjectOpt = None,
    zone: ZoneOpt = None,
    via: ViaOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Show the maintenance announced for a TPU; with --now, start it on your own time.

    Starting maintenance takes the hosts down (a TPU slice is interrupted as a whole) and may leave a large slice
    unavailable for hours. Cloud TPU starts it on demand for v4, v5p, and v5e/v6e of 2x4 or larger.
    """
    from tpurun import maintenance

    provision.validate_name(name)
    if force and not now:
        raise UsageError("--force only applies with --now")
    s = settings.resolve({"tpu": name, "project": project, "zone": zone, "via": via})
    with progress_display() as progress:
        result = maintenance.maintenance(s, now=now, force=force, progress=progress)
    if json_out:
        ui.print_json(result.to_json())
        return
    if not result.windows:
        ui.info(f"{name}: no maintenance is announced")
    for m in result.windows:
        print(f"{name}: {m.summary()}")
    if result.jobs:
        ui.warn(f"started anyway (--force): job(s) {', '.join(result.jobs)} will end")
    if result.started:
        ui.info(f"maintenance started on {', '.join(result.started)}: `tpurun describe {name}` follows it")
