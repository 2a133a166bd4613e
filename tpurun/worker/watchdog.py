"""The TPU's own watchdog: autostop and `train --down` (stdlib only, Python >= 3.8; part of the bundle).

One runs on every worker, as root: tpurun's startup wrapper starts it at every boot once the startup
steps are done, and the agent (a `train --down` job) or `tpurun autostop` start it where it is missing
(`watchdog.py ensure`). A lock in /tmp keeps it to one per worker.

Every worker, every tick, looks whether it is busy: a tpurun job running for any user (an agent state
under ~USER/.tpurun/jobs whose supervisor lives) or a process holding a TPU device (`probe.scan`, the
scan kill-stale uses). It publishes that as guest attribute tpurun/watch, JSON {"t", "worker",
"idle_since", "jobs", "holders"}, which `tpurun list` and `describe` read through the API.

Worker 0 of the first node named in the config decides. The config is the node's metadata attribute
`tpurun-autostop`, JSON {"idle": seconds (0: off), "action": "delete" | "stop", "nodes": [full node
names], "endpoint": the API's root, "tick": seconds}, read again at every tick, so `tpurun autostop`
changes a running watchdog. With the VM's own service-account token from the metadata server, the
decider reads every worker's tpurun/watch (nodes.getGuestAttributes) and acts:
- autostop: every worker has been idle for `idle` seconds -> delete the queued resource the node came
  from (with its nodes), or else delete the node (or stop it, with action "stop");
- down: a job on this worker was started with `train --down` and has ended, and no worker runs a job
  -> the same deletion.
A worker that has not reported for SILENT_TICKS ticks counts as busy (never delete work in doubt).
Every decision is a line in LOG on the deciding worker and in guest attribute tpurun/watchdog.
"""

from __future__ import annotations

import fcntl
import http.client
import json
import os
import pwd
import subprocess
import sys
import time
from urllib.parse import urlsplit

if __package__:  # imported by tpurun (its constants, the tests): the same modules by their package names
    from tpurun.worker import probe
    from tpurun.worker.agent_files import read_json, running_jobs
else:  # run from the bundle on a worker, whose files sit side by side
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import probe  # type: ignore[no-redef]
    from agent_files import read_json, running_jobs  # type: ignore[no-redef]

NAMESPACE = "tpurun"  # guest attributes, shared with the startup wrapper's reports
CONFIG_KEY = "tpurun-autostop"
STATE_KEY = "watch"
DECISION_KEY = "watchdog"
LOG = "/tmp/tpurun-watchdog.log"
LOCK = "/tmp/tpurun-watchdog.lock"
DOWN_DONE = "down.done"  # in a job's directory: its `--down` was acted on
DEFAULT_TICK = 30.0
UNSET_TICK = 5.0  # no setting yet (started by `tpurun autostop` just before it writes one): look again soon
SILENT_TICKS = 3
SETTLE_TICKS = 2  # a `--down` job's end: how long the watchdog leaves the deletion to an attached client
MD_ROOT = "/computeMetadata/v1/"


# ------------------------------------------------------------------ HTTP: metadata server and API


