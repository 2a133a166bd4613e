"""`tpurun emulator ...`: start, stop and inspect the local Cloud TPU emulator, and inject faults.

`start` detaches `python -m tpurun.emulator serve` into its own session (so closing the terminal does
not take the workers with it) and prints, as its last line on stdout, the `export
TPURUN_API_ENDPOINT=...` line that points tpurun at it: `eval "$(tpurun emulator start)"`.
Everything the server started is recorded in the state dir, so `stop` can verify (and if need be
force) that no process or mount is left.

The other commands act on the emulator `--state-dir` names; without it, on the one tpurun's API endpoint
setting names (a local `http://` endpoint), which its admin route tells the state dir and pid of; else on
the default state dir's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlparse

import typer

from tpurun import config, errors, naming, ui
from tpurun.cloud.services import is_emulator
from tpurun.emulator.admin_client import AdminClient
from tpurun.emulator.model import ApiError, Delays
from tpurun.errors import ExitCode, TpurunError, UsageError
from tpurun.settings import Setting, Settings
from tpurun.worker.agent_files import pid_alive

SSHD = Path("/usr/sbin/sshd")
START_TIMEOUT = 30.0

app = typer.Typer(
    help="A local Cloud TPU API whose nodes are real sshd hosts (start, stop, status, faults).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

StartDirOpt = Annotated[
    Path | None,
    typer.Option("--state-dir", help="Where the emulator keeps its state [default: $TPURUN_HOME/emulator]."),
]
StateDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--state-dir",
        help="The state dir of the emulator to act on [default: the emulator TPURUN_API_ENDPOINT (or the"
        " api_endpoint setting) names, else the one of $TPURUN_HOME/emulator].",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
ZoneOpt = Annotated[
    str | None, typer.Option("--zone", help="The zone the TPU is in, where its name is in more than one.")
]
# a TPU and one of its workers, as tpurun names them: a Compute Engine group's workers are numbered by their VMs' names
TpuArg = Annotated[str, typer.Argument(help="A node's id or full name, a managed instance group's or a VM's name.")]
WorkerHelp = "The worker, as tpurun numbers them (wN)."


def default_state_dir() -> Path:
    home = config.HOME.raw()
    if home:
        return Path(home) / "emulator"
    xdg = os.environ.get("XDG_CONFIG_HOME")
    base = Path(xdg) if xdg else Path.home() / ".config"
    return base / "tpurun" / "emulator"


def _state_dir(opt: Path | None) -> Path:
    return (opt or default_state_dir()).expanduser().resolve()


_MAX_WORKERS_HELP = (
    "Most workers one node may have (default: 2304, the largest slice; fewer where this machine's free memory "
    "would not hold them, at 16 MiB each)."
)


def _require_host() -> None:
    """The emulator makes namespaces and runs sshd: it needs root and OpenSSH's server."""
    if os.geteuid() != 0:
        raise UsageError("the emulator needs root (it creates namespaces and runs sshd): run it with sudo")
    if not SSHD.exists():
        raise UsageError(f"{SSHD} is missing: install the Debian package openssh-server")
    from tpurun.emulator.boot import compiler

    if compiler() is None:
        raise UsageError("the emulator builds its workers' init with a C compiler: install the Debian package gcc")


def _server_info(state_dir: Path) -> dict[str, Any] | None:
    """server.json of a live server in STATE_DIR, or None."""
    try:
        info: dict[str, Any] = json.loads((state_dir / "server.json").read_text())
    except (OSError, ValueError):
        return None
    if not pid_alive(int(info.get("pid", 0))):
        return None
    return info


def run(args: list[str], resolve: Callable[[], Settings]) -> int:
    """`tpurun emulator ARGS`. RESOLVE resolves tpurun's settings (the command line's layer does); only the
    commands that look for a running emulator without `--state-dir`, or need a project, call it."""
    command = typer.main.get_command(app)
    rc = command.main(args=args, prog_name="tpurun emulator", standalone_mode=False, obj=resolve)
    return rc if isinstance(rc, int) else 0


@dataclass(frozen=True)
class Found:
    """A running emulator: where it answers, its server's pid and its state dir."""

    endpoint: str
    pid: int
    state_dir: Path


def _lookup(ctx: typer.Context, state_dir: Path | None) -> tuple[Path, Found | None]:
    """`locate` for a command: the endpoint setting resolved (by what `run` was given) only without --state-dir."""
    setting = ctx.obj().api_endpoint if state_dir is None and callable(ctx.obj) else None
    return locate(state_dir, setting)


