"""What tpurun tells the TPU's watchdog, what the watchdogs publish, and how it is read: the watchdog's
configuration (a `WatchdogConfig`, node metadata `tpurun-autostop`; its resources, and with them a `ComputeTpu`
where Compute Engine made the TPU), each worker's state (a `WatchState`, guest attribute tpurun/watch; the deciding
worker's carries a `Silent` verdict on each worker whose watchdog stopped reporting), and every worker's states
summed up (`summarize`: a `Summary`), for the deciding watchdog and for `tpurun list` and `describe`. A worker
that has not reported for SILENT_TICKS ticks counts as busy, until the decider finds its VM dead
(watchdog_silent.py): a dead worker's work ended with its last report, and the idle period counts from then
(docs/cost-safety.md).

Part of the bundle, beside watchdog.py (stdlib only, Python >= 3.8); its records are protocol.py's kind
(`RecordBase`). tpurun imports it as `tpurun.worker.watchdog_reports`."""

from __future__ import annotations

import json

if __package__:  # tpurun, the tests
    from tpurun.worker.protocol import RecordBase
else:  # the bundle on a worker, whose files sit side by side
    from protocol import RecordBase  # type: ignore[no-redef]

TYPE_CHECKING = False  # typing is not imported on a worker (see protocol.py's records); type checkers read True
if TYPE_CHECKING:
    from typing import Any


# ---------------------------------------------------------------- the watchdog's configuration (node metadata)

DEFAULT_TICK = 30.0  # seconds between the watchdog's looks, where its configuration names none
# seconds a worker's watchdog may stay silent before the deciding one asks whether its VM is still there
# (tpurun.config.WATCHDOG_SILENT; docs/cost-safety.md)
DEFAULT_SILENT = 300.0
# `watchdog.py ensure`'s exit code where it is not root and `sudo -n` was refused (tpurun says why in its own words)
NO_ROOT = 4


class ComputeTpu(RecordBase):
    """A TPU Compute Engine made, as its watchdog finds and deletes it: in PROJECT and ZONE, named NAME; its lone VM
    (INSTANCE), or its slices' managed instance GROUPS and what was made with them that goes with them (ALSO: the
    instance template and workload policy, by path)."""

    __slots__ = ("project", "zone", "name", "instance", "groups", "also")

    def __init__(
        self,
        project: str,
        zone: str,
        name: str,
        instance: str = "",
        groups: list[str] | None = None,
        also: list[str] | None = None,
    ) -> None:
        self.project = project
        self.zone = zone
        self.name = name
        self.instance = instance
        self.groups = [] if groups is None else groups
        self.also = [] if also is None else also


