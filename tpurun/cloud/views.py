"""What every command knows of a TPU, whichever API made it: its state, its slices and their workers
(addresses, the alias each one's host key is pinned under), its metadata, its startup reports and
what its watchdogs report. A backend (tpurun.cloud.backend) answers in these; `list`, `describe` and
`create` show them."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tpurun import ui
from tpurun.cloud import autostop, startup
from tpurun.naming import worker_name

if TYPE_CHECKING:
    from tpurun.cloud.spend import Spend

# the states every command reads (a backend says its own in these words; `describe` shows its own too)
READY = "READY"
PREEMPTED = "PREEMPTED"
STOPPED = "STOPPED"
TERMINATED = "TERMINATED"
REPAIRING = "REPAIRING"  # a host of the TPU is being maintained or repaired (either API)
GONE = "GONE"  # a slice of the TPU that does not exist (yet, or any more)
MAINTENANCE = "MAINTENANCE"  # what provision.why_down says of a TPU a host of which is being maintained


@dataclass
class WorkerView:
    index: int
    internal_ip: str
    external_ip: str
    host_key: str = ""  # the alias its ssh host key is pinned under (keys.host_key_alias), its identity
    vm: str = ""  # its VM's name where the API names each VM (Compute Engine); "" for a node's worker
    instance: str = ""  # the instance IAP's tunnel names it by (its `vm`, or a node's `hostname` guest attribute)
    report: startup.StartupReport | None = None
    slice: int | None = None  # its slice, in a multislice TPU

    @property
    def name(self) -> str:
        return worker_name(self.index, self.slice)


@dataclass(frozen=True)
class Maintenance:
    """Maintenance an API announces for a TPU's host: a Cloud TPU node's, or a Compute Engine VM's
    (`upcomingMaintenance` in both)."""

    kind: str  # SCHEDULED or UNSCHEDULED (Compute Engine also MULTIPLE)
    status: str  # PENDING or ONGOING
    start: dt.datetime | None
    end: dt.datetime | None
    latest_start: dt.datetime | None = None
    can_reschedule: bool = False
    where: str = ""  # the VM it is for (Compute Engine), or the slice's node (a multislice TPU)

    @classmethod
    def from_api(cls, m: dict[str, Any], where: str = "") -> Maintenance | None:
        """From either API's UpcomingMaintenance as JSON (camelCase); None when it announces nothing."""
        status = str(m.get("maintenanceStatus") or "")
        start = instant(m.get("windowStartTime"))
        if status in ("", "UNKNOWN", "UNDEFINED_MAINTENANCE_STATUS") and start is None:
            return None
        return cls(
            kind=str(m.get("type") or "UNKNOWN"),
            status=status or "UNKNOWN",
            start=start,
            end=instant(m.get("windowEndTime")),
            latest_start=instant(m.get("latestWindowStartTime")),
            can_reschedule=bool(m.get("canReschedule")),
            where=where,
        )

    def when(self, now: dt.datetime | None = None) -> str:
        """`ongoing`, `in 2h13m`, `due` (its start passed and it has not begun) or `unknown`."""
        if self.status == "ONGOING":
            return "ongoing"
        if self.start is None:
            return "unknown"
        left = (self.start - (now or dt.datetime.now(dt.timezone.utc))).total_seconds()
        return f"in {ui.age(left)}" if left > 0 else "due"

    def summary(self) -> str:
        """One line: `UNSCHEDULED maintenance in 2h13m (window 10:00-11:00 UTC, cannot be rescheduled)`."""
        window = ""
        if self.start and self.end:
            fmt = "%Y-%m-%d %H:%M UTC"
            window = f"{self.start.astimezone(dt.timezone.utc):{fmt}} to {self.end.astimezone(dt.timezone.utc):{fmt}}, "
        can = "can be rescheduled" if self.can_reschedule else "cannot be rescheduled"
        where = f"{self.where}: " if self.where else ""
        return f"{where}{self.kind} maintenance {self.when()} ({window}{can})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.kind,
            "status": self.status,
            "windowStartTime": self.start.isoformat() if self.start else None,
            "windowEndTime": self.end.isoformat() if self.end else None,
            "latestWindowStartTime": self.latest_start.isoformat() if self.latest_start else None,
            "canReschedule": self.can_reschedule,
            **({"on": self.where} if self.where else {}),
        }


def instant(value: Any) -> dt.datetime | None:
    """An RFC 3339 timestamp, in UTC; None if unset or unreadable."""
    if not value:
        return None
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)


