"""Cloud TPU resource names: checked locally, before anything reaches the API."""

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
