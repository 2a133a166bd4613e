"""What users type for Cloud TPU resources -- names, zones, durations: checked locally, before anything
reaches the API."""

from __future__ import annotations

import re

from tpurun.errors import UsageError

NAME_RE = re.compile(r"^[a-z](?:[a-z0-9-]{0,61}[a-z0-9])?$")


def _checked(pattern: re.Pattern[str], value: str, problem: str) -> str:
    if not pattern.match(value or ""):
        raise UsageError(problem)
    return value


def validate_name(name: str) -> str:
    return _checked(
        NAME_RE,
        name,
        f"invalid TPU name {name!r}: use 1-63 lowercase letters, digits and '-', starting with a letter "
        "and not ending with '-'",
    )


def worker_name(index: int, slice_id: int | None = None) -> str:
    """How output names a worker: w3, or s1/w1 (INDEX within its slice) in a multislice TPU."""
    return f"s{slice_id}/w{index}" if slice_id is not None else f"w{index}"


# region-zone as Compute Engine names them: us-central2-b, europe-west4-a, asia-northeast1-b
ZONE_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")


def validate_zone(zone: str) -> str:
    return _checked(
        ZONE_RE,
        zone,
        f"{zone!r} is not a zone: Cloud TPU zones look like us-central2-b or europe-west4-a "
        "(`gcloud compute tpus locations list` shows them)",
    )


def parse_duration(text: str) -> int:
    """'6h', '30m', '2d', '90s' or seconds -> seconds."""
    m = re.match(r"^(\d+)([smhd]?)$", text.strip())
    if not m:
        raise UsageError(f"invalid duration '{text}': use e.g. 90s, 30m, 6h or 2d")
    return int(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
