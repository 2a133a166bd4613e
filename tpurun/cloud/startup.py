"""Composing the startup script every worker runs at every boot, and reading what it reported.

The user's script, `--setup` commands, the `--code` archive and `--data` downloads are wrapped in
one bash script that logs to a known file and reports status, exit code, duration and the tail of a
failure to guest attributes (namespace `tpurun`), which `create` polls. Pure functions: the script is
text, the report is parsed from a dict.
"""

from __future__ import annotations

import base64
import io
import re
import tarfile
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from tpurun import ignore
from tpurun.errors import UsageError

NAMESPACE = "tpurun"
LOG_PATH = "/tmp/tpurun-startup.log"  # per worker (each has its own /tmp); rewritten at every boot
USER_SCRIPT_KEY = "tpurun-user-script"
SETUP_KEY = "tpurun-setup"
CODE_KEY = "tpurun-code"
DATA_KEY = "tpurun-data"
WATCHDOG_KEY = "tpurun-watchdog"  # the worker bundle, whose watchdog.py the wrapper starts (cloud/autostop.py)
DEFAULT_CODE_DEST = "/tmp/tpurun/code"
# Compute Engine's metadata limits: one value at most 256 KiB, all metadata together under 512 KB
MAX_VALUE = 256 * 1024
MAX_TOTAL = 512 * 1000


@dataclass(frozen=True)
class DataItem:
    url: str
    dest: str
    sha256: str | None = None


def parse_data_item(spec: str) -> DataItem:
    """URL[#sha256=HEX]=DEST, URL being http(s):// or gs://."""
    m = re.match(r"^(?P<url>(?:https?|gs)://[^=\s]+?)(?:#sha256=(?P<sha>[0-9a-fA-F]{64}))?=(?P<dest>/.+)$", spec)
    if not m:
        raise UsageError(
            f"bad --data '{spec}': expected URL=DEST with an http(s):// or gs:// URL and an absolute DEST, "
            "optionally URL#sha256=HEX=DEST"
        )
    return DataItem(m.group("url"), m.group("dest"), (m.group("sha") or "").lower() or None)


def pack_code(directory: Path, dest: str) -> str:
    """DIRECTORY (honouring ignore files) as a base64 tar.gz for metadata, or UsageError if too big."""
    if not directory.is_dir():
        raise UsageError(f"--code {directory}: not a directory")
    if not re.match(r"^/[A-Za-z0-9._/-]+$", dest):
        raise UsageError(f"--code destination '{dest}' must be an absolute path of letters, digits, '.', '_', '-', '/'")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=9) as tar:
        for rel in ignore.walk(directory):
            tar.add(directory / rel, arcname=str(rel), recursive=False)
    encoded = base64.b64encode(buf.getvalue()).decode()
    if len(encoded) > MAX_VALUE - 1024:
        raise UsageError(
            f"--code {directory} packs to {len(encoded) // 1024} KiB, over the {MAX_VALUE // 1024} KiB a metadata "
            "value may hold",
            hint=f"copy it after create with `tpurun sync {directory}` instead, or add ignore rules to .tpurunignore",
        )
    return f"{dest}\n{encoded}"