def locate(state_dir: Path | None, setting: Setting | None) -> tuple[Path, Found | None]:
    """The emulator a command acts on and what runs there (None: nothing): STATE_DIR's where given; else the one
    the API endpoint SETTING names when it is a local http:// endpoint, asked over its admin route (nothing
    answering there is a usage error naming what was looked for); else the default state dir's."""
    if state_dir is None and setting is not None and setting.value and is_emulator(setting.value):
        endpoint = setting.value.rstrip("/")
        try:
            st = AdminClient(endpoint, timeout=5).status()
            found = Found(endpoint, int(st["pid"]), Path(st["stateDir"]))
        except (ApiError, OSError, ValueError, KeyError, TypeError):
            port = urlparse(endpoint).port
            raise UsageError(
                f"no tpurun emulator answers at {endpoint} (the API endpoint, from {setting.source}): start one"
                f" with `tpurun emulator start{f' --port {port}' if port else ''}`, or name a running one with"
                " --state-dir DIR"
            ) from None
        return found.state_dir, found
    sd = _state_dir(state_dir)
    info = _server_info(sd)
    return sd, None if info is None else Found(str(info["endpoint"]), int(info["pid"]), sd)


def _admin(ctx: typer.Context, state_dir: Path | None) -> AdminClient:
    sd, found = _lookup(ctx, state_dir)
    if found is None:
        raise UsageError(
            f"no emulator is running with state dir {sd}: start one with `tpurun emulator start`, or name a running"
            " one with --state-dir DIR or TPURUN_API_ENDPOINT"
        )
    return AdminClient(found.endpoint)


def _api_call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except ApiError as e:
        code = ExitCode.USAGE if e.http in (400, 404) else ExitCode.API
        raise TpurunError(e.message, exit_code=code) from None
    except OSError as e:
        raise errors.ApiError(f"the emulator does not answer: {e}") from None


# ------------------------------------------------------------------ start / stop / status


@app.command()
def start(
    state_dir: StartDirOpt = None,
    port: Annotated[int, typer.Option("--port", help="API port on 127.0.0.1 (0: any free port).")] = 0,
    ssh_port: Annotated[int, typer.Option("--ssh-port", help="Port every worker's sshd listens on.")] = 22,
    delay_create: Annotated[float, typer.Option("--delay-create", help="Seconds a node stays CREATING.")] = 2.0,
    delay_delete: Annotated[float, typer.Option("--delay-delete", help="Seconds a node stays DELETING.")] = 1.0,
    delay_stop: Annotated[float, typer.Option("--delay-stop", help="Seconds a node stays STOPPING.")] = 1.0,
    delay_start: Annotated[float, typer.Option("--delay-start", help="Seconds a node stays STARTING.")] = 1.0,
    delay_update: Annotated[float, typer.Option("--delay-update", help="Seconds an update takes.")] = 0.2,
    delay_queue: Annotated[
        float, typer.Option("--delay-queue", help="Seconds a queued resource waits before provisioning.")
    ] = 2.0,
    capacity: Annotated[
        list[str] | None,
        typer.Option("--capacity", help="Free capacity, e.g. v4=32 (chips) or us-central2-b/v4=4h (hosts)."),
    ] = None,
    max_workers: Annotated[int | None, typer.Option("--max-workers", help=_MAX_WORKERS_HELP)] = None,
) -> None:
    """Start the emulator in the background; the last line printed is the `export` to use it."""
    _require_host()
    sd = _state_dir(state_dir)
    running = _server_info(sd)
    if running is not None:
        ui.info(f"the emulator is already running (pid {running['pid']}, state dir {sd})")
        print(f"export TPURUN_API_ENDPOINT={running['endpoint']}", flush=True)
        return
    sd.mkdir(parents=True, exist_ok=True)
    (sd / "server.json").unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "tpurun.emulator",
        "serve",
        "--state-dir",
        str(sd),
        "--port",
        str(port),
        "--ssh-port",
        str(ssh_port),
        *(["--max-workers", str(max_workers)] if max_workers is not None else []),
    ]
    delays = {
        "create": delay_create,
        "delete": delay_delete,
        "stop": delay_stop,
        "start": delay_start,
        "update": delay_update,
        "queue": delay_queue,
    }
    assert set(delays) <= set(Delays.__dataclass_fields__)  # the others (notice, maintenance): `emulator set --delay`
    for k, v in delays.items():
        cmd += [f"--delay-{k}", str(v)]
    for spec in capacity or []:
        cmd += ["--capacity", spec]
    log_path = sd / "server.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True
        )
    deadline = time.time() + START_TIMEOUT
    while time.time() < deadline:
        if proc.poll() is not None:
            lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
            why = lines[-1] if lines else f"exit status {proc.returncode}"
            raise TpurunError(f"the emulator did not start: {why} (log: {log_path})", exit_code=1)
        info = _server_info(sd)
        if info is not None and info.get("pid") == proc.pid:
            try:
                AdminClient(str(info["endpoint"]), timeout=2).status()
            except (ApiError, OSError):
                pass
            else:
                ui.info(f"emulator running: pid {proc.pid}, state dir {sd}, log {log_path}")
                print(f"export TPURUN_API_ENDPOINT={info['endpoint']}", flush=True)
                return
        time.sleep(0.1)
    proc.kill()
    raise TpurunError(f"the emulator did not answer within {START_TIMEOUT:.0f}s (log: {log_path})", exit_code=1)