class WatchdogConfig(RecordBase):
    """What tpurun tells the TPU's watchdog (node metadata `tpurun-autostop`, JSON; read again at every look): its
    *resources*, what it calls and deletes (the API's ENDPOINT, and the Cloud TPU API's NODES by full name, or the
    Compute Engine TPU, COMPUTE), and its setting: IDLE seconds (0: autostop off), the ACTION then ("delete" or
    "stop"), TICK seconds between looks, SILENT seconds a worker may not report before its VM is looked at; and
    `create --budget`'s spend limit: SPEND_USD, and SPEND_UNTIL (epoch seconds) when its price has spent it, at
    which the TPU is deleted whatever runs on it (0: none); while `tpurun stop` has stopped the TPU (it bills only its
    disks then), SPEND_LEFT seconds in its place, which `tpurun start` counts on from."""

    __slots__ = (
        "endpoint", "nodes", "compute", "idle", "action", "tick", "silent", "spend_usd", "spend_until", "spend_left",
    )  # fmt: skip

    def __init__(
        self,
        endpoint: str,
        nodes: list[str] | None = None,
        compute: ComputeTpu | None = None,
        idle: int = 0,
        action: str = "delete",
        tick: float = DEFAULT_TICK,
        silent: float = DEFAULT_SILENT,
        spend_usd: float = 0.0,
        spend_until: float = 0.0,
        spend_left: float = 0.0,
    ) -> None:
        self.endpoint = endpoint
        self.nodes = [] if nodes is None else nodes
        self.compute = compute
        self.idle = idle
        self.action = action
        self.tick = tick
        self.silent = silent
        self.spend_usd = spend_usd
        self.spend_until = spend_until
        self.spend_left = spend_left

    def set(self, idle: int, action: str, tick: float, silent: float = DEFAULT_SILENT) -> WatchdogConfig:
        """These resources and spend limit with this setting."""
        c = self
        spend = c.spend_usd, c.spend_until, c.spend_left
        return WatchdogConfig(c.endpoint, c.nodes, c.compute, idle, action, tick, silent, *spend)

    def to_json(self) -> str:
        data = self.to_dict()
        for key in ("spend_usd", "spend_until", "spend_left"):  # absent where there is no limit
            if not data[key]:
                del data[key]
        if self.compute is None:
            del data["compute"]
        else:
            del data["nodes"]
            data["compute"] = {k: v for k, v in self.compute.to_dict().items() if v}
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> WatchdogConfig:
        """The configuration (its tick kept between 0.2 s and an hour), or ValueError."""
        data = json.loads(text)
        try:
            c = data.get("compute")
            compute = None
            if isinstance(c, dict):
                groups, also = [str(g) for g in c.get("groups") or []], [str(p) for p in c.get("also") or []]
                instance = str(c.get("instance") or "")
                compute = ComputeTpu(
                    str(c["project"]), str(c["zone"]), str(c.get("name") or ""), instance, groups, also
                )
            tick = min(3600.0, max(0.2, float(data.get("tick") or DEFAULT_TICK)))
            nodes = [str(n) for n in data.get("nodes") or []]
            idle, action = int(data.get("idle") or 0), str(data.get("action") or "delete")
            silent = max(0.0, float(data.get("silent") or DEFAULT_SILENT))  # an older tpurun's setting: the default
            spend = (float(data.get(k) or 0.0) for k in ("spend_usd", "spend_until", "spend_left"))
            return cls(str(data.get("endpoint") or ""), nodes, compute, idle, action, tick, silent, *spend)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a watchdog configuration: {text[:100]!r}") from e


# ---------------------------------------------------------------- what each watchdog publishes (guest attribute tpurun/watch)


class Silent(RecordBase):
    """What the deciding watchdog found of a worker that has not reported since SINCE (its last report, or when the
    decider first missed it), for longer than its bound: DEAD (the API says its VM is gone, stopped, preempted or
    unresponsive, or it takes no connection at its address) or not; VM, what was found, in words that follow "its
    VM" or stand alone ("does not answer at 10.0.0.5:22; the API says its node is READY")."""

    __slots__ = ("since", "dead", "vm")

    def __init__(self, since: float, dead: bool, vm: str) -> None:
        self.since, self.dead, self.vm = since, dead, vm

    @classmethod
    def from_dict(cls, d: Any) -> Silent:
        try:
            return cls(float(d["since"]), bool(d["dead"]), str(d.get("vm") or ""))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a silent worker's verdict: {str(d)[:100]!r}") from e


