"""The TPU's own watchdog: autostop and `train --down` (stdlib only, Python >= 3.8; part of the bundle).

One runs on every worker, as root: tpurun's startup wrapper starts it at every boot once the startup
steps are done, and the agent (a `train --down` job) or `tpurun autostop` start it where it is missing
(`watchdog.py ensure`). It must run as root (to see every user's processes); a lock in the root-only RUN_DIR
keeps it to one per worker.

Every worker, every tick, looks whether it is busy: tpurun work for any user -- a job (an agent state
under ~USER/.tpurun/jobs whose supervisor lives, or a process carrying TPURUN_JOB_ID) or `train
--setup` (a process carrying TPURUN_ACTIVITY) -- or a process holding a TPU device file (`probe.find_holders`,
the scan kill-stale uses; a runtime that has initialised the TPU holds them). It publishes that as
guest attribute tpurun/watch, a `watchdog_reports.WatchState`, which `tpurun list` and `describe` read
through the API.

Worker 0 of the first node named in the config decides. The config is the node's metadata attribute
`tpurun-autostop`, a `watchdog_reports.WatchdogConfig` (its keys are written there only), read again at every
tick, so `tpurun autostop` changes a running watchdog. With the VM's own service-account token from the
metadata server, the decider reads every worker's tpurun/watch (nodes.getGuestAttributes) and acts:
- autostop: every worker has been idle for `idle` seconds, on two looks in a row -> delete the queued
  resource the node came from (with its nodes), or else delete the node (or stop it, action "stop");
- down: a job on this worker was started with `train --down` and has ended, and no worker runs a job
  -> the same deletion;
- budget: the config's `spend_until` (`create --budget`) has come -> deleted, whatever runs on it.
A TPU made by Compute Engine has, instead of nodes, its `ComputeTpu` (its lone VM, or its slices' managed
instance groups and the template and workload policy made with it), with Compute Engine's root as the
endpoint. Its first VM decides (the lone VM, or the first by name of the first group), reading each VM's
tpurun/watch (instances.getGuestAttributes); to delete, it leaves its group, deletes the groups and what
was made with them, then itself (`compute_delete` says why in that order).
A worker that has not reported for SILENT_TICKS ticks, and a node that is not READY, count as busy: work it cannot
see is never deleted; until, past the configuration's `silent` bound, the API (or its address) says the VM is dead
(watchdog_silent.py). Every decision is a line in LOG on the deciding worker and in
guest attribute tpurun/watchdog. Nothing a user can write can stop it: every look's failure is logged.
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import sys
import time
from urllib.parse import urlsplit

if __package__:  # imported by tpurun (its constants, the tests): the same modules by their package names
    from tpurun.worker import metaserver, probe
    from tpurun.worker.agent_files import STATE, job_running, running_jobs, started_down
    from tpurun.worker.watchdog_reports import (
        NO_ROOT,
        ComputeTpu,
        Silent,
        WatchdogConfig,
        WatchState,
        duration,
        summarize,
    )
    from tpurun.worker.watchdog_silent import Missed, node_verdict, vm_verdict
else:  # run from the bundle on a worker, whose files sit side by side
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import metaserver  # type: ignore[no-redef]
    import probe  # type: ignore[no-redef]
    from agent_files import STATE, job_running, running_jobs, started_down  # type: ignore[no-redef]
    from watchdog_reports import (  # type: ignore[no-redef]
        NO_ROOT,
        ComputeTpu,
        Silent,
        WatchdogConfig,
        WatchState,
        duration,
        summarize,
    )
    from watchdog_silent import Missed, node_verdict, vm_verdict  # type: ignore[no-redef]

NAMESPACE = "tpurun"  # guest attributes, shared with the startup wrapper's reports
CONFIG_KEY = "tpurun-autostop"
STATE_KEY = "watch"
DECISION_KEY = "watchdog"
RUN_DIR = "/run/tpurun"  # root's only (0700): the lock, the log, the `--down` jobs acted on
LOG = f"{RUN_DIR}/watchdog.log"
LOCK = f"{RUN_DIR}/watchdog.lock"
DOWN_DONE = f"{RUN_DIR}/down-done"  # one line per `--down` job acted on
LEAVING = f"{RUN_DIR}/leaving"  # this Compute Engine VM left its group to delete the TPU: it goes on deciding
REASK_TICKS = 20  # how often a Compute Engine VM asks whether it is the TPU's first
OPERATION_TIMEOUT = 1800.0
LEAVE_TIMEOUT = 600.0
WORK_MARKERS = (b"TPURUN_JOB_ID=", b"TPURUN_ACTIVITY=")  # in a process's environment: tpurun work
UNSET_TICK = 5.0  # no setting yet (started by `tpurun autostop` just before it writes one): look again soon
QUICK_LOOK = 1.0  # seconds between the cheap looks for a job's start or end between two whole looks
SETTLE_TICKS = 2  # a `--down` job's end: how long the watchdog leaves the deletion to an attached client
MAX_USER_FILE = 1 << 20


# ------------------------------------------------------------------ the metadata server and the API


def publish(key: str, value: str) -> None:
    try:
        metaserver.request(
            "PUT", metaserver.url(f"instance/guest-attributes/{NAMESPACE}/{key}"), value.encode(), metaserver.ASK
        )
    except metaserver.NET_ERRORS:
        pass  # the next tick publishes again


def endpoint_ok(endpoint: str) -> bool:
    """The VM's token goes only to an https endpoint, or to plain http on a loopback address (the emulator)."""
    u = urlsplit(endpoint)
    if u.scheme == "https" and u.hostname:
        return True
    return u.scheme == "http" and (u.hostname or "") in ("localhost", "::1") or (u.hostname or "").startswith("127.")