def leftovers(sd: Path) -> list[str]:
    """What the emulator of SD still has running or mounted (empty when everything is gone)."""
    from tpurun.emulator.boot import INIT_NAME, INIT_SCRIPT

    left: list[str] = []
    try:
        recorded = json.loads((sd / "workers.json").read_text())
    except (OSError, ValueError):
        recorded = {}
    for node, pids in recorded.items():
        left += [f"worker init pid {p} of {node}" for p in pids if pid_alive(p)]
    where = str(sd)
    markers = (str(INIT_SCRIPT), INIT_NAME, "tpurun.emulator", "sshd")
    for p in (int(x) for x in os.listdir("/proc") if x.isdigit()):
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if where in cmd and any(m in cmd for m in markers) and pid_alive(p):
            left.append(f"process {p}: {cmd.strip()[:80]}")
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        mounts = []
    left += [f"mount {ln.split()[4]}" for ln in mounts if len(ln.split()) > 4 and ln.split()[4].startswith(where)]
    return sorted(set(left))


def _force_cleanup(sd: Path) -> None:
    from tpurun.emulator.procs import kill_orphans

    kill_orphans(sd)
    try:
        recorded = json.loads((sd / "workers.json").read_text())
    except (OSError, ValueError):
        recorded = {}
    for pids in recorded.values():
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)  # a pid namespace's init takes every process in it along
            except (ProcessLookupError, PermissionError):
                pass
    mounts = [
        ln.split()[4]
        for ln in Path("/proc/self/mountinfo").read_text().splitlines()
        if len(ln.split()) > 4 and ln.split()[4].startswith(str(sd))
    ]
    for m in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True, check=False)


@app.command()
def stop(
    ctx: typer.Context,
    state_dir: StateDirOpt = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for a clean shutdown.")] = 60.0,
) -> None:
    """Stop the emulator and everything it started (sshd hosts, namespaces, mounts), and check."""
    _require_host()
    sd, found = _lookup(ctx, state_dir)
    if found is not None:
        _shut_down(found, timeout)
    if leftovers(sd):
        _force_cleanup(sd)
        time.sleep(0.2)
    left = leftovers(sd)
    if left:
        raise TpurunError(f"the emulator left {len(left)} things behind: {'; '.join(left[:5])}", exit_code=1)
    (sd / "server.json").unlink(missing_ok=True)
    (sd / "workers.json").unlink(missing_ok=True)
    ui.info("emulator stopped; nothing of it is left running" if found else f"the emulator was not running ({sd})")


