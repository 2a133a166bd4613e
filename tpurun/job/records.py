"""What tpurun remembers on this machine about each job (for `jobs`, `logs` and `cancel`): one JSON file
per job under $TPURUN_HOME/jobs/, written 0600."""

from __future__ import annotations

import datetime as dt
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpurun.cloud import ledger
from tpurun.errors import ApiError, UnreachableError, UsageError
from tpurun.fleet import targets
from tpurun.fleet.targets import Target
from tpurun.job.ends import End
from tpurun.naming import each_or_by_reason
from tpurun.settings import Settings
from tpurun.worker.protocol import Notice


def new_job_id() -> str:
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


@dataclass
class JobRecord:
    """What tpurun remembers locally about a job, for `jobs`, `logs` and `cancel`."""

    job_id: str
    tpu: str  # "local" for this machine
    workers: list[int]
    cores: dict[int, list[int]]  # worker -> the slots tpurun started there (the record's key kept)
    created: str
    detached: bool
    command: list[str]
    python: str
    ids: list[str] = field(default_factory=list)  # the TPU's identity (its nodes' unique ids); [] for local
    project: str = ""  # where the TPU is ("" for local, and in records older than these fields)
    zone: str = ""
    restart: int = 0  # the restarts of its `train` before it (TPURUN_RESTART_COUNT)
    restart_reason: str = ""  # why the attempt before it ended (job.ends' kinds; TPURUN_RESTART_REASON)
    end: End | None = None  # how it ended, written once when it is known (by its `train`, or the first view that
    # saw it ended on every worker) and never after: later events (a worker lost, the TPU gone) do not rewrite it
    detail: str = ""  # which process failed first, and how (ends.failure), for an end that names one
    notice: dict[str, Any] | None = None  # the notice of a host event it got (protocol.Notice's fields)
    price: dict[str, Any] | None = None  # its TPU's price when it started (prices.Price.to_json); None: none known
    started_at: float = 0.0  # when it started (time.time()); 0 in records older than costs
    ended_at: float = 0.0  # when it ended, as its workers said (else when its end was seen); 0 until then

    def ended(self, end: End, detail: str = "", notice: Notice | None = None, at: float | None = None) -> bool:
        """Write down how the job ended (AT: when; now if not known), once: False (nothing changed) where its end is
        written already."""
        if self.end is not None:
            return False
        self.end, self.detail, self.ended_at = end, detail, at or time.time()
        self.notice = notice.to_dict() if notice is not None else None
        return True

    def begin(self, home: Path) -> None:
        """The job's record written as it starts, and its start in the spend ledger (`tpurun cost`)."""
        self.save(home)
        if self.tpu != "local":
            where = (self.tpu, self.project, self.zone, self.ids)
            ledger.job_started(home, self.job_id, self.restart, where, self.started_at, self.price)

    def close(
        self, home: Path, end: End, detail: str = "", notice: Notice | None = None, at: float | None = None
    ) -> bool:
        """`ended`, then the record saved and the end written in the spend ledger, where it was not written before."""
        if not self.ended(end, detail, notice, at):
            return False
        self.save(home)
        if self.tpu != "local":
            ledger.job_ended(home, self.job_id, self.restart, end.value, self.ended_at)
        return True

    @property
    def per_hour(self) -> float | None:
        """USD an hour of its TPU (every slice) when it started; None without a price."""
        return ledger.rate(self.price)

    def cost(self, now: float | None = None) -> float | None:
        """USD its TPU's time cost from its start to its end (else NOW); None without a price or a start."""
        rate = self.per_hour
        if rate is None or not self.started_at:
            return None
        return rate * max(0.0, (self.ended_at or now or time.time()) - self.started_at) / 3600

    def target(self, s: Settings, worker: str = "all") -> Target:
        """The workers this job ran on (WORKER: those of them a spec names), on its TPU where it was then
        (S: the settings for tpurun's home and the API endpoint)."""
        if self.tpu == "local":
            return targets.resolve(s.naming(None, source="the job's record"), local=True, worker_spec=worker)
        spec = ",".join(str(w) for w in self.workers) if worker == "all" else worker
        where = s.naming(self.tpu, project=self.project, zone=self.zone, source="the job's record")
        target = targets.resolve(where, worker_spec=spec)
        outside = [w.name for w in target.workers if w.index not in self.workers]
        if outside:
            target.close()
            raise UsageError(f"--worker {worker}: job {self.job_id} did not run on {', '.join(outside)}")
        return target

    def where(self) -> tuple[str, str, str, tuple[str, ...]]:
        """Which TPU the job ran on: its name, project, zone and nodes' ids."""
        return self.tpu, self.project, self.zone, tuple(self.ids)

    def save(self, home: Path) -> None:
        d = home / "jobs"
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = d / f"{self.job_id}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.__dict__, indent=1))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)

    @classmethod
    def load(cls, home: Path, job_id: str, tpu: str | None = None) -> JobRecord:
        """JOB_ID's record; with TPU, UsageError unless the job ran on the TPU of that name."""
        record = cls._load(home, job_id)
        if tpu and tpu != record.tpu:
            raise UsageError(
                f"job {job_id} ran on {record.tpu}, not on {tpu}", hint=f"`tpurun jobs --tpu {tpu}` lists its jobs"
            )
        return record

    @classmethod
    def _load(cls, home: Path, job_id: str) -> JobRecord:
        path = home / "jobs" / f"{job_id}.json"
        if not job_id or "/" in job_id or not path.is_file():
            known = sorted(p.stem for p in (home / "jobs").glob("*.json")) if (home / "jobs").is_dir() else []
            hint = f"known jobs: {', '.join(known[-5:])}" if known else "`tpurun jobs` lists them"
            raise UsageError(f"unknown job {job_id!r}", hint=hint)
        data = json.loads(path.read_text())
        data["cores"] = {int(k): v for k, v in data["cores"].items()}
        data["end"] = End.read(data.get("end") or "")
        return cls(**data)


def forget(home: Path, job_id: str) -> None:
    """Drop the record of JOB_ID (its TPU is gone)."""
    (home / "jobs" / f"{job_id}.json").unlink(missing_ok=True)


def list_records(home: Path) -> list[JobRecord]:
    d = home / "jobs"
    if not d.is_dir():
        return []
    return [JobRecord._load(home, p.stem) for p in sorted(d.glob("*.json"))]


def connect(target: Target, record: JobRecord | None = None) -> None:
    """Connect every worker of TARGET, or raise; with RECORD, also that TARGET is the TPU that job ran on."""
    errors = target.fleet.connect()
    if errors:
        names = target.worker_names
        raise UnreachableError("; ".join(each_or_by_reason([(names[i], errors[i]) for i in sorted(errors)])))
    if record is not None:
        same_tpu(target, record)


def same_tpu(target: Target, record: JobRecord) -> None:
    """ApiError unless TARGET is the TPU RECORD's job ran on (not another one made since under its name)."""
    if target.other_than(record.ids):
        raise ApiError(
            f"job {record.job_id} ran on the TPU {record.tpu} with node id {', '.join(record.ids)}, which no longer "
            f"exists: the TPU named {record.tpu} now is another one (node id {', '.join(target.ids)}), without "
            "that job or its logs"
        )