def tpu_env_value(text: str, key: str) -> str:
    """One value of the `tpu-env` attribute (YAML lines `KEY: 'value'`)."""
    found = [v for k, sep, v in (line.partition(":") for line in text.splitlines()) if sep and k.strip() == key]
    return found[0].strip().strip("'\"") if found else ""


# ------------------------------------------------------------------ this worker


def job_roots() -> list[str]:
    """Every user's agent jobs directory (tpurun's jobs run as whoever logged in)."""
    roots = []
    for home in sorted({p.pw_dir for p in pwd.getpwall() if p.pw_dir} | {os.path.expanduser("~root")}):
        root = os.path.join(home, ".tpurun", "jobs")
        if root not in roots and os.path.isdir(root):
            roots.append(root)
    return roots


def mtimes(paths: list[str]) -> dict:
    """{path: its modification time}: a directory's changes when an entry is made or removed in it."""
    return {p: os.stat(p).st_mtime_ns for p in paths}


def down_pending(roots: list[str], running: list[str]) -> list[str]:
    """The RUNNING jobs started with `train --down`: the TPU is deleted when they end."""
    return sorted(name for root in roots for name in running if started_down(os.path.join(root, name), MAX_USER_FILE))


def down_jobs(roots: list[str], running: list[str], settle: float, done: set[str]) -> list[str]:
    """Directories of jobs started with `train --down` that ended at least SETTLE seconds ago (an attached
    client deletes the TPU itself meanwhile) and were not acted on (DONE)."""
    found = []
    for root in roots:
        for name in sorted(os.listdir(root)):
            jdir = os.path.join(root, name)
            if name in running or jdir in done or not started_down(jdir, MAX_USER_FILE):
                continue
            try:
                ended = os.lstat(os.path.join(jdir, STATE)).st_mtime
            except OSError:
                continue
            if time.time() - ended >= settle:
                found.append(jdir)
    return found


def read_done() -> set[str]:
    try:
        with open(DOWN_DONE) as f:
            return {line.rstrip("\n") for line in f}
    except OSError:
        return set()


