"""A TPU's autostop setting and spend limit (`create --budget`: the time its price takes to spend the money, after
which its watchdog deletes it), and what its watchdog reports: the client side of tpurun/worker/watchdog.py.

The setting is node metadata `tpurun-autostop` (JSON: idle seconds or 0 for off, the action, the nodes
watched, the API endpoint the watchdog calls, its tick). The startup wrapper starts the watchdog on
every worker of a node tpurun created; for any other node, `tpurun autostop` and `train --down` start
it over SSH (tpurun/watchdogs.py, above the cloud layer, sets and starts it). Every worker's watchdog
reads the setting again at each tick, so changing the metadata changes it in place. What the watchdogs
publish (guest attributes tpurun/watch and tpurun/watchdog) is read back here for `list` and `describe`.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tpurun import config, ui
from tpurun.cloud import startup
from tpurun.errors import TpurunError, UsageError
from tpurun.naming import parse_duration
from tpurun.worker import bundle_metadata, watchdog, watchdog_reports
from tpurun.worker.watchdog_reports import DEFAULT_TICK, WatchdogConfig, duration

if TYPE_CHECKING:
    from tpurun.cloud.backend import Backend, CreateSpec, Request
    from tpurun.cloud.client import Cloud
    from tpurun.cloud.views import NodeView

KEY = watchdog.CONFIG_KEY
ACTIONS = ("delete", "stop")
MIN_TICKS = 2  # an idle period shorter than two looks could not be told from a pause between jobs


def tick() -> float:
    return config.WATCHDOG_TICK.number()


def parse_idle(text: str, option: str = "--autostop") -> int:
    """'30m', '2h', '1d', '90s' -> seconds; 'off' -> 0. A unit is required: `--autostop 30` is refused rather
    than read as 30 seconds when minutes were meant."""
    t = text.strip().lower()
    if t == "off":
        return 0
    if re.fullmatch(r"0+[smhd]?", t):
        raise UsageError(f"{option} {text}: an idle period must be longer than 0; use 'off' to turn autostop off")
    if re.fullmatch(r"\d+", t):
        raise UsageError(f"{option} {text}: give a unit, e.g. {t}m (or 'off')")
    try:
        seconds = parse_duration(t)
    except UsageError:
        raise UsageError(f"{option} {text}: not a duration; use e.g. 30m, 2h or 1d (or 'off')") from None
    floor = MIN_TICKS * tick()
    if seconds < floor:
        raise UsageError(f"{option} {text}: the shortest idle period is {duration(floor)} (two looks of the watchdog)")
    return seconds


def check_action(action: str, cannot_stop: str = "") -> None:
    """ACTION is one the watchdog takes, and stop only where the TPU can be stopped (CANNOT_STOP: why not)."""
    if action not in ACTIONS:
        raise UsageError(f"--autostop-action {action}: choose delete or stop")
    if action == "stop" and cannot_stop:
        raise UsageError(f"--autostop-action stop: {cannot_stop}", hint="use --autostop-action delete")


def setting(resources: WatchdogConfig, idle: int, action: str = "delete", spend: Spend | None = None) -> str:
    """The `tpurun-autostop` metadata value: the watchdog's RESOURCES (the API and the TPU's resources, from the
    backend's `watchdog_resources`), the idle period, the action and the watchdog's tick; SPEND, its spend limit."""
    cfg = resources.set(idle, action, tick(), config.WATCHDOG_SILENT.number())
    if spend is not None:
        cfg.spend_usd, cfg.spend_until, cfg.spend_left = spend.usd, spend.until, spend.left
    return cfg.to_json()


def stand_in(nodes: list[str]) -> WatchdogConfig:
    """Resources of the same size and shape as a Cloud TPU API TPU's, for checks made before settings."""
    return WatchdogConfig("https://tpu.googleapis.com", [f"projects/-/locations/-/nodes/{n}" for n in nodes])


def metadata(
    resources: WatchdogConfig, idle: int, action: str = "delete", spend: Spend | None = None
) -> dict[str, str]:
    """The metadata entries that install the watchdog (the startup wrapper starts it) and set it."""
    return {startup.WATCHDOG_KEY: bundle_metadata(), KEY: setting(resources, idle, action, spend)}