def compose_metadata(
    *,
    user_script: str | None,
    setup: list[str],
    code: str | None,
    data: list[DataItem],
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """Metadata entries carrying the startup wrapper and its inputs (and EXTRA: the watchdog's, which the
    wrapper starts if WATCHDOG_KEY is there), checked against the metadata limits."""
    md = {"startup-script": wrapper_script(), **(extra or {})}
    if user_script:
        md[USER_SCRIPT_KEY] = user_script
    if setup:
        md[SETUP_KEY] = "\n".join(setup) + "\n"
    if code:
        md[CODE_KEY] = code
    if data:
        md[DATA_KEY] = "\n".join(f"{d.url}\t{d.dest}\t{d.sha256 or ''}" for d in data) + "\n"
    check_limits(md)
    return md


def check_limits(md: dict[str, str]) -> None:
    """UsageError if MD breaks Compute Engine's metadata limits."""
    for key, value in md.items():
        if len(value.encode()) > MAX_VALUE:
            raise UsageError(f"metadata '{key}' would be {len(value.encode()) // 1024} KiB, over the 256 KiB limit")
    total = sum(len(k) + len(v.encode()) for k, v in md.items())
    if total > MAX_TOTAL:
        raise UsageError(
            f"the startup metadata would total {total // 1000} KB, over the 512 KB limit",
            hint="move code to `tpurun sync` and data to --data URLs",
        )


def wrapper_script() -> str:
    """The bash program that runs at every boot on every worker (as root)."""
    return _WRAPPER.replace("@NS@", NAMESPACE).replace("@LOG@", LOG_PATH)


_WRAPPER = (
    r"""#!/bin/bash
# tpurun startup wrapper: runs at every boot on every worker; reports to guest attributes (@NS@/*).
LOG=@LOG@
MD="http://${GCE_METADATA_HOST:-metadata.google.internal}/computeMetadata/v1"
WORK=/run/tpurun/startup  # root's only: what runs as root is never read from a place users can write
mkdir -p -m 0700 /run/tpurun && mkdir -p -m 0700 "$WORK"; : > "$LOG"
md()  { curl -sf -m 10 -H 'Metadata-Flavor: Google' "$MD/instance/attributes/$1"; }
ga()  { curl -sf -m 10 -X PUT -H 'Metadata-Flavor: Google' --data-binary "$2" \
          "$MD/instance/guest-attributes/@NS@/$1" >/dev/null || echo "tpurun: could not report $1" >>"$LOG"; }
RUN_ID=$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')
START=$(date +%s)
ga startup-run "$RUN_ID"
ga startup-status @RUNNING@
ga startup-step boot

run_steps() {
  if md @CODE_KEY@ > "$WORK/code" 2>/dev/null; then
    ga startup-step code
    dest=$(head -n 1 "$WORK/code")
    mkdir -p "$dest" && tail -n +2 "$WORK/code" | base64 -d | tar -xz -C "$dest" || { echo "tpurun: unpacking the code into $dest failed"; return 20; }
    chmod -R a+rX "$dest"
    echo "tpurun: code unpacked into $dest"
  fi
  if md @DATA_KEY@ > "$WORK/data" 2>/dev/null; then
    ga startup-step data
    i=0
    while IFS=$'\t' read -r url dest sha; do
      [ -n "$url" ] || continue
      mkdir -p "$(dirname "$dest")"
      ok=1
      for attempt in 1 2 3 4 5; do
        case "$url" in
          gs://*) if command -v gcloud >/dev/null; then gcloud storage cp "$url" "$dest.part"; else gsutil cp "$url" "$dest.part"; fi ;;
          *) curl -fsSL --retry 3 -o "$dest.part" "$url" ;;
        esac && { ok=0; break; }
        echo "tpurun: download of $url failed (attempt $attempt)"; sleep $attempt
      done
      if [ $ok -ne 0 ]; then ga "data-$i" "failed: download $url"; rm -f "$dest.part"; return 21; fi
      if [ -n "$sha" ] && [ "$(sha256sum "$dest.part" | cut -d' ' -f1)" != "$sha" ]; then
        ga "data-$i" "failed: sha256 mismatch for $url"; echo "tpurun: sha256 of $url does not match"; rm -f "$dest.part"; return 22
      fi
      mv -f "$dest.part" "$dest"; ga "data-$i" "ok: $url -> $dest"; echo "tpurun: $url -> $dest"
      i=$((i+1))
    done < "$WORK/data"
  fi
  if md @SETUP_KEY@ > "$WORK/setup.sh" 2>/dev/null; then
    ga startup-step setup
    bash -e "$WORK/setup.sh" || return $?
  fi
  if md @USER_KEY@ > "$WORK/user-script" 2>/dev/null; then
    ga startup-step user-script
    chmod 700 "$WORK/user-script"
    if head -c 2 "$WORK/user-script" | grep -q '^#!'; then "$WORK/user-script"; else bash "$WORK/user-script"; fi || return $?
  fi
  return 0
}

run_steps >>"$LOG" 2>&1 </dev/null
RC=$?
ga startup-exit-code "$RC"
ga startup-duration "$(( $(date +%s) - START ))"
if [ "$RC" -ne 0 ]; then
  ga startup-tail "$(tail -n 20 "$LOG")"
  ga startup-status @FAILED@
else
  ga startup-status @DONE@
fi
# The TPU's watchdog (autostop, train --down), once the steps are done, whatever they did.
if md @WATCHDOG_KEY@ > "$WORK/watchdog" 2>/dev/null; then
  rm -rf "$WORK/watchdog.d"; mkdir -p "$WORK/watchdog.d"
  { base64 -d "$WORK/watchdog" | tar -xz -C "$WORK/watchdog.d" && python3 "$WORK/watchdog.d/watchdog.py" ensure; } \
    >>"$LOG" 2>&1 || echo "tpurun: the watchdog did not start" >>"$LOG"
fi
exit "$RC"
""".replace("@CODE_KEY@", CODE_KEY)
    .replace("@DATA_KEY@", DATA_KEY)
    .replace("@SETUP_KEY@", SETUP_KEY)
    .replace("@USER_KEY@", USER_SCRIPT_KEY)
    .replace("@WATCHDOG_KEY@", WATCHDOG_KEY)
)


class StartupStatus(str, Enum):
    """How far a worker's startup wrapper has come, as it reports it (guest attribute `startup-status`)."""

    PENDING = "pending"  # nothing reported yet
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


_WRAPPER = _WRAPPER.replace("@RUNNING@", StartupStatus.RUNNING).replace("@FAILED@", StartupStatus.FAILED)
_WRAPPER = _WRAPPER.replace("@DONE@", StartupStatus.DONE)


@dataclass(frozen=True)
class StartupReport:
    """What one worker's startup wrapper reported."""

    status: StartupStatus
    run_id: str = ""
    step: str = ""
    exit_code: int | None = None
    duration: float | None = None
    tail: str = ""
    data: dict[str, str] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.status in (StartupStatus.DONE, StartupStatus.FAILED)


def _status(word: str) -> StartupStatus:
    try:
        return StartupStatus(word)
    except ValueError:  # nothing yet (or a word of no wrapper's)
        return StartupStatus.PENDING


def parse_report(attrs: dict[tuple[str, str], str]) -> StartupReport:
    def get(key: str) -> str:
        return attrs.get((NAMESPACE, key), "")

    code = get("startup-exit-code")
    duration = get("startup-duration")
    return StartupReport(
        status=_status(get("startup-status")),
        run_id=get("startup-run"),
        step=get("startup-step"),
        exit_code=int(code) if code.lstrip("-").isdigit() else None,
        duration=float(duration) if duration.replace(".", "", 1).isdigit() else None,
        tail=get("startup-tail"),
        data={k: v for (ns, k), v in attrs.items() if ns == NAMESPACE and k.startswith("data-")},
    )