def holders() -> int:
    """Processes with a TPU device file open (libtpu holds them once it has initialised the TPU; its
    mappings, which kill-stale also looks at, are not read: that would cost a look many times more)."""
    found = probe.find_holders(probe.DEFAULT_DEVICE_GLOBS, "", [])
    return sum(1 for h in found.holders if not h.protected)


def tpurun_work() -> tuple[list[str], list[str]]:
    """(jobs, other work: `setup`) of the processes carrying tpurun's variables in their environment."""
    jobs, work = set(), set()
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        for entry in env.split(b"\0"):
            if entry.startswith(WORK_MARKERS[0]):
                jobs.add(entry[len(WORK_MARKERS[0]) :].decode("utf-8", "replace"))
            elif entry.startswith(WORK_MARKERS[1]):
                work.add(entry[len(WORK_MARKERS[1]) :].decode("utf-8", "replace"))
    return sorted(jobs), sorted(work)


# ------------------------------------------------------------------ the watchdog


class Watchdog:
    def __init__(self) -> None:
        self.worker = int((metaserver.text("instance/attributes/agent-worker-number") or "0").strip() or 0)
        self.slice = int(tpu_env_value(metaserver.text("instance/attributes/tpu-env") or "", "MEGASCALE_SLICE_ID") or 0)
        self.idle_since: float | None = time.time()
        self.roots: list[str] = []
        self.jobs: list[str] = []
        self._marks: dict = {}  # each jobs directory's mtime at the last look
        self._running: set = set()  # (jobs directory, job) the last look found running by its agent state
        self._token = ""
        self._token_until = 0.0
        self._said = ""
        self._quiet_until = 0.0
        self._idle_looks = 0  # looks in a row that found the TPU idle for the whole period
        self._first = False  # on Compute Engine: this VM decides (asked of the API now and then)
        self._first_until = 0.0
        self.silent: dict[str, Silent] = {}  # the decider's verdicts on silent workers, published with its state
        self._missed = Missed()
        self._where: dict[str, tuple] = {}  # each worker's VM as the API shows it: ("node", node, w) or ("vm", name)

    # ---- what every worker does
    def config(self) -> WatchdogConfig | None:
        try:
            return WatchdogConfig.from_json(metaserver.text(f"instance/attributes/{CONFIG_KEY}") or "")
        except ValueError:
            return None

    def wait(self, seconds: float) -> None:
        """Sleep SECONDS, or less once a job starts (a jobs directory changes) or one that ran ends (its state
        read alone, not every old job's): published at once, not a tick later."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(max(0.0, min(QUICK_LOOK, end - time.monotonic())))
            try:
                if mtimes(job_roots()) != self._marks or not all(job_running(r, j) for r, j in self._running):
                    return
            except Exception:  # noqa: BLE001 - the next whole look says what is wrong
                return

    def look(self) -> None:
        self.roots = job_roots()
        self._marks, self._running = mtimes(self.roots), {(r, j) for r in self.roots for j in running_jobs(r)}
        by_env, work = tpurun_work()
        self.jobs = sorted({j for _, j in self._running} | set(by_env))
        held = holders()
        now = time.time()
        if self.jobs or work or held:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = now
        down = down_pending(self.roots, self.jobs)
        since = None if self.idle_since is None else round(self.idle_since, 1)
        state = WatchState(round(now, 1), self.worker, self.jobs, work, held, since, down, self.silent)
        publish(STATE_KEY, state.to_json())

    def say(self, text: str, *, repeat: bool = False) -> None:
        """A decision (or why none is taken): to LOG and guest attribute tpurun/watchdog, once per change."""
        if text == self._said and not repeat:
            return
        self._said = text
        line = time.strftime("%Y-%m-%dT%H:%M:%SZ ", time.gmtime()) + text
        try:
            with open(LOG, "a") as f:
                f.write(line + "\n")
        except OSError:
            pass
        publish(DECISION_KEY, line)

    # ---- what the deciding worker does
    def decides(self, cfg: WatchdogConfig) -> bool:
        if not cfg.endpoint:
            return False
        if cfg.compute is not None:
            return self.first_vm(cfg)
        return self.worker == 0 and self.slice == 0 and bool(cfg.nodes)

    def first_vm(self, cfg: WatchdogConfig) -> bool:
        """On Compute Engine: this VM is the TPU's first (its lone VM, or the first by name of its first
        group, the worker 0 tpurun numbers), or has begun deleting the TPU. Asked again every REASK_TICKS."""
        if os.path.exists(LEAVING):
            return True
        now = time.time()
        if now < self._first_until:
            return self._first
        c = compute_of(cfg)
        me = (metaserver.text("instance/name") or "").strip()
        if c.instance:
            self._first = bool(me) and me == c.instance
        else:
            names = self.group_vms(cfg, (c.groups or [""])[0])[1]
            self._first = bool(me) and sorted(names)[:1] == [me]
        self._first_until = now + REASK_TICKS * cfg.tick
        return self._first

    def api(self, cfg: WatchdogConfig, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        """One call to the API the config names (the Cloud TPU API's v2, or Compute Engine's v1)."""
        endpoint = cfg.endpoint.rstrip("/")
        if not endpoint_ok(endpoint):
            raise ValueError(f"refusing to send the VM's token to {endpoint} (https only, or http on loopback)")
        if time.time() >= self._token_until:
            tok = json.loads(metaserver.text("instance/service-accounts/default/token") or "{}")
            self._token = str(tok.get("access_token", ""))
            self._token_until = time.time() + max(0, int(tok.get("expires_in", 0)) - 60)
        headers = {"Authorization": f"Bearer {self._token}", "Content-Type": "application/json"}
        data = json.dumps(body).encode() if body is not None else None
        root = "compute/v1" if cfg.compute is not None else "v2"
        status, raw = metaserver.request(method, f"{endpoint}/{root}/{path}", data, headers)
        try:
            reply = json.loads(raw.decode() or "{}")
        except ValueError:
            reply = {}
        return status, reply if isinstance(reply, dict) else {}

    def reports(self, cfg: WatchdogConfig) -> tuple[list[dict], list[tuple[str, WatchState | None]]]:
        """Every node of the config (as the API shows it) and every worker's last published state; a node
        that is not READY counts as one worker that has not reported."""
        nodes: list[dict] = []
        states: list[tuple[str, WatchState | None]] = []
        many = len(cfg.nodes) > 1
        for s, name in enumerate(cfg.nodes):
            status, node = self.api(cfg, "GET", str(name))
            if status != 200:
                raise OSError(f"GET {name}: HTTP {status} {node.get('error', {}).get('message', '')}")
            nodes.append(node)
            workers = len(node.get("networkEndpoints") or [])
            if node.get("state") != "READY" or not workers:
                states.append((f"s{s}" if many else str(name).rsplit("/", 1)[-1], None))
                self._where[states[-1][0]] = ("node", node, None)
                continue
            status, got = self.api(cfg, "POST", f"{name}:getGuestAttributes", {"queryPath": f"{NAMESPACE}/{STATE_KEY}"})
            entries = got.get("guestAttributes", []) if status == 200 else []
            for w in range(workers):
                states.append((f"s{s}/w{w}" if many else f"w{w}", _state_of(entries, w)))
                self._where[states[-1][0]] = ("node", node, w)
        return nodes, states

    # ---- the same on Compute Engine: a VM, or managed instance groups (one per slice)
    def group_vms(self, cfg: WatchdogConfig, group: str, *, running: bool = True) -> tuple[int, list[str]]:
        """GROUP's target size and its VMs (by name; RUNNING ones only unless not RUNNING), through
        listManagedInstances; (0, []) for a group that does not exist."""
        scope = compute_scope(cfg)
        status, got = self.api(cfg, "GET", f"{scope}/instanceGroupManagers/{group}")
        if status == 404:
            return 0, []
        if status != 200:
            raise OSError(f"GET instance group {group}: HTTP {status} {error_of(got)}")
        names: list[str] = []
        token = ""
        while True:
            query = f"?pageToken={token}" if token else ""
            status, page = self.api(cfg, "POST", f"{scope}/instanceGroupManagers/{group}/listManagedInstances{query}")
            if status != 200:
                raise OSError(f"list the VMs of {group}: HTTP {status} {error_of(page)}")
            for m in page.get("managedInstances") or []:
                if m.get("instance") and (m.get("instanceStatus") == "RUNNING" or not running):
                    names.append(str(m["instance"]).rsplit("/", 1)[-1])
            token = str(page.get("nextPageToken") or "")
            if not token:
                return int(got.get("targetSize") or 0), names

    def vm_state(self, cfg: WatchdogConfig, vm: str) -> WatchState | None:
        status, got = self.api(
            cfg, "GET", f"{compute_scope(cfg)}/instances/{vm}/getGuestAttributes?queryPath={NAMESPACE}/{STATE_KEY}"
        )
        items = (got.get("queryValue") or {}).get("items") or [] if status == 200 else []
        return parse_state(next((i.get("value") for i in items if i.get("key") == STATE_KEY), None))

    def compute_reports(self, cfg: WatchdogConfig) -> list[tuple[str, WatchState | None]]:
        """Every VM's last published state; a group short of its VMs counts as one VM that has not reported."""
        c = compute_of(cfg)
        if c.instance:
            vm = c.instance
            status, got = self.api(cfg, "GET", f"{compute_scope(cfg)}/instances/{vm}")
            if status != 200:
                raise OSError(f"GET instance {vm}: HTTP {status} {error_of(got)}")
            self._where["w0"] = ("vm", vm)
            return [("w0", self.vm_state(cfg, vm) if got.get("status") == "RUNNING" else None)]
        many = len(c.groups) > 1
        states: list[tuple[str, WatchState | None]] = []
        for s, group in enumerate(c.groups):
            size, vms = self.group_vms(cfg, group)  # the group's target size, and its VMs
            if not size or len(vms) < size:
                states.append((f"s{s}" if many else group, None))
                continue
            for w, vm in enumerate(sorted(vms)):
                states.append((f"s{s}/w{w}" if many else f"w{w}", self.vm_state(cfg, vm)))
                self._where[states[-1][0]] = ("vm", vm)
        return states

    def compute_delete(self, cfg: WatchdogConfig, why: str) -> bool:
        """Delete the TPU through Compute Engine. A group's VM cannot delete its group and then what the group
        used (the template, the workload policy: Compute Engine refuses while a group uses them), since the
        group takes the VM with it: so this VM first leaves its group (abandonInstances), then deletes every
        group, then each resource made with the TPU, and last itself."""
        c = compute_of(cfg)
        scope, me = compute_scope(cfg), (metaserver.text("instance/name") or "").strip()
        if not me:
            self.say(f"not deleting: the metadata server did not say this VM's name ({why})", repeat=True)
            return False
        name, groups = c.name or me, c.groups
        if not groups:
            vm = c.instance or me
            return self.call_done(cfg, f"delete {name}", "DELETE", f"{scope}/instances/{vm}", why, wait=False)
        if not self.leave(cfg, name, groups[0], me, why):
            return False
        steps = [(f"delete instance group {g}", f"{scope}/instanceGroupManagers/{g}") for g in groups]
        steps += [(f"delete {kind_of(p)} {p.rsplit('/', 1)[-1]}", p) for p in c.also]
        for what, path in steps:
            if not self.call_done(cfg, f"{name}: {what}", "DELETE", path, why):
                return False
        return self.call_done(
            cfg, f"{name}: delete its last VM {me}", "DELETE", f"{scope}/instances/{me}", why, wait=False
        )

    def leave(self, cfg: WatchdogConfig, name: str, group: str, me: str, why: str) -> bool:
        """This VM out of GROUP, for sure: the abandon operation is DONE once the removal is scheduled, so
        the group's members are asked until this VM is no longer one. LEAVING is written first (a retry or a
        restarted watchdog goes on from here), and removed when the group refused to let it go."""
        with open(LEAVING, "w") as f:
            f.write(me + "\n")
        body = {"instances": [f"zones/{compute_of(cfg).zone}/instances/{me}"]}
        path = f"{compute_scope(cfg)}/instanceGroupManagers/{group}/abandonInstances"
        asked = me not in self.group_vms(cfg, group, running=False)[1] or self.call_done(
            cfg, f"{name}: leave group {group}", "POST", path, why, body=body
        )
        deadline = time.time() + LEAVE_TIMEOUT
        while me in self.group_vms(cfg, group, running=False)[1]:
            if not asked:
                os.unlink(LEAVING)  # the group keeps it: the next decision starts from the idle check again
                return False
            if time.time() > deadline:
                self.say(f"{name}: still in group {group} {LEAVE_TIMEOUT:.0f} s after leaving it ({why})", repeat=True)
                return False
            time.sleep(1)
        return True

    def call_done(
        self,
        cfg: WatchdogConfig,
        what: str,
        method: str,
        path: str,
        why: str,
        *,
        body: dict | None = None,
        wait: bool = True,
    ) -> bool:
        """One Compute Engine call and (WAIT) its operation until done; said either way. A 404 is done."""
        status, op = self.api(cfg, method, path, {} if body is None and method == "POST" else body)
        if status == 404:
            self.say(f"{what}: already gone ({why})", repeat=True)
            return True
        deadline = time.time() + OPERATION_TIMEOUT
        while status == 200 and wait and op.get("status") != "DONE" and time.time() < deadline:
            link = str(op.get("selfLink") or "")
            status, op = self.api(cfg, "POST", link.split("/compute/v1/", 1)[-1] + "/wait")
        errors = (op.get("error") or {}).get("errors") or [] if status == 200 else []
        if status != 200 or errors or (wait and op.get("status") != "DONE"):
            detail = errors[0].get("message", "") if errors else error_of(op) or op.get("status", "")
            self.say(f"{what} failed: HTTP {status} {detail} ({why})", repeat=True)
            return False
        self.say(f"{what}: {why}; operation {op.get('name', '?')}", repeat=True)
        return True

    def decide(self, cfg: WatchdogConfig) -> None:
        if cfg.compute is not None and os.path.exists(LEAVING):  # decided: go on from there
            if time.time() >= self._quiet_until:
                self.act(cfg, [], "delete", "going on deleting the TPU this VM left its group for")
            return
        if cfg.spend_until and time.time() >= cfg.spend_until:  # a budget outranks any job: deleted as it runs
            if time.time() >= self._quiet_until:
                first = [self.api(cfg, "GET", str(cfg.nodes[0]))[1]] if cfg.compute is None else []
                self.act(cfg, first, "delete", f"its --budget of ${cfg.spend_usd:,.2f} is spent (create --budget)")
            return
        idle, tick = float(cfg.idle), cfg.tick
        down = down_jobs(self.roots, self.jobs, SETTLE_TICKS * tick, read_done())
        if not idle and not down:
            self._idle_looks = 0
            self.say("autostop off")
            return
        if time.time() < self._quiet_until:
            return
        nodes: list[dict] = []
        if cfg.compute is not None:
            states = self.compute_reports(cfg)
        else:
            nodes, states = self.reports(cfg)
        now = time.time()
        self.silent = self.judge(cfg, states, now)
        seen = summarize(states, now, tick, self.silent)
        running, busy, since = seen.running, seen.busy, seen.since
        if down:
            job = os.path.basename(down[0])
            if running:
                self.say(f"down: waiting, job {job} ended but {running[0]}")
            elif self.act(cfg, nodes, "delete", f"job {job} ended (train --down)"):
                with open(DOWN_DONE, "a") as f:
                    f.write("".join(d + "\n" for d in down))
            return
        if running or busy:
            self._idle_looks = 0
            self.say(f"busy: {(running + busy)[0]}")
        elif now - since >= idle:
            self._idle_looks += 1
            if self._idle_looks >= 2:  # on two looks in a row: no worker's state is a look behind
                why = f"idle for {duration(now - since)} on all {len(states)} workers (autostop {duration(idle)})"
                if seen.dead:
                    why = f"idle for {duration(now - since)}, {'; '.join(seen.dead)} (autostop {duration(idle)})"
                self.act(cfg, nodes, cfg.action, why)
        else:
            self._idle_looks = 0
            self.say(f"idle since {time.strftime('%H:%M:%S', time.gmtime(since))}Z; autostop after {duration(idle)}")

    def judge(self, cfg: WatchdogConfig, states: list[tuple[str, WatchState | None]], now: float) -> dict:
        """A verdict on each worker silent for longer than the configuration's bound: what the API says of its VM,
        and whether its address takes a connection (asked of many at once: each may take KNOCK_TIMEOUT)."""
        asked = []
        for name, st in states:
            since = self._missed.silent_since(name, st, cfg.tick, now)
            if since is not None and now - since > cfg.silent and name in self._where:
                asked.append((name, since))
        if not asked:
            return {}
        from concurrent.futures import ThreadPoolExecutor  # only when a worker is silent

        def verdict(item: tuple[str, float]) -> Silent:
            name, since = item
            where = self._where[name]
            if where[0] == "node":
                return node_verdict(where[1], where[2], since)
            status, vm = self.api(cfg, "GET", f"{compute_scope(cfg)}/instances/{where[1]}")
            return vm_verdict(status, vm, since)

        with ThreadPoolExecutor(max_workers=min(16, len(asked))) as pool:
            return {name: v for (name, _), v in zip(asked, pool.map(verdict, asked))}  # noqa: B905 - 3.8: no strict

    def act(self, cfg: WatchdogConfig, nodes: list[dict], action: str, why: str) -> bool:
        self._quiet_until = time.time() + 20 * cfg.tick  # the operation runs (or failed): not again meanwhile
        self._idle_looks = 0
        if cfg.compute is not None:
            return self.compute_delete(cfg, why)  # Compute Engine TPU VMs are not stopped (tpurun refuses it)
        node = nodes[0]
        name = str(node.get("name", ""))
        qr = str(node.get("queuedResource", ""))
        if qr:
            what, method, path = f"delete queued resource {qr.rsplit('/', 1)[-1]}", "DELETE", f"{qr}?force=true"
        elif action == "stop":
            what, method, path = f"stop {name.rsplit('/', 1)[-1]}", "POST", f"{name}:stop"
        else:
            what, method, path = f"delete {name.rsplit('/', 1)[-1]}", "DELETE", name
        status, reply = self.api(cfg, method, path, {} if method == "POST" else None)
        if status == 200:
            self.say(f"{what}: {why}; operation {reply.get('name', '?')}", repeat=True)
            return True
        if status == 404:
            self.say(f"{what}: already gone ({why})", repeat=True)
            return True
        self.say(f"{what} failed: HTTP {status} {error_of(reply)} ({why})", repeat=True)
        return False

    def tick(self) -> float:
        """One look (and decision); the seconds until the next. No failure ends the watchdog."""
        cfg: WatchdogConfig | None = None
        try:
            cfg = self.config()
            self.look()
            if cfg is not None and self.decides(cfg):
                self.decide(cfg)
        except Exception as exc:  # noqa: BLE001 - whatever a look meets, the next look comes
            try:
                self.say(f"error: {type(exc).__name__}: {exc}")
            except Exception:  # noqa: BLE001
                pass
        if cfg is None:
            return UNSET_TICK
        left = cfg.spend_until - time.time() if cfg.spend_until > time.time() else cfg.tick  # on time for a budget
        return max(0.2, min(cfg.tick, left))