@dataclass(frozen=True)
class Spend:
    """`create --budget`: USD, spent at UNTIL (epoch seconds) by the TPU's price; its watchdog deletes it then. While
    `tpurun stop` has stopped the TPU, UNTIL is 0 and LEFT the seconds of it left (`tpurun start` counts on)."""

    usd: float
    until: float
    left: float = 0.0

    def label(self) -> str:
        """`$0.50, deletes it at 14:03:07Z (in 12m)`; stopped: `$0.50, 12m left once started`."""
        if not self.until:
            return f"{ui.usd(self.usd)}, {ui.age(self.left)} left once started"
        left = self.until - time.time()
        when = f"in {ui.age(left)}" if left > 0 else "spent"
        return f"{ui.usd(self.usd)}, deletes it at {time.strftime('%H:%M:%SZ', time.gmtime(self.until))} ({when})"

    def to_dict(self) -> dict[str, Any]:
        at = dt.datetime.fromtimestamp(self.until, dt.timezone.utc).isoformat() if self.until else None
        left = self.until - time.time() if self.until else self.left
        return {"usd": self.usd, "deleteAt": at, "secondsLeft": max(0, round(left))}


def paused(md: dict[str, str]) -> dict[str, str] | None:
    """`tpurun stop`: the setting that stops the spend limit's clock in MD while the TPU is stopped (it bills only
    its disks then): the seconds left kept in place of the deadline; None where no clock runs."""
    cfg = _config(md)
    if cfg is None or not cfg.spend_until:
        return None
    cfg.spend_left, cfg.spend_until = max(0.0, cfg.spend_until - time.time()), 0.0
    return {KEY: cfg.to_json()}


@contextmanager
def spend_paused(maker: Backend, view: NodeView) -> Iterator[None]:
    """Around `tpurun stop` of VIEW: its spend limit's clock stopped first (`paused`), and started again should the
    stop fail."""
    maker.update_metadata(view, paused)
    try:
        yield
    except BaseException:
        maker.update_metadata(view, resumed)
        raise


def resumed(md: dict[str, str]) -> dict[str, str] | None:
    """`tpurun start`: the setting that starts the clock `paused` stopped again; None where none was stopped."""
    cfg = _config(md)
    if cfg is None or cfg.spend_until or not cfg.spend_left:
        return None
    cfg.spend_until, cfg.spend_left = time.time() + cfg.spend_left, 0.0
    return {KEY: cfg.to_json()}


def _config(md: dict[str, str]) -> WatchdogConfig | None:
    try:
        return WatchdogConfig.from_json(md.get(KEY, ""))
    except ValueError:
        return None


def spend_limit(cloud: Cloud, spec: CreateSpec, request: Request) -> Spend | None:
    """`create --budget`'s spend limit, from the price of the TPU REQUEST makes (every slice) in CLOUD's zone (kept in
    REQUEST), counted from now (its request: a little before the API's createTime, so never later than the money
    lasts); refused (UsageError) before anything is made where the TPU has no published price."""
    if not spec.budget:
        return None
    from tpurun.cloud import prices

    kind = "spot" if spec.spot else "preemptible" if spec.preemptible else "flex-start" if spec.flex_start else ""
    accel = request.topology.name
    request.price = prices.quote(
        accel,
        cloud.zone,
        kind or "on-demand",
        endpoint=cloud.endpoint,
        home=cloud.settings.home_path,
        slices=spec.slices,
    )
    if request.price is None:
        raise UsageError(f"--budget: {accel} has no published price in {cloud.zone}, so a budget cannot be counted")
    return Spend(spec.budget, time.time() + spec.budget / request.price.per_hour * 3600.0)


@dataclass(frozen=True)
class Setting:
    idle: int  # seconds; 0: off
    action: str
    tick: float = DEFAULT_TICK
    spend: Spend | None = None  # `create --budget`

    def label(self) -> str:
        return f"{self.action} after {duration(self.idle)} idle" if self.idle else "off"


def read(md: dict[str, str]) -> Setting | None:
    """The autostop setting in a node's metadata; None where tpurun set none."""
    cfg = _config(md)
    if cfg is None:
        return None
    spend = Spend(cfg.spend_usd, cfg.spend_until, cfg.spend_left) if cfg.spend_until or cfg.spend_left else None
    return Setting(cfg.idle, cfg.action, cfg.tick, spend)


