"""What tpurun remembers of each TPU between commands: its identity, where its workers are, and how it ended.

One JSON file per TPU, `$TPURUN_HOME/nodes/PROJECT--ZONE--NAME.json` (0600 in a 0700 directory):

- `ids`: the API's unique id of each of the TPU's nodes (one per slice). A name is not an identity: a
  TPU deleted by anything (the console, gcloud, its autostop watchdog, a preemption's clean-up) and
  made again under the same name, or another TPU given the same addresses, is a different TPU.
- `acceleratorType`, `slices` (per slice, each worker's internal and external address, the alias its host
  key is pinned under, and the name of its VM's instance, which IAP's tunnel takes), `nodes` and
  `multislice`: what reaching the workers takes, so that a command needs no API call. A record from before
  instance names were kept is read with none (a command that needs one asks the API).
- `saved`: when the API last confirmed it.
- `deleted`, `by`: once tpurun itself deleted the TPU, when and how (a tombstone: no addresses left).

Host keys are pinned per worker identity (`keys.host_key_alias`), so reaching a worker proves, in the SSH
handshake, that the VM answering at a remembered address is that worker of that TPU; tpurun.fleet.targets
asks the API again whenever a worker cannot prove it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tpurun import config
from tpurun.cloud.login_policy import Policy
from tpurun.naming import NAME_RE, ZONE_RE
from tpurun.settings import Settings

if TYPE_CHECKING:
    from tpurun.cloud.views import NodeView


@dataclass(frozen=True)
class Endpoints:
    """What reaching a TPU's workers takes: its accelerator type, its slices' unique ids and, per slice,
    each worker's (internal address, external address ("" for none), host key alias, instance name ("" where
    not known)). One slice unless the TPU is a multislice one."""

    accelerator_type: str
    slices: list[list[tuple[str, str, str, str]]]
    nodes: list[str]  # the node (instance group, instance) of each slice
    ids: list[str]  # the API's unique id of each slice
    multislice: bool = False
    slice_metadata: bool = True  # NodeView.slice_metadata: the VMs tell the runtimes their place themselves
    login: Policy = Policy()  # how its workers let users in (OS Login or not), as the API told it

    def to_json(self) -> dict:
        return {
            "acceleratorType": self.accelerator_type,
            "slices": self.slices,
            "nodes": self.nodes,
            "ids": self.ids,
            "multislice": self.multislice,
            "sliceMetadata": self.slice_metadata,
            "login": self.login.to_json(),
        }

    @classmethod
    def of(cls, view: NodeView, login: Policy) -> Endpoints:
        """What reaching the workers of the TPU VIEW takes, as the API just told it (LOGIN: `Policy.of` its
        metadata and its project's)."""
        return cls(
            view.accelerator_type,
            [[(w.internal_ip, w.external_ip, w.host_key, w.instance) for w in part.workers] for part in view.parts],
            [part.name for part in view.parts],
            [part.id for part in view.parts],
            multislice=view.multislice,
            slice_metadata=view.slice_metadata,
            login=login,
        )

    @classmethod
    def from_json(cls, data: dict) -> Endpoints:
        slices = [[_worker(w) for w in eps] for eps in data["slices"]]
        nodes = [str(n) for n in data["nodes"]]
        ids = [str(i) for i in data["ids"]]
        if len(ids) != len(slices) or not all(ids):
            raise ValueError("an id per slice")
        return cls(
            str(data["acceleratorType"]),
            slices,
            nodes,
            ids,
            bool(data.get("multislice")),
            bool(data.get("sliceMetadata", True)),
            Policy.from_json(data.get("login")),
        )


def _worker(row: list) -> tuple[str, str, str, str]:
    """A worker's row of a record: (internal, external, alias), with its instance name since they are kept."""
    internal, external, alias, *rest = row
    if len(rest) > 1:
        raise ValueError("a worker's row has 3 or 4 fields")
    return str(internal), str(external), str(alias), str(rest[0]) if rest else ""


@dataclass(frozen=True)
class Remembered:
    """One TPU's file: where its workers were (None once tpurun deleted it), when, and how it was deleted."""

    endpoints: Endpoints | None
    saved: float  # when the API last confirmed ENDPOINTS, or when tpurun deleted the TPU
    ids: tuple[str, ...]
    deleted_by: str = ""  # "`tpurun delete`", "`tpurun train --down` (job X)"; empty while it exists

    def age(self) -> str:
        """How long ago SAVED was, for messages: `5m02s ago`."""
        from tpurun.ui import age

        return f"{age(time.time() - self.saved)} ago"


def path(home: Path, project: str, zone: str, name: str) -> Path:
    return home / "nodes" / f"{project}--{zone}--{name}.json"


def read(file: Path) -> Remembered | None:
    """FILE's record, or None when there is none (or it is unreadable, or from before ids were kept:
    the caller then asks the API)."""
    if config.NODE_CACHE.raw() == "0":
        return None
    try:
        data = json.loads(file.read_text())
        saved = float(data.get("saved", 0))
        if data.get("deleted"):
            return Remembered(None, saved, tuple(str(i) for i in data.get("ids", [])), str(data.get("by", "")))
        endpoints = Endpoints.from_json(data)
        return Remembered(endpoints, saved, tuple(endpoints.ids))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def records(home: Path, project: str, name: str) -> dict[str, Remembered]:
    """Every zone of PROJECT where tpurun remembers a TPU NAME (one it made, reached or deleted): {zone: record}."""
    prefix, suffix = f"{project}--", f"--{name}.json"
    out = {}
    for file in sorted((home / "nodes").glob(f"{project}--*--{name}.json")):
        zone = file.name[len(prefix) : -len(suffix)]
        if ZONE_RE.match(zone) and (record := read(file)) is not None:
            out[zone] = record
    return out


def where(s: Settings, name: str) -> Settings:
    """S for the TPU NAME: in the zone where tpurun made or last reached it, when S's zone is only this place's
    default (a file's, or none: not chosen by a flag, the environment or a record) and tpurun remembers NAME in
    one zone of S's project, another than S's, as not deleted. Else S (its workers still prove who they are)."""
    if s.zone.chosen or not s.project.value:
        return s
    alive = [zone for zone, r in records(s.home_path, s.project.value, name).items() if r.endpoints is not None]
    if len(alive) != 1 or alive[0] == s.zone.value:
        return s
    return s.in_zone(alive[0], f"tpurun's record of {name}")


def elsewhere(home: Path, project: str, zone: str) -> list[tuple[str, str]]:
    """(name, zone) of every TPU tpurun remembers, as not deleted, in PROJECT outside ZONE."""
    out = []
    for file in sorted((home / "nodes").glob(f"{project}--*.json")):
        there, _, name = file.name[len(project) + 2 : -len(".json")].partition("--")
        record = read(file) if there != zone and ZONE_RE.match(there) and NAME_RE.match(name) else None
        if record is not None and record.endpoints is not None:
            out.append((name, there))
    return out


def history(known: dict[str, Remembered], zone: str) -> str:
    """How the TPU whose records are KNOWN ({zone: record}) went from ZONE, as tpurun remembers it (else where
    tpurun deleted one of that name in another zone), for the message that it does not exist; "" if unknown."""
    here = known.get(zone)
    if here is not None and here.deleted_by:
        return f": it was deleted by {here.deleted_by} {here.age()}"
    if here is not None:
        return (
            f": it existed {here.age()} (node id {', '.join(here.ids)}) and was deleted since, by something other "
            "than this tpurun (its autostop, the console, gcloud, another user)"
        )
    buried = sorted((r.saved, z, r) for z, r in known.items() if r.deleted_by)
    if buried:
        _, there, r = buried[-1]
        return f": tpurun deleted the one of zone {there} ({r.deleted_by}, {r.age()})"
    return ""


def remember(file: Path, endpoints: Endpoints) -> None:
    """Record ENDPOINTS as just confirmed by the API."""
    _write(file, {**endpoints.to_json(), "saved": time.time()})


def forget(home: Path, project: str, zone: str, name: str) -> None:
    """Drop what is remembered of NAME (it is being made anew, stopped or started: the API says next)."""
    path(home, project, zone, name).unlink(missing_ok=True)


def bury(home: Path, project: str, zone: str, name: str, by: str) -> None:
    """Remember that tpurun deleted NAME, and how (BY), so that a later command naming it says so."""
    file = path(home, project, zone, name)
    old = read(file)
    _write(file, {"deleted": True, "by": by, "ids": list(old.ids) if old else [], "saved": time.time()})


def _write(file: Path, data: dict) -> None:
    file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = file.with_name(file.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data))
    os.replace(tmp, file)