def compute_of(cfg: WatchdogConfig) -> ComputeTpu:
    """The Compute Engine TPU the config names (else ValueError: it names the Cloud TPU API's nodes)."""
    if cfg.compute is None:
        raise ValueError("the watchdog's config names no Compute Engine TPU")
    return cfg.compute


def compute_scope(cfg: WatchdogConfig) -> str:
    c = compute_of(cfg)
    return f"projects/{c.project}/zones/{c.zone}"


def kind_of(path: str) -> str:
    """'instance template' for '.../instanceTemplates/NAME', and so on."""
    kind = path.rsplit("/", 2)[-2] if path.count("/") >= 2 else ""
    return {"instanceTemplates": "instance template", "resourcePolicies": "workload policy"}.get(kind, kind)


def error_of(reply: dict) -> str:
    err = reply.get("error")
    return str(err.get("message", "")) if isinstance(err, dict) else ""


def _state_of(entries: list, worker: int) -> WatchState | None:
    """Worker WORKER's published state in a getGuestAttributes reply (one entry per worker, in order)."""
    try:
        items = entries[worker]["queryValue"]["items"]
        return parse_state(next(i["value"] for i in items if i.get("key") == STATE_KEY))
    except (IndexError, KeyError, TypeError, StopIteration, AttributeError):
        return None