# ---------------------------------------------------------------------------- what the watchdogs report


@dataclass
class Activity:
    """What a TPU's workers last reported: idle since when, the jobs running, the last decision."""

    idle_for: float | None = None  # seconds every worker has been idle; None: busy or not known
    jobs: list[str] = field(default_factory=list)
    why_busy: str = ""  # the first reason it is not idle ("" if idle or nothing reported)
    decision: str = ""  # the deciding worker's last line (tpurun/watchdog)
    reported: bool = False  # some worker runs a watchdog
    age: float | None = None  # seconds since the oldest report used was published
    down: list[str] = field(default_factory=list)  # running `train --down` jobs: the TPU goes when they end
    silent: list[str] = field(default_factory=list)  # a line on each worker that has not reported (dead or not)

    def idle_label(self) -> str:
        """Idle for how long, or busy; a silent worker said as what it is (`w5 dead: silent for 6m; its VM ...`),
        not as work."""
        if not self.reported:
            return "-"
        state = "busy" if self.idle_for is None else ui.age(self.idle_for)
        if self.silent:
            state = f"{state}, {self.silent[0]}" + (
                f" (+{len(self.silent) - 1} silent)" if len(self.silent) > 1 else ""
            )
        return f"{state} ({ui.age(self.age)} ago)" if self.age is not None else state

    def autostop_label(self, setting: Setting | None) -> str:
        """SETTING, or what replaces it while a `train --down` job runs."""
        if self.down:
            return f"delete when {', '.join(self.down)} ends (--down)"
        return setting.label() if setting else "-"

    def to_dict(self) -> dict[str, Any]:
        return {
            "idleSeconds": None if self.idle_for is None else round(self.idle_for),
            "jobs": self.jobs,
            "busy": self.why_busy or None,
            "watchdog": self.decision or None,
            "reportedSecondsAgo": None if self.age is None else round(self.age, 1),
            "down": self.down,
            "silent": self.silent,
        }


def activity(maker: Backend, view: NodeView) -> Activity:
    """Read what every worker of the TPU VIEW (which MAKER made) published; a TPU not READY publishes nothing,
    and no watchdog runs where tpurun never wrote a setting (no API call is made for those)."""
    current = read(view.metadata)
    if current is None or not view.ready:
        return Activity()
    try:
        attrs = maker.guest_attributes(view, watchdog.NAMESPACE + "/")
    except TpurunError:
        return Activity()
    many = len(view.parts) > 1
    states = [
        (
            f"s{w.slice}/w{w.index}" if many else f"w{w.index}",
            watchdog.parse_state(items.get((watchdog.NAMESPACE, watchdog.STATE_KEY))),
        )
        for w, items in zip(view.workers, attrs, strict=True)
    ]
    decision = next((d for items in attrs if (d := items.get((watchdog.NAMESPACE, watchdog.DECISION_KEY), ""))), "")
    if not any(st for _, st in states):
        return Activity()
    now = time.time()
    seen = watchdog_reports.summarize(states, now, current.tick, watchdog_reports.verdicts_in(states))
    jobs = sorted({j for name, st in states if st and name not in seen.gone for j in st.jobs})  # a dead VM runs none
    down = sorted({j for _, st in states if st for j in st.down if j in jobs})
    reasons, since = seen.running + seen.busy, seen.since
    times = [st.t for name, st in states if st and name not in seen.gone]
    return Activity(
        idle_for=None if reasons else max(0.0, now - since),
        jobs=jobs,
        why_busy=reasons[0] if reasons else "",
        decision=decision,
        reported=True,
        age=max(0.0, now - min(times)) if times else None,
        down=down,
        silent=seen.silent,
    )


def activities(tpus: list[tuple[Backend, NodeView]]) -> list[Activity]:
    """`activity` of many TPUs (each with the backend that made it) at once, in parallel."""
    if not tpus:
        return []
    with ThreadPoolExecutor(max_workers=min(8, len(tpus))) as pool:
        return list(pool.map(lambda tpu: activity(*tpu), tpus))