class WatchState(RecordBase):
    """What each worker's watchdog publishes at every look (guest attribute tpurun/watch, JSON), read by the deciding
    worker's watchdog and by `tpurun list` and `describe`: T, the look's time (the worker's clock); the WORKER; the
    JOBS running there, and DOWN, those of them started with `train --down`; other tpurun WORK (`setup`); HOLDERS,
    how many processes hold the TPU; IDLE_SINCE, since when none of these was there (None: not idle). The deciding
    worker's adds SILENT: what it found of each worker silent for longer than the configuration's bound, by name."""

    __slots__ = ("t", "worker", "jobs", "work", "holders", "idle_since", "down", "silent")

    def __init__(
        self,
        t: float,
        worker: int = 0,
        jobs: list[str] | None = None,
        work: list[str] | None = None,
        holders: int = 0,
        idle_since: float | None = None,
        down: list[str] | None = None,
        silent: dict[str, Silent] | None = None,
    ) -> None:
        self.t = t
        self.worker = worker
        self.jobs = [] if jobs is None else jobs
        self.work = [] if work is None else work
        self.holders = holders
        self.idle_since = idle_since
        self.down = [] if down is None else down
        self.silent = {} if silent is None else silent

    def to_json(self) -> str:
        data = self.to_dict()
        data["silent"] = {name: v.to_dict() for name, v in self.silent.items()}
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> WatchState:
        """The state (what an older watchdog left out read as none), or ValueError."""
        data = json.loads(text)
        try:
            since = data.get("idle_since")
            jobs, work, down = ([str(j) for j in data.get(k) or []] for k in ("jobs", "work", "down"))
            worker, holders = int(data.get("worker") or 0), int(data.get("holders") or 0)
            silent = {str(k): Silent.from_dict(v) for k, v in (data.get("silent") or {}).items()}
            idle = None if since is None else float(since)
            return cls(float(data["t"]), worker, jobs, work, holders, idle, down, silent)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a watchdog's state: {str(text)[:100]!r}") from e


# ---------------------------------------------------------------- how it is read: every worker's reports summed up

SILENT_TICKS = 3  # ticks without a report before a worker is silent


class Summary:
    """Every worker's reports summed up: RUNNING, why a job still runs (a worker runs one, or is silent and not
    found dead); BUSY, which workers' TPU is held; SINCE, since when every live worker has been idle (a dead one's
    work ended with its last report); SILENT, a line on each silent worker, DEAD among them those found dead, and
    GONE, their names."""

    __slots__ = ("running", "busy", "since", "silent", "dead", "gone")

    def __init__(self) -> None:
        self.running: list[str] = []
        self.busy: list[str] = []
        self.since = 0.0
        self.silent: list[str] = []
        self.dead: list[str] = []
        self.gone: set[str] = set()


def summarize(
    states: list[tuple[str, WatchState | None]], now: float, tick: float, verdicts: dict[str, Silent] | None = None
) -> Summary:
    """Workers' published states (None: nothing, or nothing readable) and the deciding watchdog's VERDICTS on the
    silent ones, summed up."""
    s = Summary()
    verdicts = verdicts or {}
    if not states:
        s.running.append("no worker to look at")
    for name, st in states:
        if st is None or now - st.t > SILENT_TICKS * tick:
            v = verdicts.get(name)
            if v is not None and v.dead:
                s.dead.append(f"{name} dead: silent for {duration(now - v.since)}; its VM {v.vm}")
                s.silent.append(s.dead[-1])
                s.gone.add(name)
                s.since = max(s.since, v.since)
                continue
            said = f"{name} silent for {duration(now - st.t)}" if st is not None else f"{name} has not reported"
            s.running.append(said + (f"; its VM {v.vm}" if v is not None else ""))
            s.silent.append(s.running[-1])
        elif st.jobs:
            s.running.append(f"{name} runs job {st.jobs[0]}")
        elif st.work:
            s.running.append(f"{name} runs tpurun {st.work[0]}")
        elif st.idle_since is None:
            s.busy.append(f"{name}: {st.holders} process(es) hold the TPU")
        else:
            s.since = max(s.since, st.idle_since)
    return s


def verdicts_in(states: list[tuple[str, WatchState | None]]) -> dict[str, Silent]:
    """The deciding watchdog's verdicts on silent workers, as it published them with its own state."""
    found: dict[str, Silent] = {}
    for _, st in states:
        if st is not None:
            found.update(st.silent)
    return found


def duration(seconds: float) -> str:
    """90 -> 1m30s, 5400 -> 1h30m, 86400 -> 1d: the two largest units, the smaller left out when 0."""
    s = int(seconds)
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if s >= size or (unit == "s" and not parts):
            parts.append(f"{s // size}{unit}")
            s %= size
    head = parts[:2]
    return head[0] + (head[1] if len(head) > 1 and not head[1].startswith("0") else "")
