"""Provisioning: create, attach, list, describe, delete, stop and start TPU nodes.

Everything is validated locally before the first API call, so bad input never creates anything.
`create` only returns when every worker finished its startup script (or one failed, with its log
tail), with host keys pinned from guest attributes and tpurun's key in `ssh-keys`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from google.cloud import tpu_v2

from tpurun import config, settings
from tpurun.cloud import autostop, keys, multislice, startup
from tpurun.cloud.client import Cloud, short_name
from tpurun.cloud.multislice import qr_state
from tpurun.cloud.views import STATE, NodeView, WorkerView, multislice_view, node_view  # noqa: F401
from tpurun.errors import ApiError, ProgramFailed, TpurunError, UsageError
from tpurun.naming import NAME_RE, parse_duration, validate_name, worker_name  # noqa: F401  (re-exported)
from tpurun.topology import Topology, parse_accelerator_type

LABEL_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")


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


@dataclass
class CreateSpec:
    name: str
    accelerator_type: str
    version: str | None = None
    spot: bool = False
    preemptible: bool = False
    queued: bool = False
    slices: int = 1  # several: one multislice queued resource (tpurun.cloud.multislice)
    valid_until: str | None = None
    startup_script: Path | None = None
    setup: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    network: str | None = None
    subnetwork: str | None = None
    internal_ips: bool = False
    code: str | None = None  # DIR[:DEST]
    data: list[str] = field(default_factory=list)
    autostop: str | None = None  # e.g. 30m: the watchdog deletes (or stops) the TPU after that long idle
    autostop_action: str | None = None
    wait: bool = True
    timeout: float = 1800.0


# ---------------------------------------------------------------------------- progress


class Progress:
    """Status lines while waiting: a spinner on a terminal, one line per change when piped."""

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


def prepare_create(
    spec: CreateSpec, cloud: Cloud | None = None
) -> tuple[Topology, dict[str, str], dict[str, str], int | None]:
    """Everything that can be checked without the API: returns topology, metadata, labels, valid-until.
    (Without CLOUD, the watchdog's setting is made for a stand-in project: the same checks, before settings.)"""
    validate_name(spec.name)
    topo = parse_accelerator_type(spec.accelerator_type)
    if "tpu-api" not in topo.backends:
        raise UsageError(
            f"{topo.name}: {topo.generation} is made through Compute Engine only (the Cloud TPU API does not offer "
            "it), and tpurun does not create TPUs through Compute Engine yet",
            hint=f"`tpurun topology {topo.name}` shows its machine type ({topo.machine_type}) and shape",
        )
    if spec.spot and spec.preemptible:
        raise UsageError("choose one of --spot and --preemptible")
    multislice.check_request(spec.name, topo, spec.slices)
    if spec.valid_until and not (spec.queued or spec.slices > 1):
        raise UsageError("--valid-until only applies with --queued (or --slices)")
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
    stoppable = not topo.multi_host and not spec.queued and spec.slices == 1
    autostop.check_action(action, stoppable=stoppable, what=f"{spec.name} ({topo.name})")
    nodes = multislice.slice_ids(spec.name, spec.slices) if spec.slices > 1 else [spec.name]
    watch = autostop.metadata(cloud, nodes, idle, action)
    metadata = startup.compose_metadata(user_script=user_script, setup=spec.setup, code=code, data=data, extra=watch)
    return topo, metadata, labels, valid_until


def create(
    cloud: Cloud, s: settings.Settings, spec: CreateSpec, progress: Callable[[str], None]
) -> CreateResult | NodeView:
    topo, metadata, labels, valid_until = prepare_create(spec, cloud)
    home = s.home_path
    _, public = keys.ensure_key(home)
    metadata["ssh-keys"] = keys.ssh_keys_entry(keys.ssh_user(), public) + "\n"
    node = tpu_v2.Node(
        accelerator_type=topo.name,
        runtime_version=spec.version or topo.default_runtime_version,
        labels=labels,
        metadata=metadata,
        network_config=tpu_v2.NetworkConfig(
            network=spec.network or "",
            subnetwork=spec.subnetwork or "",
            enable_external_ips=not spec.internal_ips,
        ),
        scheduling_config=tpu_v2.SchedulingConfig(spot=spec.spot, preemptible=spec.preemptible),
    )
    if spec.slices > 1:
        return _create_slices(cloud, s, spec, node, valid_until, progress)
    if spec.queued:
        _create_queued(cloud, spec, node, valid_until, progress)
    else:
        op = cloud.create_node(spec.name, node)
        if not spec.wait:
            return node_view(cloud.get_node(spec.name))
        cloud.wait(f"create {spec.name}", op, timeout=spec.timeout, on_poll=lambda: progress(f"{spec.name}: CREATING"))
    if not spec.wait:
        return node_view(cloud.get_node(spec.name))
    return until_started(cloud, home, spec.name, progress, timeout=spec.timeout)


def _create_queued(
    cloud: Cloud, spec: CreateSpec, node: tpu_v2.Node, valid_until: int | None, progress: Callable[[str], None]
) -> None:
    qr = tpu_v2.QueuedResource(
        tpu=tpu_v2.QueuedResource.Tpu(
            node_spec=[tpu_v2.QueuedResource.Tpu.NodeSpec(parent=cloud.parent, node_id=spec.name, node=node)]
        ),
    )
    _queue(cloud, spec, qr, valid_until, progress)


def _create_slices(
    cloud: Cloud,
    s: settings.Settings,
    spec: CreateSpec,
    node: tpu_v2.Node,
    valid_until: int | None,
    progress: Callable[[str], None],
    *,
    check_names: bool = True,
) -> CreateResult | NodeView:
    """One multislice queued resource; once ACTIVE, every slice's startup scripts and host keys."""
    if check_names:
        multislice.refuse_taken(cloud, spec.name, spec.slices)
    _queue(cloud, spec, multislice.queued_resource(cloud, spec.name, spec.slices, node), valid_until, progress)
    found = multislice.slice_nodes(cloud, spec.name)
    assert found is not None
    qr, nodes = found
    if not spec.wait:
        return multislice_view(spec.name, qr, [node_view(n) for n in nodes if n is not None])
    results = [
        until_started(cloud, s.home_path, node_id, progress, timeout=spec.timeout)
        for node_id in multislice.slice_ids(spec.name, spec.slices)
    ]
    view = multislice_view(spec.name, cloud.get_queued_resource(spec.name), [r.view for r in results])
    return CreateResult(view, [rep for r in results for rep in r.reports])


def _queue(
    cloud: Cloud,
    spec: CreateSpec,
    qr: tpu_v2.QueuedResource,
    valid_until: int | None,
    progress: Callable[[str], None],
) -> None:
    """Ask for QR and, unless --no-wait, wait until it is ACTIVE (its nodes made)."""
    if spec.spot:
        qr.spot = tpu_v2.QueuedResource.Spot()
    if valid_until:
        qr.queueing_policy = tpu_v2.QueuedResource.QueueingPolicy(valid_until_duration={"seconds": valid_until})
    op = cloud.create_queued_resource(spec.name, qr)
    cloud.wait(f"queue {spec.name}", op, timeout=120)
    deadline = time.monotonic() + (valid_until or spec.timeout)
    if not spec.wait:
        return
    for _ in cloud.iter_poll():
        got = cloud.get_queued_resource(spec.name)
        state = qr_state(got)
        progress(f"{spec.name}: queued resource {state}")
        if state == "ACTIVE":
            return
        if state in ("FAILED", "SUSPENDED"):
            detail = got.state.failed_data.error.message if got.state.failed_data else ""
            raise ApiError(
                f"queued resource {spec.name} {state}{': ' + detail if detail else ''}",
                hint=f"delete it with `tpurun delete {spec.name} --yes` and try another zone or size",
            )
        if time.monotonic() > deadline:
            raise ApiError(
                f"queued resource {spec.name} is still {state} after {spec.timeout:.0f} s",
                hint="it stays queued; check later with `tpurun list`, or `tpurun delete` it",
            )


def wait_ready(cloud: Cloud, name: str, progress: Callable[[str], None], *, timeout: float) -> tpu_v2.Node:
    deadline = time.monotonic() + timeout
    for _ in cloud.iter_poll():
        node = cloud.find_node(name)
        if node is None:
            progress(f"{name}: waiting for the node to appear")
        else:
            state = STATE(node.state).name
            progress(f"{name}: {state}")
            if state == "READY":
                return node
            if state in ("PREEMPTED", "TERMINATED", "STOPPED"):
                raise ApiError(f"{name} went {state} while waiting for it to be READY")
        if time.monotonic() > deadline:
            raise ApiError(f"{name} is not READY after {timeout:.0f} s", hint="check `tpurun describe " + name + "`")
    raise AssertionError("unreachable")


def wait_startup(
    cloud: Cloud,
    name: str,
    node: tpu_v2.Node,
    progress: Callable[[str], None],
    *,
    timeout: float,
) -> list[startup.StartupReport]:
    """Poll guest attributes until every worker's startup wrapper finished (or one failed)."""
    n = len(node.network_endpoints)
    deadline = time.monotonic() + timeout
    reports: list[startup.StartupReport] = []
    for _ in cloud.iter_poll(max(config.POLL_INTERVAL.number(), 0.2)):
        attrs = cloud.guest_attributes(name, startup.NAMESPACE + "/")
        reports = [startup.parse_report(attrs[i] if i < len(attrs) else {}) for i in range(n)]
        done = sum(r.finished for r in reports)
        failed = [i for i, r in enumerate(reports) if r.status == "failed"]
        steps = ", ".join(sorted({r.step or r.status for r in reports if not r.finished})) or "-"
        progress(f"{name}: startup finished on {done}/{n} workers (running: {steps})")
        if done == n or failed:
            return reports
        if time.monotonic() > deadline:
            waiting = [str(i) for i, r in enumerate(reports) if not r.finished]
            raise ApiError(
                f"{name}: the startup script has not finished on worker(s) {','.join(waiting)} after {timeout:.0f} s",
                hint=f"look at its log with `tpurun ssh --tpu {name} --worker {waiting[0]} -- cat {startup.LOG_PATH}`",
            )
    raise AssertionError("unreachable")


def _raise_if_startup_failed(name: str, view: NodeView, reports: list[startup.StartupReport]) -> None:
    for i, r in enumerate(reports):
        if r.status == "failed":
            failed_items = "; ".join(v for v in r.data.values() if v.startswith("failed"))
            detail = f" ({failed_items})" if failed_items else ""
            tail = "\n".join("    " + line for line in r.tail.splitlines()[-20:])
            raise StartupFailed(
                f"{name}: the startup script failed on worker {i} ({view.workers[i].internal_ip}) with exit code "
                f"{r.exit_code} in step '{r.step}'{detail}; last lines of {startup.LOG_PATH}:\n{tail}",
                view=view,
                reports=reports,
            )


class StartupFailed(ProgramFailed):
    def __init__(self, message: str, *, view: NodeView, reports: list[startup.StartupReport]) -> None:
        super().__init__(
            message,
            hint=f"{view.name} is still running, and billing: `tpurun delete {view.name} --yes` deletes it "
            "(`tpurun create --delete-on-failure` does that at once); fix the script and create it again",
        )
        self.view = view
        self.reports = reports


# ---------------------------------------------------------------------------- attach & keys


def host_keys_from(attrs: list[dict[tuple[str, str], str]], node: tpu_v2.Node) -> dict[str, str]:
    """{alias: key} of every worker of NODE, from its `hostkeys/` guest attributes."""
    pinned = {}
    for i, ep in enumerate(node.network_endpoints):
        key = keys.published_host_key(attrs[i]) if i < len(attrs) else None
        if not key:
            raise ApiError(
                f"worker {i} ({ep.ip_address}) of {short_name(node.name)} has not published its ssh host key in guest "
                "attributes yet",
                hint="wait a minute after the node is READY and try again",
            )
        pinned[keys.host_key_alias(str(node.id), i)] = key
    return pinned


def pin_from_guest_attributes(cloud: Cloud, home: Path, name: str, node: tpu_v2.Node) -> None:
    attrs = cloud.guest_attributes(name, "hostkeys/")
    keys.pin_host_keys(home, host_keys_from(attrs, node))


def attach(cloud: Cloud, s: settings.Settings, name: str, progress: Callable[[str], None]) -> NodeView:
    """Pin the host keys of NAME's workers (every slice's, for a multislice TPU), add tpurun's key to its
    nodes' ssh-keys, and make NAME this directory's default TPU."""
    validate_name(name)
    node, found = multislice.find(cloud, name)
    if found is None:
        nodes = [node or cloud.get_node(name)]  # get_node: NotFound, with similar names
    else:
        missing = [i for i, n in enumerate(found[1]) if n is None]
        if missing:
            raise UsageError(f"{name}: slice(s) {', '.join(map(str, missing))} do not exist ({qr_state(found[0])})")
        nodes = [n for n in found[1] if n is not None]
    for n in nodes:
        _attach_node(cloud, s.home_path, n, progress)
    settings.write_project_setting("tpu", name)
    if found is None:
        return node_view(cloud.get_node(name))
    return multislice_view(name, found[0], [node_view(cloud.get_node(n.name)) for n in nodes])


def _attach_node(cloud: Cloud, home: Path, node: tpu_v2.Node, progress: Callable[[str], None]) -> None:
    name = node.name.rsplit("/", 1)[-1]
    state = STATE(node.state).name
    if state != "READY":
        raise UsageError(f"{name} is {state}; only a READY node can be attached", hint=f"`tpurun start {name}`?")
    pin_from_guest_attributes(cloud, home, name, node)
    _, public = keys.ensure_key(home)
    entry = keys.ssh_keys_entry(keys.ssh_user(), public)
    metadata = dict(node.metadata)
    merged, changed = keys.merge_ssh_keys(metadata.get("ssh-keys", ""), entry)
    if changed:
        metadata["ssh-keys"] = merged
        progress(f"{name}: adding tpurun's ssh key to the node's ssh-keys")
        op = cloud.update_metadata(name, metadata)
        cloud.wait(f"update {name}", op, timeout=300)


# ---------------------------------------------------------------------------- list / describe / delete


def list_nodes(cloud: Cloud) -> list[NodeView]:
    nodes = sorted(cloud.list_nodes(), key=lambda n: n.name)
    acts = autostop.activities(cloud, [[n] for n in nodes])
    return [node_view(n, activity=a) for n, a in zip(nodes, acts, strict=True)]


def describe(cloud: Cloud, name: str) -> NodeView:
    validate_name(name)
    node, found = multislice.find(cloud, name)
    if found is None:
        node = node or cloud.get_node(name)  # NotFound, with similar names
        return node_view(node, _startup_reports(cloud, node), autostop.activity(cloud, [node]))
    qr, nodes = found
    views = [node_view(n, _startup_reports(cloud, n)) for n in nodes if n is not None]
    if not views:
        raise ApiError(f"{name}: the queued resource is {qr_state(qr)} and none of its slices exists yet")
    view = multislice_view(name, qr, views)
    view.activity = autostop.activity(cloud, [n for n in nodes if n is not None])
    return view


def _startup_reports(cloud: Cloud, node: tpu_v2.Node) -> list[startup.StartupReport] | None:
    if STATE(node.state).name != "READY":
        return None
    try:
        attrs = cloud.guest_attributes(node.name.rsplit("/", 1)[-1], startup.NAMESPACE + "/")
        return [startup.parse_report(a) for a in attrs]
    except TpurunError:
        return None


def delete(cloud: Cloud, name: str, progress: Callable[[str], None]) -> str | None:
    """Delete NAME (and the queued resource it came from; for a multislice TPU, the queued resource and
    every slice). Returns the queued resource deleted, if any."""
    validate_name(name)
    node = cloud.find_node(name)
    qr_name = node.queued_resource if node is not None else ""
    where = multislice.slice_of(node) if node is not None else None
    if where is not None:
        raise UsageError(
            f"{name} is slice {where[1]} of the multislice TPU {where[0]}; its slices are deleted together",
            hint=f"`tpurun delete {where[0]}`",
        )
    if node is None:
        # maybe only a queued resource of that name: waiting, or a multislice request
        if cloud.find_queued_resource(name) is None:
            cloud.get_node(name)  # raises NotFound with similar names
        qr_name = name
    if node is not None:
        op = cloud.delete_node(name)
        cloud.wait(f"delete {name}", op, timeout=1800, on_poll=lambda: progress(f"{name}: DELETING"))
    if qr_name:
        short = qr_name.rsplit("/", 1)[-1]
        progress(f"{name}: deleting queued resource {short}" + (" and its slices" if node is None else ""))
        op = cloud.delete_queued_resource(qr_name)
        cloud.wait(f"delete queued resource {qr_name}", op, timeout=1800)
    return qr_name or None


def take_down(cloud: Cloud, name: str, progress: Callable[[str], None]) -> None:
    """`train --down` after its job: delete NAME as `delete` does. The TPU's watchdog may have begun that
    already (a client that came back late); then wait until NAME is gone."""
    try:
        delete(cloud, name, progress)
        return
    except ApiError:
        node, found = multislice.find(cloud, name)
        states = [STATE(n.state).name for n in [node, *(found[1] if found else [])] if n is not None]
        states += [qr_state(found[0])] if found else []
        if states and "DELETING" not in states:
            raise
    deadline = time.monotonic() + 1800
    for _ in cloud.iter_poll():
        if multislice.find(cloud, name) == (None, None):
            return
        progress(f"{name}: DELETING (by its watchdog)")
        if time.monotonic() > deadline:
            raise ApiError(f"{name} is still being deleted after 1800 s", hint="`tpurun list` shows its state")


def _single_host(cloud: Cloud, name: str, verb: str) -> tpu_v2.Node:
    validate_name(name)
    node, found = multislice.find(cloud, name)
    if found is not None:
        raise UsageError(
            f"{name} is a multislice TPU; Cloud TPU can {verb} only single-host TPU VMs",
            hint=f"delete it with `tpurun delete {name}` and create it again when needed",
        )
    node = node or cloud.get_node(name)
    topo = parse_accelerator_type(node.accelerator_type)
    if topo.multi_host:
        raise UsageError(
            f"{name} is a {topo.name} pod slice with {topo.hosts} workers; Cloud TPU can {verb} only single-host "
            f"TPU VMs",
            hint=f"delete it with `tpurun delete {name}` and create it again when needed",
        )
    return node


def stop(cloud: Cloud, name: str, progress: Callable[[str], None]) -> NodeView:
    _single_host(cloud, name, "stop")
    op = cloud.stop_node(name)
    cloud.wait(f"stop {name}", op, timeout=1800, on_poll=lambda: progress(f"{name}: STOPPING"))
    return node_view(cloud.get_node(name))


def start(cloud: Cloud, s: settings.Settings, name: str, progress: Callable[[str], None]) -> CreateResult:
    _single_host(cloud, name, "start")
    op = cloud.start_node(name)
    cloud.wait(f"start {name}", op, timeout=1800, on_poll=lambda: progress(f"{name}: STARTING"))
    # guest attributes start empty at boot, so the startup report read now is this boot's
    return until_started(cloud, s.home_path, name, progress, timeout=1800)


def until_started(
    cloud: Cloud, home: Path, name: str, progress: Callable[[str], None], *, timeout: float
) -> CreateResult:
    """Wait for READY and every worker's startup script, pin the host keys; StartupFailed if one failed."""
    ready = wait_ready(cloud, name, progress, timeout=timeout)
    reports = wait_startup(cloud, name, ready, progress, timeout=timeout)
    pin_from_guest_attributes(cloud, home, name, ready)
    view = node_view(ready, reports)
    _raise_if_startup_failed(name, view, reports)
    return CreateResult(view, reports)


def recreate(cloud: Cloud, s: settings.Settings, name: str, progress: Callable[[str], None]) -> CreateResult:
    """Delete a preempted node and create it again with the same settings (for train --max-restarts). A
    multislice TPU is asked for again whole: Cloud TPU gives a queued resource's slices back only together."""
    old, found = multislice.find(cloud, name)
    if found is not None:
        return _recreate_slices(cloud, s, name, progress)
    old = old or cloud.get_node(name)
    node = _same_node(old)
    op = cloud.delete_node(name)
    cloud.wait(f"delete {name}", op, timeout=1800, on_poll=lambda: progress(f"{name}: DELETING"))
    op = cloud.create_node(name, node)
    cloud.wait(f"create {name}", op, timeout=1800, on_poll=lambda: progress(f"{name}: CREATING"))
    return until_started(cloud, s.home_path, name, progress, timeout=1800)


def _same_node(old: tpu_v2.Node) -> tpu_v2.Node:
    return tpu_v2.Node(
        accelerator_type=old.accelerator_type,
        runtime_version=old.runtime_version,
        labels=dict(old.labels),
        metadata=dict(old.metadata),
        network_config=old.network_config,
        scheduling_config=old.scheduling_config,
    )


def _recreate_slices(
    cloud: Cloud, s: settings.Settings, name: str, progress: Callable[[str], None]
) -> CreateResult:
    qr = cloud.get_queued_resource(name)
    spec = qr.tpu.node_spec[0]
    count, template = multislice.slice_count(qr), spec.node
    spot = "spot" in qr
    progress(f"{name}: deleting queued resource {name} and its slices")
    cloud.wait(f"delete queued resource {name}", cloud.delete_queued_resource(name), timeout=1800)
    again = CreateSpec(name=name, accelerator_type=template.accelerator_type, spot=spot, slices=count)
    return _create_slices(cloud, s, again, template, None, progress, check_names=False)  # type: ignore[return-value]
