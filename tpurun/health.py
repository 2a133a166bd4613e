"""`tpurun doctor`'s judgement: what one worker's probe (tpurun.worker.probe, mode `doctor`) means, as checks.

Every check is pass, warn or fail; every fail (and most warns) carries one fix, a command where one
exists. Pure functions over the probe's answer (a `tpurun.worker.probe.DoctorAnswer`), unit-tested in
tests/unit/test_stale_unit.py; tpurun.diagnose runs the probes, and the CLI (tpurun.cli.health) renders the rows.

Thresholds (docs/troubleshooting.md): free disk in home and /tmp warns below 10 GiB and fails below
1 GiB; a worker's clock warns when it is more than 1 s off the client's (after correcting for half
the round trip) and fails beyond 300 s (Google credentials and TLS start failing there).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tpurun.worker.probe import DoctorAnswer, Holder

if TYPE_CHECKING:
    from tpurun.job.preflight import Skew

GIB = 1 << 30
DISK_WARN = 10 * GIB
DISK_FAIL = 1 * GIB
CLOCK_WARN = 1.0
CLOCK_FAIL = 300.0
PJRT_DEVICES = ("TPU", "CPU", "CUDA", "GPU", "ROCM", "XPU", "NEURON")


@dataclass
class Check:
    worker: int
    name: str
    status: str  # "pass" | "warn" | "fail"
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def version_tuple(version: str | None) -> tuple[int, ...]:
    """'2.9.0+cpu' -> (2, 9, 0); '' or None -> ()."""
    if not version:
        return ()
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group()))
    return tuple(parts)


def major_minor(version: str | None) -> str:
    return ".".join(str(x) for x in version_tuple(version)[:2])


def _pip(python: str, spec: str) -> str:
    return f"`{python} -m pip install {spec}` on the worker (or `tpurun exec -- {python} -m pip install {spec}`)"


def check_versions(worker: int, answer: DoctorAnswer, python: str) -> Check:
    """Python present; torch and torch_xla installed for it, with the same major.minor (the torch_xla
    wheel declares no torch dependency, so pip never enforces the pairing)."""
    p = answer.python_probe
    if p.error:
        return Check(worker, "python", "fail", p.error, "install Python 3 there, or pass --python PATH")
    torch, xla = p.torch_version, p.torch_xla_version
    head = f"python {p.python_version or '?'} ({p.python or python})"
    if not torch and not xla:
        return Check(
            worker,
            "torch_xla",
            "fail",
            f"{head}: neither torch nor torch_xla is installed",
            "install the pair: " + _pip(python, "torch==2.9.0 'torch_xla[tpu]==2.9.0'") + ", or pass --python PATH",
        )
    if not xla:
        mm = major_minor(torch)
        return Check(
            worker,
            "torch_xla",
            "fail",
            f"{head}: torch {torch} but torch_xla is not installed",
            "install the matching torch_xla: " + _pip(python, f"'torch_xla[tpu]=={mm}.*'") + ", or pass --python PATH",
        )
    if not torch:
        mm = major_minor(xla)
        return Check(
            worker,
            "torch_xla",
            "fail",
            f"{head}: torch_xla {xla} but torch is not installed",
            "install the matching torch: " + _pip(python, f"'torch=={mm}.*'"),
        )
    if major_minor(torch) != major_minor(xla):
        return Check(
            worker,
            "torch_xla",
            "fail",
            f"{head}: torch {torch} and torch_xla {xla} do not match (they must share major.minor)",
            "install the torch_xla that matches torch: " + _pip(python, f"'torch_xla[tpu]=={major_minor(torch)}.*'"),
        )
    return Check(worker, "torch_xla", "pass", f"{head}, torch {torch}, torch_xla {xla}")


def check_same_versions(skew: Skew, names: dict[int, str]) -> list[Check]:
    """Every worker (index -> name) has what the most workers have: the same Python and decisive packages
    (a pod runs one program everywhere). SKEW says who differs (preflight.compare, as `train` refuses it)."""
    if not skew:
        return [Check(w, "same versions", "pass", "same python and packages as the other workers") for w in names]
    out = []
    for w, name in names.items():
        diffs = [
            f"{what} {version} (others: {common})"
            for what, version, holders, common in skew.odd_ones()
            if name in holders
        ]
        if not diffs:
            out.append(Check(w, "same versions", "pass", "the most common versions of every package"))
            continue
        out.append(
            Check(
                w,
                "same versions",
                "fail",
                "differs from the other workers: " + ", ".join(diffs),
                "install the versions the other workers have (the table below lists who has what)",
            )
        )
    return out


def _tpu_ready(answer: DoctorAnswer) -> bool:
    return bool(answer.python_probe.libtpu_installed) and bool(answer.devices_present)


def check_libtpu(worker: int, answer: DoctorAnswer, python: str) -> Check:
    p = answer.python_probe
    if p.error:
        return Check(worker, "libtpu", "warn", "not checked: the python probe failed", "see the python row")
    if not answer.devices_present:
        return Check(worker, "libtpu", "pass", "not needed: no TPU device files here (CPU runtime only)")
    if p.libtpu_installed:
        return Check(worker, "libtpu", "pass", f"found: {p.libtpu_path}")
    xla = p.torch_xla_version or "2.9.0"
    install = "install it with torch_xla's tpu extra: " + _pip(python, f"'torch_xla[tpu]=={xla}'")
    if _emulated(answer):
        return Check(
            worker,
            "libtpu",
            "warn",
            "an emulated worker (plain device files): no chip, no libtpu; train here with --runtime cpu",
            f"on a real TPU VM a missing libtpu fails TPU jobs: `{python} -m pip install 'torch_xla[tpu]=={xla}'`",
        )
    return Check(
        worker,
        "libtpu",
        "fail",
        f"libtpu not found for {python}: PJRT cannot open the TPU ('No TPU devices were found')",
        install,
    )


def check_runtime_place(worker: int, answer: DoctorAnswer) -> Check:
    """Whether torch_xla and jax will find the slice this worker is in: on a VM with TPU devices, `import
    torch_xla` reads it from the metadata's `tpu-env` unless the process is given TPU_SKIP_MDS_QUERY and the
    variables it reads instead (tpurun gives them where the VM's metadata lacks it: Compute Engine's)."""
    place = answer.runtime_place
    given = place.given
    if not answer.devices_present:
        return Check(worker, "slice place", "pass", "not needed: no TPU device files here")
    if given.get("TPU_SKIP_MDS_QUERY"):
        where = f"worker {given.get('TPU_WORKER_ID')} of {given.get('TPU_ACCELERATOR_TYPE')}"
        return Check(worker, "slice place", "pass", f"given by tpurun to every process it starts: {where}")
    status = place.tpu_env
    if status == 200:
        return Check(worker, "slice place", "pass", "the VM's metadata describes its slice (tpu-env)")
    why = "no metadata server answered" if status is None else f"its metadata has no tpu-env (HTTP {status})"
    return Check(
        worker,
        "slice place",
        "fail",
        f"torch_xla and jax cannot learn this VM's slice: {why}",
        "run through tpurun (train, exec), which gives the runtimes the slice; by hand export TPU_SKIP_MDS_QUERY=1, "
        "TPU_ACCELERATOR_TYPE, TPU_WORKER_ID and TPU_WORKER_HOSTNAMES",
    )


def _emulated(answer: DoctorAnswer) -> bool:
    present = answer.devices_present
    return bool(present) and set(answer.devices_plain) == set(present)


def _describe(h: Holder) -> str:
    cmd = h.command if len(h.command) <= 60 else h.command[:57] + "..."
    return f"pid {h.pid} holds {' '.join(h.holds)} ({h.user}: {cmd})"


def check_devices(worker: int, answer: DoctorAnswer, *, named_tpu: bool, kill_stale_cmd: str) -> list[Check]:
    """Device files present (those of the generation, for a named TPU), free, and no stale lock file."""
    out = []
    present, missing, holders = answer.devices_present, answer.devices_missing, answer.holders
    if missing:
        out.append(
            Check(
                worker,
                "devices",
                "fail",
                "device files missing: " + " ".join(missing),
                "the TPU driver did not come up on this worker: restart it (`tpurun stop`/`start` a single host) "
                "or recreate the slice",
            )
        )
    elif not present:
        status = "fail" if named_tpu else "warn"
        out.append(
            Check(
                worker,
                "devices",
                status,
                "no TPU device files (/dev/accel*, /dev/vfio/*): only --runtime cpu works",
                "run on a TPU VM (`tpurun create`), or use --runtime cpu here",
            )
        )
    elif holders:
        shown = "; ".join(_describe(h) for h in holders[:3]) + (
            f"; +{len(holders) - 3} more" if len(holders) > 3 else ""
        )
        out.append(
            Check(
                worker,
                "devices",
                "fail",
                f"the TPU is in use: {shown}",
                f"if that is a stale run, `{kill_stale_cmd}` frees it (--dry-run first to see what it would stop)",
            )
        )
    else:
        plain = " (plain files: an emulated TPU, no chip behind them)" if _emulated(answer) else ""
        out.append(Check(worker, "devices", "pass", f"{len(present)} device files present, none in use{plain}"))
    if answer.scan_note:
        out.append(
            Check(worker, "devices", "warn", answer.scan_note, "run as root or allow passwordless sudo (sudo -n)")
        )
    stale = [lk.path for lk in answer.locks if not lk.open_in]
    if stale and not holders:
        out.append(
            Check(
                worker,
                "lock files",
                "warn",
                "stale libtpu lock file: "
                + " ".join(stale)
                + " (libtpu: 'The TPU is already in use or the lock file is stale')",
                f"`{kill_stale_cmd}` removes it when nothing holds the TPU",
            )
        )
    return out


def xla_settings(answer: DoctorAnswer) -> list[tuple[str, str, str]]:
    """(name, value, where) of every XLA variable in the probe's environment and in the user's shell files."""
    found = [(k, str(v), "the environment of a tpurun command") for k, v in answer.env.items()]
    for e in answer.env_files:
        found.append((e.name, e.value, f"{e.file}:{e.line}"))
    return found


def _unset_fix(where: str, name: str) -> str:
    if ":" in where and not where.startswith("the "):
        return f"delete the {name} line at {where}"
    return f"unset {name} where tpurun runs"


def check_xla_config(worker: int, answer: DoctorAnswer) -> list[Check]:
    """XRT_TPU_CONFIG / PJRT_DEVICE set in a way that cannot work (the seeds' 'Missing XLA configuration')."""
    p = answer.python_probe
    xla = p.torch_xla_version if not p.error else None
    v = version_tuple(xla)
    xrt_only_build = bool(xla and "+xrt" in xla)
    found = xla_settings(answer)
    xrt = [s for s in found if s[0].startswith("XRT_")]
    pjrt = [s for s in found if s[0] == "PJRT_DEVICE"]
    out: list[Check] = []
    if xrt and v and v >= (2, 1) and not xrt_only_build:
        name, value, where = xrt[0]
        out.append(
            Check(
                worker,
                "xla config",
                "fail",
                f"{name}={value} is set ({where}) but torch_xla {xla} has no XRT runtime (removed after 2.0); "
                "it keeps PJRT from picking the TPU ('Missing XLA configuration', 'No TPU devices were found')",
                _unset_fix(where, name) + "; PJRT needs only PJRT_DEVICE=TPU, which `tpurun train` sets",
            )
        )
    elif xrt and pjrt:
        out.append(
            Check(
                worker,
                "xla config",
                "fail",
                f"both {xrt[0][0]} ({xrt[0][2]}) and PJRT_DEVICE ({pjrt[0][2]}) are set: they select two runtimes",
                "keep PJRT_DEVICE for torch_xla ≥ 2.1, XRT_TPU_CONFIG for ≤ 2.0; "
                + _unset_fix(pjrt[0][2], "the other"),
            )
        )
    for name, value, where in pjrt:
        if value.upper() not in PJRT_DEVICES:
            out.append(
                Check(
                    worker,
                    "xla config",
                    "fail",
                    f"PJRT_DEVICE={value} ({where}) is not a PJRT device",
                    f"use PJRT_DEVICE=TPU or CPU, or {_unset_fix(where, name)}",
                )
            )
        elif value.upper() == "TPU" and not _tpu_ready(answer):
            why = "no TPU device files" if not answer.devices_present else "libtpu is not installed"
            out.append(
                Check(
                    worker,
                    "xla config",
                    "fail",
                    f"PJRT_DEVICE=TPU ({where}) but {why}: torch_xla will fail ('No TPU devices were found')",
                    "install torch_xla[tpu] on a TPU VM, or use PJRT_DEVICE=CPU / --runtime cpu here",
                )
            )
    if not xrt and not pjrt and v and v < (2, 0) and answer.devices_present:
        out.append(
            Check(
                worker,
                "xla config",
                "warn",
                f"torch_xla {xla} (XRT) with no XRT_TPU_CONFIG: a plain `python` run fails with "
                "'Missing XLA configuration'",
                "run through `tpurun train` (it sets XRT_TPU_CONFIG), or export "
                'XRT_TPU_CONFIG="localservice;0;localhost:51011"',
            )
        )
    if not out:
        shown = ", ".join(f"{n}={val} ({w})" for n, val, w in found) or "none set"
        out.append(Check(worker, "xla config", "pass", f"XLA variables: {shown}"))
    return out


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def check_disk(worker: int, answer: DoctorAnswer) -> list[Check]:
    out = []
    for label, (path, free) in sorted(answer.disk.items()):
        name = f"disk {label}"
        if free is None:
            out.append(Check(worker, name, "warn", f"cannot stat {path}"))
        elif free < DISK_FAIL:
            out.append(
                Check(
                    worker,
                    name,
                    "fail",
                    f"{path}: only {_gib(free)} free (< {_gib(DISK_FAIL)})",
                    f"free space in {path}: old checkpoints, ~/.cache/pip, `tpurun exec -- du -sh {path}/*`",
                )
            )
        elif free < DISK_WARN:
            out.append(
                Check(worker, name, "warn", f"{path}: {_gib(free)} free (< {_gib(DISK_WARN)})", f"free space in {path}")
            )
        else:
            out.append(Check(worker, name, "pass", f"{path}: {_gib(free)} free"))
    return out


def clock_offset(t0: float, t1: float, worker_clock: float, elapsed: float) -> tuple[float, float]:
    """(worker clock - client clock, ± uncertainty) from one exchange: the client sent at T0 and got the
    answer at T1 (its clock); the worker read WORKER_CLOCK first thing and answered ELAPSED later.
    Like NTP: the two one-way trips are taken as equal, so the error is at most half the round trip."""
    rtt = max(0.0, (t1 - t0) - elapsed)
    return worker_clock - (t0 + rtt / 2), rtt / 2


def check_clock(worker: int, offset: float | None, uncertainty: float = 0.0) -> Check:
    if offset is None:
        return Check(worker, "clock", "pass", "this machine's own clock")
    text = f"{offset:+.3f} s vs this machine (±{uncertainty:.3f} s)"
    if abs(offset) - uncertainty > CLOCK_FAIL:
        return Check(worker, "clock", "fail", text, "sync the worker's clock: `sudo systemctl restart chrony`")
    if abs(offset) - uncertainty > CLOCK_WARN:
        return Check(worker, "clock", "warn", text, "sync the worker's clock: `sudo systemctl restart chrony`")
    return Check(worker, "clock", "pass", text)


def check_ssh(worker: int, error: str | None, detail: str = "") -> Check:
    if error:
        return Check(worker, "ssh", "fail", error, "`tpurun attach NAME` re-pins host keys and installs tpurun's key")
    return Check(worker, "ssh", "pass", detail or "reachable, host key pinned")


def check_startup(worker: int, report: Any, log_cmd: str) -> Check:
    """REPORT: a tpurun.cloud.startup.StartupReport (None: the API could not be asked)."""
    from tpurun.cloud.startup import StartupStatus

    if report is None:
        return Check(worker, "startup script", "warn", "could not read the guest attributes")
    if report.status is StartupStatus.DONE:
        took = f" in {report.duration:.0f} s" if report.duration is not None else ""
        return Check(worker, "startup script", "pass", f"finished{took}")
    if report.status is StartupStatus.FAILED:
        tail = report.tail.strip().splitlines()[-1:] if report.tail else []
        return Check(
            worker,
            "startup script",
            "fail",
            f"failed with exit code {report.exit_code} in step '{report.step}'" + (f": {tail[0]}" if tail else ""),
            f"read its log: `{log_cmd}`; fix the script, then `tpurun stop`/`start` (or recreate) to rerun it",
        )
    if report.status is StartupStatus.RUNNING:
        return Check(worker, "startup script", "warn", f"still running (step '{report.step}')", f"wait, or `{log_cmd}`")
    return Check(worker, "startup script", "warn", "no tpurun startup report (the node was not created by tpurun?)")


def worker_checks(
    worker: int, answer: DoctorAnswer, *, python: str, named_tpu: bool, kill_stale_cmd: str
) -> list[Check]:
    """Every per-worker check that depends only on that worker's probe's answer."""
    return [
        check_versions(worker, answer, python),
        check_libtpu(worker, answer, python),
        check_runtime_place(worker, answer),
        *check_devices(worker, answer, named_tpu=named_tpu, kill_stale_cmd=kill_stale_cmd),
        *check_xla_config(worker, answer),
        *check_disk(worker, answer),
    ]


def summary(checks: list[Check]) -> dict[str, int]:
    c = Counter(ch.status for ch in checks)
    return {"pass": c["pass"], "warn": c["warn"], "fail": c["fail"]}