def parse_state(value: object) -> WatchState | None:
    """A worker's published state (guest attribute tpurun/watch), or None if there is none or it is not one."""
    try:
        return WatchState.from_json(value) if isinstance(value, str) and value else None
    except ValueError:
        return None


# ------------------------------------------------------------------ running it


def _locked() -> object | None:
    """The per-worker lock, held (keep the returned file open), or None if another watchdog holds it."""
    try:
        os.makedirs(RUN_DIR, mode=0o700, exist_ok=True)
        f = open(LOCK, "a")
    except OSError:
        return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def run() -> int:
    if os.geteuid() != 0:
        sys.stderr.write("tpurun watchdog: needs root (to see every user's processes)\n")
        return 1
    lock = _locked()
    if lock is None:
        return 0  # one is running already
    wd = Watchdog()
    print(f"tpurun watchdog: pid {os.getpid()}, worker {wd.worker}, slice {wd.slice}", flush=True)
    while True:
        wd.wait(wd.tick())


def ensure() -> int:
    """Start `run` in the background unless one runs. It needs root: as another user, through `sudo -n`;
    exit NO_ROOT if that is refused."""
    import subprocess  # here: `run`, on every worker for days, has no use for it (2 MiB each)

    if os.geteuid() != 0:
        try:
            argv_ = ["sudo", "-n", sys.executable, "-S", os.path.abspath(__file__), "ensure"]
            dn = subprocess.DEVNULL
            if subprocess.call(argv_, stdin=dn, stdout=dn, stderr=dn) == 0:
                return 0
        except OSError:
            pass
        sys.stderr.write("tpurun watchdog: needs root, and `sudo -n` was refused\n")
        return NO_ROOT
    lock = _locked()
    if lock is None:
        return 0 if os.path.exists(LOCK) else 1
    lock.close()  # type: ignore[attr-defined]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPURUN_")}  # belongs to no job
    argv = [sys.executable, "-S", os.path.abspath(__file__), "run"]  # no site: stdlib only, for days
    if os.path.isdir("/run/systemd/system"):
        # a unit of its own: systemd keeps it apart from the startup script's or ssh session's unit
        try:
            unit = ["systemd-run", "--quiet", "--collect", "--unit=tpurun-watchdog"]
            done = subprocess.call([*unit, *argv], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
            if done == 0:
                return 0
        except OSError:
            pass
    with open(LOG, "a") as out:
        dn, both = subprocess.DEVNULL, subprocess.STDOUT
        subprocess.Popen(argv, stdin=dn, stdout=out, stderr=both, start_new_session=True, env=env, cwd="/")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["run"]:
        return run()
    if args == ["ensure"]:
        return ensure()
    sys.stderr.write("usage: watchdog.py run|ensure\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