def request(method: str, url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    u = urlsplit(url)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = cls(u.hostname or "", u.port, timeout=15)
    try:
        conn.request(method, u.path + ("?" + u.query if u.query else ""), body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def metadata(path: str) -> str | None:
    host = os.environ.get("GCE_METADATA_HOST") or "metadata.google.internal"
    try:
        status, data = request("GET", f"http://{host}{MD_ROOT}{path}", headers={"Metadata-Flavor": "Google"})
    except OSError:
        return None
    return data.decode("utf-8", "replace") if status == 200 else None


def publish(key: str, value: str) -> None:
    host = os.environ.get("GCE_METADATA_HOST") or "metadata.google.internal"
    url = f"http://{host}{MD_ROOT}instance/guest-attributes/{NAMESPACE}/{key}"
    try:
        request("PUT", url, value.encode(), {"Metadata-Flavor": "Google"})
    except OSError:
        pass  # the next tick publishes again


def tpu_env_value(text: str, key: str) -> str:
    """One value of the `tpu-env` attribute (YAML lines `KEY: 'value'`)."""
    for line in text.splitlines():
        k, sep, v = line.partition(":")
        if sep and k.strip() == key:
            return v.strip().strip("'\"")
    return ""


def duration(seconds: float) -> str:
    s = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size and s % size == 0:
            return f"{s // size}{unit}"
    return f"{s}s"


def summarize(states: list[tuple[str, dict | None]], now: float, tick: float) -> tuple[list[str], list[str], float]:
    """Workers' published states -> (why a job still runs: a worker runs one or has not reported; which
    workers' TPU is held; since when every worker has been idle, the latest of their idle times)."""
    running, busy, since = [], [], 0.0
    for name, st in states:
        if st is None or now - float(st.get("t") or 0) > SILENT_TICKS * tick:
            running.append(f"{name} has not reported")
        elif st.get("jobs"):
            running.append(f"{name} runs job {st['jobs'][0]}")
        elif st.get("idle_since") is None:
            busy.append(f"{name}: {st.get('holders')} process(es) hold the TPU")
        else:
            since = max(since, float(st["idle_since"]))
    return running, busy, since


# ------------------------------------------------------------------ this worker


def job_roots() -> list[str]:
    """Every user's agent jobs directory (tpurun's jobs run as whoever logged in)."""
    roots = []
    for home in sorted({p.pw_dir for p in pwd.getpwall() if p.pw_dir} | {os.path.expanduser("~root")}):
        root = os.path.join(home, ".tpurun", "jobs")
        if root not in roots and os.path.isdir(root):
            roots.append(root)
    return roots


def down_jobs(roots: list[str], running: list[str], settle: float) -> list[str]:
    """Directories of jobs started with `train --down` that ended at least SETTLE seconds ago (an attached
    client deletes the TPU itself meanwhile) and whose deletion is still to be done."""
    found = []
    for root in roots:
        for name in sorted(os.listdir(root)):
            jdir = os.path.join(root, name)
            spec = read_json(os.path.join(jdir, "spec.json"))
            if not spec or not spec.get("down") or name in running or os.path.exists(os.path.join(jdir, DOWN_DONE)):
                continue
            try:
                ended = os.stat(os.path.join(jdir, "state.json")).st_mtime
            except OSError:
                continue
            if time.time() - ended >= settle:
                found.append(jdir)
    return found


def holders() -> int:
    scan = probe.scan(probe.DEFAULT_DEVICE_GLOBS, probe.DEFAULT_LIBTPU_GLOB, [])
    return sum(1 for h in scan["holders"] if not h["protected"])


# ------------------------------------------------------------------ the watchdog


class Watchdog:
    def __init__(self) -> None:
        self.worker = int((metadata("instance/attributes/agent-worker-number") or "0").strip() or 0)
        self.slice = int(tpu_env_value(metadata("instance/attributes/tpu-env") or "", "MEGASCALE_SLICE_ID") or 0)
        self.idle_since: float | None = time.time()
        self.roots: list[str] = []
        self.jobs: list[str] = []
        self._token = ""
        self._token_until = 0.0
        self._said = ""
        self._quiet_until = 0.0

    # ---- what every worker does
    def config(self) -> dict:
        try:
            cfg = json.loads(metadata(f"instance/attributes/{CONFIG_KEY}") or "{}")
        except ValueError:
            cfg = {}
        return cfg if isinstance(cfg, dict) else {}

    def look(self) -> None:
        self.roots = job_roots()
        self.jobs = [j for r in self.roots for j in running_jobs(r)]
        held = holders()
        now = time.time()
        if self.jobs or held:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = now
        state = {"t": round(now, 1), "worker": self.worker, "jobs": self.jobs, "holders": held}
        state["idle_since"] = None if self.idle_since is None else round(self.idle_since, 1)
        publish(STATE_KEY, json.dumps(state, sort_keys=True))

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
    def decides(self, cfg: dict) -> bool:
        return self.worker == 0 and self.slice == 0 and bool(cfg.get("nodes")) and bool(cfg.get("endpoint"))

    def api(self, cfg: dict, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        if time.time() >= self._token_until:
            tok = json.loads(metadata("instance/service-accounts/default/token") or "{}")
            self._token = tok.get("access_token", "")
            self._token_until = time.time() + max(0, int(tok.get("expires_in", 0)) - 60)
        headers = {"Authorization": f"Bearer {self._token}", "Content-Type": "application/json"}
        data = json.dumps(body).encode() if body is not None else None
        status, raw = request(method, str(cfg["endpoint"]).rstrip("/") + "/v2/" + path, data, headers)
        try:
            reply = json.loads(raw.decode() or "{}")
        except ValueError:
            reply = {}
        return status, reply if isinstance(reply, dict) else {}

    def reports(self, cfg: dict) -> tuple[list[dict], list[tuple[str, dict | None]]]:
        """Every node of the config (as the API shows it) and every worker's last published state."""
        nodes, states = [], []
        many = len(cfg["nodes"]) > 1
        for s, name in enumerate(cfg["nodes"]):
            status, node = self.api(cfg, "GET", name)
            if status != 200:
                raise OSError(f"GET {name}: HTTP {status} {node.get('error', {}).get('message', '')}")
            nodes.append(node)
            status, got = self.api(cfg, "POST", f"{name}:getGuestAttributes", {"queryPath": f"{NAMESPACE}/{STATE_KEY}"})
            entries = got.get("guestAttributes", []) if status == 200 else []
            for w in range(len(node.get("networkEndpoints", []))):
                items = entries[w].get("queryValue", {}).get("items", []) if w < len(entries) else []
                value = next((i.get("value") for i in items if i.get("key") == STATE_KEY), None)
                try:
                    state = json.loads(value) if value else None
                except ValueError:
                    state = None
                states.append((f"s{s}/w{w}" if many else f"w{w}", state))
        return nodes, states

    def decide(self, cfg: dict) -> None:
        idle = float(cfg.get("idle") or 0)
        down = down_jobs(self.roots, self.jobs, SETTLE_TICKS * float(cfg.get("tick") or DEFAULT_TICK))
        if not idle and not down:
            self.say("autostop off")
            return
        if time.time() < self._quiet_until:
            return
        nodes, states = self.reports(cfg)
        now = time.time()
        running, busy, since = summarize(states, now, float(cfg.get("tick") or DEFAULT_TICK))
        if down:
            job = os.path.basename(down[0])
            if running:
                self.say(f"down: waiting, job {job} ended but {running[0]}")
            elif self.act(cfg, nodes[0], "delete", f"job {job} ended (train --down)"):
                for jdir in down:
                    open(os.path.join(jdir, DOWN_DONE), "w").close()
            return
        if running or busy:
            self.say(f"busy: {(running + busy)[0]}")
        elif now - since >= idle:
            why = f"idle for {duration(now - since)} on all {len(states)} workers (autostop {duration(idle)})"
            self.act(cfg, nodes[0], str(cfg.get("action") or "delete"), why)
        else:
            self.say(f"idle since {time.strftime('%H:%M:%S', time.gmtime(since))}Z; autostop after {duration(idle)}")

    def act(self, cfg: dict, node: dict, action: str, why: str) -> bool:
        qr = node.get("queuedResource", "")
        if qr:
            what, method, path = f"delete queued resource {qr.rsplit('/', 1)[-1]}", "DELETE", f"{qr}?force=true"
        elif action == "stop":
            what, method, path = f"stop {node['name'].rsplit('/', 1)[-1]}", "POST", f"{node['name']}:stop"
        else:
            what, method, path = f"delete {node['name'].rsplit('/', 1)[-1]}", "DELETE", node["name"]
        status, reply = self.api(cfg, method, path, {} if method == "POST" else None)
        tick = float(cfg.get("tick") or DEFAULT_TICK)
        self._quiet_until = time.time() + 20 * tick  # the operation runs; do not ask twice meanwhile
        if status == 200:
            self.say(f"{what}: {why}; operation {reply.get('name', '?')}", repeat=True)
            return True
        if status == 404:
            self.say(f"{what}: already gone ({why})", repeat=True)
            return True
        message = reply.get("error", {}).get("message", "")
        self.say(f"{what} failed: HTTP {status} {message} ({why})", repeat=True)
        return False

    def tick(self) -> float:
        cfg = self.config()
        try:
            self.look()
            if self.decides(cfg):
                self.decide(cfg)
        except (OSError, ValueError, KeyError, http.client.HTTPException) as exc:
            self.say(f"error: {exc}")
        return float(cfg.get("tick") or (DEFAULT_TICK if cfg else UNSET_TICK))


# ------------------------------------------------------------------ running it


def _locked() -> object | None:
    """The per-worker lock, held (keep the returned file open), or None if another watchdog holds it."""
    f = open(LOCK, "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def run() -> int:
    lock = _locked()
    if lock is None:
        return 0  # one is running already
    wd = Watchdog()
    print(f"tpurun watchdog: pid {os.getpid()}, worker {wd.worker}, slice {wd.slice}", flush=True)
    while True:
        time.sleep(wd.tick())


def ensure() -> int:
    """Start `run` in the background unless one runs; as root (through `sudo -n`) when possible."""
    lock = _locked()
    if lock is None:
        return 0
    lock.close()  # type: ignore[attr-defined]
    if os.geteuid() != 0:
        try:
            argv_ = ["sudo", "-n", sys.executable, os.path.abspath(__file__), "ensure"]
            dn = subprocess.DEVNULL
            if subprocess.call(argv_, stdin=dn, stdout=dn, stderr=dn) == 0:
                return 0
        except OSError:
            pass
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPURUN_")}  # belongs to no job
    argv = [sys.executable, os.path.abspath(__file__), "run"]
    if os.geteuid() == 0 and os.path.isdir("/run/systemd/system"):
        # a unit of its own: systemd keeps it apart from the startup script's or ssh session's unit
        try:
            unit = ["systemd-run", "--quiet", "--collect", "--unit=tpurun-watchdog"]
            done = subprocess.call([*unit, *argv], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
            if done == 0:
                return 0
        except OSError:
            pass
    with open(LOG, "a") as out:
        subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            env=env,
            cwd="/",
        )
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