def _shut_down(found: Found, timeout: float) -> None:
    """Ask FOUND's server to stop (SIGTERM if it does not answer), and wait for it; SIGKILL after TIMEOUT. Only
    a server `start` made on this machine: its state dir's server.json names its pid."""
    info = _server_info(found.state_dir)
    if info is None or int(info["pid"]) != found.pid:
        raise UsageError(
            f"the emulator at {found.endpoint} (pid {found.pid}, state dir {found.state_dir}) was not started by"
            " `tpurun emulator start` on this machine: stop it where it was started"
        )
    try:
        AdminClient(found.endpoint, timeout=10).shutdown()
    except (ApiError, OSError):
        os.kill(found.pid, signal.SIGTERM)  # the server tears down on SIGTERM too
    deadline = time.time() + timeout
    while pid_alive(found.pid) and time.time() < deadline:
        time.sleep(0.1)
    if pid_alive(found.pid):
        ui.warn(f"the emulator (pid {found.pid}) did not stop within {timeout:.0f}s: killing it and its workers")
        try:
            os.kill(found.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@app.command()
def status(ctx: typer.Context, state_dir: StateDirOpt = None, json_out: JsonOpt = False) -> None:
    """Say whether the emulator runs, where, and what TPUs it has (Cloud TPU nodes, Compute Engine VMs)."""
    sd, found = _lookup(ctx, state_dir)
    if found is None:
        if json_out:
            ui.print_json({"running": False, "stateDir": str(sd)})
        else:
            named = "" if state_dir else "; name another with --state-dir DIR or TPURUN_API_ENDPOINT"
            print(f"the emulator is not running (state dir {sd}{named})")
        return
    st = _api_call(AdminClient(found.endpoint, timeout=10).status)
    if json_out:
        ui.print_json({"running": True, "endpoint": found.endpoint, **st, "stateDir": str(sd)})
        return
    print(f"the emulator is running: {found.endpoint} (pid {found.pid}, state dir {sd})")
    rows = tpu_rows(st)
    if rows:
        ui.table(None, ["tpu", "zone", "made as", "type", "state", "workers", "addresses"], rows)
    else:
        print("no TPUs")


def tpu_rows(st: dict[str, Any]) -> list[tuple[str, str, str, str, str, int, str]]:
    """A row per TPU of the admin status ST: its Cloud TPU nodes, then its Compute Engine groups and VMs."""
    made_as = {"node": "Cloud TPU node", "group": "Compute Engine group", "instance": "Compute Engine VM"}
    tpus = [{**n, "kind": "node"} for n in st["nodes"]] + list(st.get("computeTpus", []))
    return [
        (
            t["name"].rsplit("/", 1)[-1],
            t["name"].split("/")[3],
            made_as[t["kind"]],
            t["acceleratorType"],
            t["state"],
            t["workers"],
            ",".join(a or "-" for a in t["addresses"]) or "-",
        )
        for t in tpus
    ]


# ------------------------------------------------------------------ faults


def _seconds(text: str) -> float:
    return float(naming.parse_duration(text))


@app.command()
def preempt(
    ctx: typer.Context,
    node: Annotated[str, typer.Argument(help="Node id or full name (with --instance: a Compute Engine VM's).")],
    force: Annotated[bool, typer.Option("--force", help="Preempt even an on-demand (non-spot) node.")] = False,
    notice: Annotated[
        str, typer.Option("--notice", help="Say so in the workers' metadata (preempted TRUE) this long first: 30s.")
    ] = "0",
    instance: Annotated[bool, typer.Option("--instance", help="NODE is a Compute Engine VM.")] = False,
    state_dir: StateDirOpt = None,
) -> None:
    """Preempt a spot/preemptible node (or VM): its workers die and it reads PREEMPTED (a VM: TERMINATED)."""
    admin = _admin(ctx, state_dir)
    wait = _seconds(notice)
    _api_call(admin.preempt_instance if instance else admin.preempt, node, force, wait)
    ui.info(f"{node} preempted" if not wait else f"{node}: preempted in {wait:g}s (its metadata says so now)")


@app.command()
def maintenance(
    ctx: typer.Context,
    node: TpuArg,
    worker: Annotated[int, typer.Option("--worker", min=0, help=WorkerHelp)] = 0,
    notice: Annotated[str, typer.Option("--notice", help="How long before the window starts: 30s, 10m, 7d.")] = "60s",
    duration: Annotated[str, typer.Option("--duration", help="How long the host is down: 30s, 2h.")] = "5s",
    scheduled: Annotated[
        bool, typer.Option("--scheduled", help="SCHEDULED maintenance (reschedulable); else UNSCHEDULED.")
    ] = False,
    zone: ZoneOpt = None,
    state_dir: StateDirOpt = None,
) -> None:
    """Announce maintenance of a worker's host (API and metadata), take the host down in its window, bring it back."""
    window = _api_call(
        _admin(ctx, state_dir).maintenance,
        node,
        worker,
        _seconds(notice),
        _seconds(duration),
        "SCHEDULED" if scheduled else "UNSCHEDULED",
        zone,
    )
    ui.info(f"{node} worker {worker}: maintenance from {window['windowStartTime']} to {window['windowEndTime']}")


@app.command("kill-worker")
def kill_worker(
    ctx: typer.Context,
    node: TpuArg,
    worker: Annotated[int, typer.Argument(min=0, help=WorkerHelp)],
    zone: ZoneOpt = None,
    state_dir: StateDirOpt = None,
) -> None:
    """Kill one worker's whole host (every process on it), as if the VM crashed."""
    _api_call(_admin(ctx, state_dir).kill_worker, node, worker, zone)
    ui.info(f"worker {worker} of {node} killed")


@app.command("kill-sshd")
def kill_sshd(
    ctx: typer.Context,
    node: TpuArg,
    worker: Annotated[int, typer.Argument(min=0, help=WorkerHelp)],
    zone: ZoneOpt = None,
    state_dir: StateDirOpt = None,
) -> None:
    """Kill one worker's sshd (its other processes keep running): new ssh connections fail."""
    _api_call(_admin(ctx, state_dir).kill_sshd, node, worker, zone)
    ui.info(f"sshd of worker {worker} of {node} killed")


@app.command("fail-api")
def fail_api(
    ctx: typer.Context,
    count: Annotated[int, typer.Option("--count", help="How many API calls fail.")] = 1,
    code: Annotated[int, typer.Option("--code", help="HTTP status they fail with: 429, 503, 500, 403, ...")] = 503,
    match: Annotated[str, typer.Option("--match", help="Only calls whose 'METHOD /path' contains this text.")] = "",
    state_dir: StateDirOpt = None,
) -> None:
    """Make the next COUNT Cloud TPU API calls fail with HTTP status CODE."""
    if count < 1:
        raise UsageError("--count must be at least 1")
    _api_call(_admin(ctx, state_dir).fail_api, count, code, match)
    ui.info(f"the next {count} API call(s){f' matching {match!r}' if match else ''} fail with HTTP {code}")


@app.command("iap")
def iap_cmd(
    ctx: typer.Context,
    action: Annotated[str, typer.Argument(help="deny or allow.", metavar="deny|allow")],
    project: Annotated[str, typer.Option("--project", help="Only this project's VMs [default: every project's].")] = "",
    state_dir: StateDirOpt = None,
) -> None:
    """Deny or allow tunnels through IAP's TCP forwarding (the Tunnel User role, as a switch).

    A denied tunnel closes with 4033 'not authorized', as IAM's missing IAP-secured Tunnel User role makes IAP
    close it. Allowed everywhere until denied."""
    if action not in ("deny", "allow"):
        raise UsageError(f"tpurun emulator iap: say deny or allow, not {action!r}")
    _api_call(_admin(ctx, state_dir).iap_access, action == "allow", project)
    ui.info(f"IAP tunnels to {f'project {project}' if project else 'every project'}'s VMs: {action}ed")


@app.command("security-code")
def security_code_cmd(
    ctx: typer.Context,
    account: Annotated[str, typer.Argument(help="The Google account (an email).")],
    state_dir: StateDirOpt = None,
) -> None:
    """Print ACCOUNT's OS Login one-time password now, as its authenticator application would show it.

    A worker of a TPU whose metadata (or project's) has enable-oslogin-2fa=TRUE asks a person logging in for it
    after the key ("Enter your one-time password:"); a new one every 30 s, the one before and after taken too."""
    print(_api_call(_admin(ctx, state_dir).security_code, account))


@app.command("oslogin-role")
def oslogin_role_cmd(
    ctx: typer.Context,
    account: Annotated[str, typer.Argument(help="The Google account (an email).")],
    role: Annotated[str, typer.Argument(help="login or adminLogin.", metavar="login|adminLogin")],
    project: Annotated[str, typer.Option("--project", help="The project [default: the project setting].")] = "",
    state_dir: StateDirOpt = None,
) -> None:
    """Give ACCOUNT an OS Login role in a project, as an IAM binding does: login or adminLogin.

    login is roles/compute.osLogin, adminLogin roles/compute.osAdminLogin.

    Only adminLogin gives sudo on the project's workers (an OS Login account with it is a root alias there); with
    login alone the account is a user of its own. Every account has adminLogin until told otherwise."""
    if role not in ("login", "adminLogin"):
        raise UsageError(f"tpurun emulator oslogin-role: say login or adminLogin, not {role!r}")
    project = project or (ctx.obj().project.value if callable(ctx.obj) else "") or ""
    if not project:
        raise UsageError("tpurun emulator oslogin-role: name the project with --project (or TPURUN_PROJECT)")
    _api_call(_admin(ctx, state_dir).oslogin_role, account, project, role)
    ui.info(f"{account} has the OS Login role {role} in project {project}")


@app.command("project-metadata")
def project_metadata_cmd(
    ctx: typer.Context,
    items: Annotated[
        list[str] | None, typer.Argument(help="KEY=VALUE to set, KEY= to remove.", metavar="[KEY=VALUE]...")
    ] = None,
    project: Annotated[str, typer.Option("--project", help="The project [default: the project setting].")] = "",
    state_dir: StateDirOpt = None,
) -> None:
    """Show or change a project's common metadata, as `gcloud compute project-info add-metadata` does.

    `enable-oslogin=TRUE` makes the project enforce OS Login, as an organisation's compute.requireOsLogin policy
    does. It goes through Compute Engine's own client, read and written back with the fingerprint read."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import compute_v1

    endpoint = _admin(ctx, state_dir).endpoint
    project = project or (ctx.obj().project.value if callable(ctx.obj) else "") or ""
    if not project:
        raise UsageError("tpurun emulator project-metadata: name the project with --project (or TPURUN_PROJECT)")
    changes = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise UsageError(f"tpurun emulator project-metadata: {item!r} is not KEY=VALUE")
        changes[key] = value
    from google.api_core import exceptions as gexc

    kw: dict[str, Any] = {"client_options": {"api_endpoint": endpoint}, "credentials": AnonymousCredentials()}
    client = compute_v1.ProjectsClient(transport="rest", **kw)
    try:
        current = client.get(project=project).common_instance_metadata
        values = {i.key: i.value for i in current.items}
        if changes:
            values.update(changes)
            values = {k: v for k, v in values.items() if v}
            body = compute_v1.Metadata(
                fingerprint=current.fingerprint, items=[compute_v1.Items(key=k, value=v) for k, v in values.items()]
            )
            op = client.set_common_instance_metadata_unary(project=project, metadata_resource=body)
            compute_v1.GlobalOperationsClient(transport="rest", **kw).wait(project=project, operation=op.name)
    except gexc.GoogleAPICallError as exc:
        raise errors.ApiError(f"project {project}: {exc.message}") from None
    for key, value in sorted(values.items()):
        print(f"{key}={value}")


@app.command("set")
def set_cmd(
    ctx: typer.Context,
    state_dir: StateDirOpt = None,
    delay: Annotated[
        list[str] | None,
        typer.Option("--delay", help="NAME=SECONDS, NAME one of " + ", ".join(Delays.__dataclass_fields__)),
    ] = None,
    capacity: Annotated[list[str] | None, typer.Option("--capacity", help="[ZONE/]GEN=N chips or =Nh hosts.")] = None,
    clear_capacity: Annotated[bool, typer.Option("--clear-capacity", help="Unlimited capacity again.")] = False,
    max_workers: Annotated[int | None, typer.Option("--max-workers", help="Most workers one node may have.")] = None,
) -> None:
    """Change delays and capacity of the running emulator."""
    admin = _admin(ctx, state_dir)
    delays: dict[str, float] = {}
    for d in delay or []:
        name, _, value = d.partition("=")
        try:
            delays[name] = float(value)
        except ValueError:
            raise UsageError(f"--delay {d!r}: expected NAME=SECONDS") from None
    if delays:
        _api_call(admin.set_delays, **delays)
    if capacity or clear_capacity or max_workers is not None:
        _api_call(admin.set_capacity, list(capacity or []), clear_capacity, max_workers)


@app.command("requests")
def requests_cmd(ctx: typer.Context, state_dir: StateDirOpt = None, json_out: JsonOpt = False) -> None:
    """The log of Cloud TPU API calls the emulator answered."""
    log = _api_call(_admin(ctx, state_dir).requests)
    if json_out:
        ui.print_json(log)
        return
    for r in log:
        caller = "" if r.get("caller", "user") == "user" else f" [{r['caller']}]"
        print(f"{r['time']} {r['status']} {r['method']} {r['path']}{caller} {r['detail']}".rstrip())