@dataclass
class NodeView:
    """One TPU (or one slice of a multislice TPU), with the fields users ask about."""

    name: str
    backend: str  # who made it: "tpu-api" (a Cloud TPU node) or "compute" (Compute Engine VMs)
    accelerator_type: str
    state: str
    health: str
    runtime_version: str
    workers: list[WorkerView]
    spot: bool
    preemptible: bool
    created: dt.datetime | None
    labels: dict[str, str]
    metadata: dict[str, str]
    queued_resource: str
    id: str = ""  # its unique id in the API (a multislice TPU has one per slice)
    zone: str = ""
    slices: list[NodeView] = field(default_factory=list)  # a multislice TPU: one view per slice
    gone: list[int] = field(default_factory=list)  # a multislice TPU: its slices that do not exist
    slice_of: tuple[str, int] | None = None  # a slice's node: (its multislice TPU, its slice index)
    activity: autostop.Activity = field(default_factory=autostop.Activity)  # what its watchdogs report
    # Whether each VM's metadata server tells the runtimes their place in the slice, as the Cloud TPU API's
    # `tpu-env`, `agent-worker-number` and `worker-network-endpoints` do; when not (Compute Engine VMs),
    # a launch gives them those values itself (docs/train.md, "Where the runtimes learn their slice").
    slice_metadata: bool = True
    maintenance: list[Maintenance] = field(default_factory=list)  # what its API announces, each VM or slice's
    spend: Spend | None = None  # its price and what it has cost so far, where a command asked (list, describe)

    @classmethod
    def joined(cls, name: str, slices: list[NodeView], state: str, **fields: Any) -> NodeView:
        """A multislice TPU NAME of SLICES (not empty, in slice order): every slice's workers, the first
        slice's settings, STATE, and FIELDS (queued_resource, gone, ...)."""
        first = slices[0]
        health = first.health if all(v.health == first.health for v in slices) else "mixed"
        return cls(
            **{
                "name": name,
                "backend": first.backend,
                "zone": first.zone,
                "accelerator_type": first.accelerator_type,
                "state": state,
                "health": health,
                "runtime_version": first.runtime_version,
                "workers": [w for v in slices for w in v.workers],
                "spot": first.spot,
                "preemptible": first.preemptible,
                "created": first.created,
                "labels": first.labels,
                "metadata": first.metadata,
                "queued_resource": "",
                "slices": slices,
                "slice_metadata": first.slice_metadata,
                "maintenance": [m for v in slices for m in v.maintenance],
                **fields,
            }
        )

    @property
    def external_ips(self) -> bool:
        """Whether its workers have external addresses (`create --internal-ips` gives them none)."""
        return any(w.external_ip for w in self.workers)

    @property
    def parts(self) -> list[NodeView]:
        """Its slices' views (itself, for a TPU of one slice)."""
        return self.slices or [self]

    @property
    def multislice(self) -> bool:
        """Whether it is several slices joined as one TPU (some of them may not exist)."""
        return len(self.parts) > 1 or bool(self.gone)

    @property
    def states(self) -> list[str]:
        """Each slice's state, GONE for a slice that does not exist."""
        return [v.state for v in self.parts] + [GONE] * len(self.gone)

    @property
    def ready(self) -> bool:
        """Whether every slice of it exists and is READY."""
        return set(self.states) == {READY}

    def with_reports(self, reports: list[startup.StartupReport] | None) -> NodeView:
        """Itself, each worker (over every slice, in order) given its startup report."""
        for i, w in enumerate(self.workers):
            w.report = reports[i] if reports and i < len(reports) else None
        return self

    @property
    def autostop_setting(self) -> autostop.Setting | None:
        return autostop.read(self.metadata)

    @property
    def shown_metadata(self) -> dict[str, str]:
        """Its metadata as commands show it: ssh keys and big values shortened (`shorten_metadata`)."""
        return {k: shorten_metadata(k, v) for k, v in self.metadata.items()}

    def age(self) -> str:
        if not self.created:
            return "-"
        return ui.age((dt.datetime.now(dt.timezone.utc) - self.created).total_seconds())

    def to_dict(self, *, full: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "backend": self.backend,
            "id": self.id or None,
            "zone": self.zone or None,
            "acceleratorType": self.accelerator_type,
            "state": self.state,
            "health": self.health,
            "workers": len(self.workers),
            "spot": self.spot,
            "preemptible": self.preemptible,
            "externalIps": self.external_ips,
            "age": self.age(),
            "createTime": self.created.isoformat() if self.created else None,
        }
        setting = self.autostop_setting  # "off" as the command says it; null: tpurun set nothing
        d["autostop"] = None
        if setting is not None:
            d["autostop"] = {"idleSeconds": setting.idle, "action": setting.action} if setting.idle else "off"
        d["budget"] = setting.spend.to_dict() if setting is not None and setting.spend is not None else None
        d["maintenance"] = [m.to_dict() for m in self.maintenance]
        if self.spend is not None:
            d.update(self.spend.to_dict())
        d.update(self.activity.to_dict())
        if not full:
            d.pop("watchdog")
        if self.slice_of:
            d["multislice"] = {"tpu": self.slice_of[0], "slice": self.slice_of[1]}
        if self.slices:
            d["slices"] = [v.to_dict(full=full) for v in self.slices]
        if full:
            d["runtimeVersion"] = self.runtime_version
            d["labels"] = self.labels
            d["queuedResource"] = self.queued_resource
            d["metadata"] = self.shown_metadata
            d["workerEndpoints"] = [
                {
                    "name": w.name,
                    "index": w.index,
                    "internalIp": w.internal_ip,
                    "externalIp": w.external_ip,
                    "startup": w.report.status if w.report else "unknown",
                }
                for w in self.workers
            ]
        return d


def shorten_metadata(key: str, value: str) -> str:
    """ssh-keys shown as user + key type + fingerprint-ish prefix; big values summarised."""
    if key == "ssh-keys":
        out = []
        for line in value.splitlines():
            user, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) >= 2:
                out.append(f"{user}:{parts[0]} {parts[1][:12]}…{parts[1][-6:]}")
        return "\n".join(out)
    if len(value) > 200:
        return f"<{len(value)} bytes>"
    return value
