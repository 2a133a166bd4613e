"""The worker-side program of `tpurun kill-stale` and `tpurun doctor` (stdlib only, Python ≥ 3.8).

tpurun ships this file's source on the command line (`python3 -c SOURCE MODE CONFIG_JSON`, see `program_argv`),
so a worker needs nothing installed (the watchdog imports it too, and holds its imports for days: a few are made
where needed). It prints its answer, a record of this file (`KillStaleAnswer`, `DoctorAnswer`, `Scan`), as one
JSON document on stdout; tpurun reads it back with the record's `from_dict`. Nothing else spells their keys.

Modes:
- `kill-stale`: find the processes that hold the TPU -- an open fd on a device file (`/dev/accel*`, `/dev/vfio/*`,
  read with readlink from /proc/PID/fd: no lsof needed), a mapping of a `libtpu*.so` (/proc/PID/maps), or an open
  fd on a claim file (`claim_files`: where a `train` about to start holds the worker) -- never this program or its
  ancestors, never pid 1. Unless dry-run: SIGTERM, the grace, SIGKILL, verify; stale libtpu locks then removed.
- `doctor`: all `tpurun doctor` judges on a worker: the holder scan, device files, the versions the user's python
  sees (a `PythonProbe`), XLA variables in the environment and shell files, free disk, the clock.

Other users' /proc/PID/fd and maps are unreadable to a non-root user: the scan is re-run under `sudo -n` (never
prompting), else the answer says how many processes could not be inspected (tests/unit/test_stale_unit.py).
"""

from __future__ import annotations

import collections
import copy
import fnmatch
import glob
import json
import os
import pwd
import re
import shlex
import signal
import sys
import time
from collections.abc import Callable

TYPE_CHECKING = False  # typing would cost each watchdog 1.8 MiB
if TYPE_CHECKING:
    from typing import Any

DEFAULT_DEVICE_GLOBS = ["/dev/accel*", "/dev/vfio/*"]
DEFAULT_LIBTPU_GLOB = "libtpu*.so"
# libtpu's lock files (docs/troubleshooting.md); "~" is the login user's home, expanded by the caller's side.
DEFAULT_LOCK_GLOBS = ["/tmp/libtpu_lockfile", "/tmp/libtpu_lock_*/libtpu_lockfile", "~/.libtpu_lockfile"]
# Where users export XLA variables that an interactive `tpurun ssh` session (and their own shells) see.
ENV_FILES = ["/etc/environment", "~/.bashrc", "~/.profile", "~/.bash_profile", "~/.zshrc", "/etc/profile.d/*.sh"]
XLA_VARS = ("XRT_TPU_CONFIG", "PJRT_DEVICE", "TPU_NUM_DEVICES", "XRT_DEVICE_MAP", "XRT_WORKERS")


# ------------------------------------------------------------------ the answers, as records


class Record:
    """A record of the probe's answers (this file cannot import protocol.py's: it travels alone): its fields
    are its __slots__, in the order its JSON has them, each typed by its annotation; a field not given is a
    copy of its _DEFAULTS value, else None."""

    __slots__: tuple[str, ...] = ()
    _DEFAULTS: dict[str, Any] = {}
    _OMIT_NONE: tuple[str, ...] = ()  # fields the JSON leaves out while None
    _READ: dict[str, Callable[[Any], Any]] = {}  # field -> how its JSON value is read

    def __init__(self, **fields: Any) -> None:
        for name in self.__slots__:
            setattr(self, name, fields.pop(name) if name in fields else copy.deepcopy(self._DEFAULTS.get(name)))
        if fields:
            raise TypeError(f"{type(self).__name__} has no field {sorted(fields)[0]!r}")

    def to_dict(self) -> dict[str, Any]:
        """The record as the probe prints it (JSON types only)."""
        omit = self._OMIT_NONE
        return {f: _plain(getattr(self, f)) for f in self.__slots__ if not (f in omit and getattr(self, f) is None)}

    @classmethod
    def from_dict(cls, data: Any) -> Any:
        """The record a `to_dict` printed, or ValueError."""
        if not isinstance(data, dict) or set(data) - set(cls.__slots__):
            raise ValueError(f"not a {cls.__name__}: {data!r}"[:300])
        try:
            return cls(**{k: cls._READ[k](v) if k in cls._READ else v for k, v in data.items()})
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"not a {cls.__name__}: {exc}") from exc


def _plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _list_of(cls: Any) -> Callable[[Any], list[Any]]:
    return lambda items: [cls.from_dict(item) for item in items]


class Holder(Record):
    """A process holding the TPU; START (its start in ticks since boot, the worker's own) tells it from a reused pid."""

    __slots__ = ("pid", "uid", "user", "age", "start", "command", "holds", "protected", "result")
    _DEFAULTS = {"holds": [], "protected": False}
    _OMIT_NONE = ("start", "result")
    pid: int
    uid: int | None
    user: str
    age: float
    start: int | None
    command: str
    holds: list[str]
    protected: bool  # pid 1: never signalled
    result: str | None  # what kill-stale did to it


class Scan(Record):
    """What holds the TPU: the holders, the pids that could not be inspected, who has each lock file open."""

    __slots__ = ("holders", "denied", "lock_users")
    _DEFAULTS = {"holders": [], "denied": [], "lock_users": {}}
    _READ = {"holders": _list_of(Holder)}
    holders: list[Holder]
    denied: list[int]
    lock_users: dict[str, list[int]]


class LockFile(Record):
    """A libtpu lock file: what kill-stale did to it (RESULT), or who has it open (OPEN_IN, doctor's; none: stale)."""

    __slots__ = ("path", "result", "open_in")
    _OMIT_NONE = ("result", "open_in")
    path: str
    result: str | None
    open_in: list[int] | None


class KillStaleAnswer(Record):
    """`kill-stale` on one worker: what held its TPU and what became of it, its lock files, whether it is free."""

    __slots__ = ("root", "sudo", "errors", "holders", "locks", "denied", "free", "survivors")
    _DEFAULTS = {"root": False, "sudo": False, "errors": [], "holders": [], "locks": [], "denied": 0, "free": False}
    _READ = {"holders": _list_of(Holder), "locks": _list_of(LockFile)}
    root: bool
    sudo: bool  # run again under sudo -n to see other users' processes
    errors: list[str]
    holders: list[Holder]
    locks: list[LockFile]
    denied: int  # processes that could not be inspected
    free: bool
    survivors: list[int]  # pids still holding it


class EnvExport(Record):
    """An XLA variable set in a shell file (FILE shown with ~ for the home), at LINE."""

    __slots__ = ("file", "line", "name", "value")
    file: str
    line: int
    name: str
    value: str


class RuntimePlace(Record):
    """What tpurun GIVES its processes here of their place in the slice; TPU_ENV the metadata's answer's status."""

    __slots__ = ("given", "tpu_env")
    _DEFAULTS = {"given": {}}
    given: dict[str, str]
    tpu_env: int | None


DiskSpace = collections.namedtuple("DiskSpace", ["path", "free"])  # free: bytes, or None (cannot stat it)


class PythonProbe(Record):
    """What a Python sees, env_contract.PROBE_SCRIPT's answer run with it (for `--runtime auto`, and doctor): libtpu,
    TPU device files, versions (None: not installed), the decisive PACKAGES'; or ERROR alone, why it did not run."""

    __slots__: tuple[str, ...] = ("libtpu_installed", "libtpu_path", "device_files_present", "device_files")
    __slots__ += ("torch_xla_version", "torch_tpu_version", "torch_version", "python", "python_version", "packages")
    __slots__ += ("error",)
    libtpu_installed: bool | None
    libtpu_path: str | None
    device_files_present: bool | None
    device_files: list[str] | None
    torch_xla_version: str | None
    torch_tpu_version: str | None
    torch_version: str | None
    python: str | None
    python_version: str | None
    packages: dict[str, str | None] | None
    error: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"error": self.error} if self.error is not None else {f: getattr(self, f) for f in self.__slots__[:-1]}


class DoctorAnswer(Record):
    """`doctor` on one worker, all tpurun.health judges: PYTHON_PROBE what the user's Python sees; CLOCK the
    worker's clock first thing, ELAPSED until the answer."""

    __slots__: tuple[str, ...] = ("clock", "hostname", "user", "root", "python_probe", "runtime_place")
    __slots__ += ("devices_present", "devices_missing", "devices_plain", "holders", "scan_note", "locks", "env")
    __slots__ += ("env_files", "disk", "elapsed")
    _DEFAULTS = {"root": False, "python_probe": PythonProbe(), "runtime_place": RuntimePlace(), "scan_note": ""}
    _DEFAULTS.update({f: [] for f in ("devices_present", "devices_missing", "devices_plain", "holders", "locks")})
    _DEFAULTS.update(env={}, env_files=[], disk={}, elapsed=0.0)
    _READ = dict(python_probe=PythonProbe.from_dict, runtime_place=RuntimePlace.from_dict, holders=_list_of(Holder))
    _READ.update(locks=_list_of(LockFile), env_files=_list_of(EnvExport))
    _READ.update(disk=lambda d: {k: DiskSpace(*v) for k, v in d.items()})
    clock: float
    hostname: str
    user: str
    root: bool
    python_probe: PythonProbe
    runtime_place: RuntimePlace
    devices_present: list[str]
    devices_missing: list[str]
    devices_plain: list[str]  # plain files: an emulated worker's, no chip behind them
    holders: list[Holder]
    scan_note: str
    locks: list[LockFile]
    env: dict[str, str]  # XLA variables in the probe's environment
    env_files: list[EnvExport]
    disk: dict[str, DiskSpace]  # "home", "tmp"
    elapsed: float


# ------------------------------------------------------------------ pure helpers (unit-tested)


def strip_deleted(path: str) -> str:
    """readlink and maps say 'PATH (deleted)' for a file removed while open; the path is what matters."""
    return path[: -len(" (deleted)")] if path.endswith(" (deleted)") else path


def matches_device(target: str, globs: list[str]) -> bool:
    target = strip_deleted(target)
    return any(fnmatch.fnmatchcase(target, g) for g in globs)


def matches_libtpu(path: str, pattern: str) -> bool:
    """PATTERN with a '/' is matched against the whole path, else against the file name."""
    path = strip_deleted(path)
    if "/" in pattern:
        return fnmatch.fnmatchcase(path, pattern)
    return fnmatch.fnmatchcase(os.path.basename(path), pattern)


def maps_paths(text: str) -> set[str]:
    """The file paths mapped in a /proc/PID/maps text (6th column onwards; may contain spaces)."""
    paths = set()
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            paths.add(strip_deleted(parts[5].strip()))
    return paths


def parse_stat(text: str) -> tuple[int, str, int]:
    """(ppid, state, starttime in clock ticks) from /proc/PID/stat (the comm field may hold ') ')."""
    rest = text[text.rindex(")") + 2 :].split()
    return int(rest[1]), rest[0], int(rest[19])


def parse_status_uid(text: str) -> int | None:
    for line in text.splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    return None


def format_cmdline(raw: bytes) -> str:
    raw = raw[:-1] if raw.endswith(b"\0") else raw  # one NUL ends each argument; "" is an argument too
    args = [a.decode("utf-8", "replace") for a in raw.split(b"\0")] if raw else []
    return " ".join(shlex.quote(a) if a else "''" for a in args)


_ENV_LINE = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def parse_env_exports(text: str, names: tuple[str, ...] = XLA_VARS) -> list[tuple[int, str, str]]:
    """(line number, name, value) for every `NAME=value` / `export NAME=value` of NAMES in a shell or
    /etc/environment file. Comments are skipped; the value is unquoted the way a shell would for the
    simple forms users write (`"..."`, `'...'`)."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        m = _ENV_LINE.match(stripped)
        if m and m.group(1) in names:
            value = m.group(2).split(" #", 1)[0].strip().rstrip(";")
            try:
                parts = shlex.split(value)
                value = parts[0] if parts else ""
            except ValueError:
                pass
            found.append((number, m.group(1), value))
    return found


def plan_signals(elapsed: float, grace: float, alive: list[int], termed: set[int]) -> tuple[list[int], list[int]]:
    """(pids to SIGTERM now, pids to SIGKILL now) for the kill loop: TERM every live holder once at the
    start, KILL whoever is still alive once the grace is over."""
    term = [p for p in alive if p not in termed]
    kill = [p for p in alive if p in termed] if elapsed >= grace else []
    return term, kill


# ------------------------------------------------------------------ /proc scanning


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def ancestors(pid: int) -> set[int]:
    """PID and every parent up to init: never signal ourselves, the shell, sshd or sudo above us."""
    seen = set()
    while pid > 0 and pid not in seen:
        seen.add(pid)
        try:
            pid = parse_stat(_read(f"/proc/{pid}/stat"))[0]
        except (OSError, ValueError, IndexError):
            break
    return seen


def _clock() -> tuple[float, int]:
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime, os.sysconf("SC_CLK_TCK")


def _user(uid: int | None) -> str:
    if uid is None:
        return "?"
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def find_holders(device_globs: list[str], libtpu_glob: str, lock_paths: list[str]) -> Scan:
    """Every process holding the TPU, the processes that could not be inspected, who has each lock file open.
    An empty LIBTPU_GLOB skips the mappings (the watchdog's cheaper look: open device files only)."""
    protected = ancestors(os.getpid())
    uptime, ticks = _clock()
    holders = []
    denied = []
    lock_users: dict[str, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in protected:
            continue
        holds: list[str] = []
        blocked = False
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = strip_deleted(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    continue
                if matches_device(target, device_globs) and target not in holds:
                    holds.append(target)
                if target in lock_paths:
                    lock_users.setdefault(target, []).append(pid)
        except PermissionError:
            blocked = True
        except OSError:
            continue  # gone meanwhile
        try:
            for path in sorted(maps_paths(_read(f"/proc/{pid}/maps"))) if libtpu_glob else []:
                if matches_libtpu(path, libtpu_glob) and path not in holds:
                    holds.append(path)
        except PermissionError:
            blocked = True
        except OSError:
            pass
        if blocked and not holds:
            denied.append(pid)
            continue
        if not holds:
            continue
        try:
            _, state, start = parse_stat(_read(f"/proc/{pid}/stat"))
            uid = parse_status_uid(_read(f"/proc/{pid}/status"))
            cmd = format_cmdline(_read_bytes(f"/proc/{pid}/cmdline"))
        except (OSError, ValueError, IndexError):
            continue
        if state == "Z":
            continue  # a zombie holds nothing any more
        age = round(max(0.0, uptime - start / ticks), 1)
        holder = Holder(pid=pid, uid=uid, user=_user(uid), age=age, start=start, command=cmd, holds=holds)
        holder.protected = pid == 1
        holders.append(holder)
    return Scan(holders=holders, denied=denied, lock_users=lock_users)


def _alive(pid: int, start: int) -> bool:
    """PID still runs and is still the same process (not a reused pid), and is not a zombie."""
    try:
        _, state, now_start = parse_stat(_read(f"/proc/{pid}/stat"))
    except (OSError, ValueError, IndexError):
        return False
    return now_start == start and state != "Z"


def _signal(pid: int, sig: int, errors: list[str]) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        errors.append(f"no permission to signal pid {pid} (run as root or allow passwordless sudo)")


def kill_holders(holders: list[Holder], grace: float) -> list[str]:
    """SIGTERM every holder, SIGKILL whoever is alive after GRACE; sets each holder's result."""
    errors: list[str] = []
    targets = {h.pid: h for h in holders if not h.protected}
    for h in holders:
        if h.protected:
            h.result = "kept (init)"
    termed: set[int] = set()
    killed: set[int] = set()
    started = time.monotonic()
    while True:
        alive = [p for p, h in targets.items() if _alive(p, h.start or 0)]
        for p, h in targets.items():
            if p not in alive and h.result is None:
                h.result = "killed (SIGKILL)" if p in killed else "terminated (SIGTERM)"
        if not alive:
            break
        elapsed = time.monotonic() - started
        term, kill = plan_signals(elapsed, grace, alive, termed)
        for p in term:
            _signal(p, signal.SIGTERM, errors)
            termed.add(p)
        for p in kill:
            if p not in killed:
                _signal(p, signal.SIGKILL, errors)
                killed.add(p)
        if elapsed > grace + 5:  # SIGKILL did not take: unkillable (D state) or not ours
            for p in alive:
                targets[p].result = "survived"
            break
        time.sleep(0.05)
    return errors


def lock_files(globs: list[str], home: str) -> list[str]:
    found = []
    for g in globs:
        g = home + g[1:] if g.startswith("~") else g
        found += sorted(p for p in glob.glob(g) if os.path.isfile(p))
    return found


def unlock(paths: list[str], lock_users: dict[str, list[int]], dry_run: bool) -> list[LockFile]:
    """Remove the lock files PATHS nobody has open (with DRY_RUN: say which would go)."""
    out = []
    for path in paths:
        users = lock_users.get(path)
        if users:
            result = "kept: open in pid " + ",".join(map(str, users))
        elif dry_run:
            result = "would remove"
        else:
            try:
                os.unlink(path)
                result = "removed"
            except FileNotFoundError:
                result = "removed"
            except OSError as exc:
                result = f"not removed: {exc.strerror}"
        out.append(LockFile(path=path, result=result))
    return out


# ------------------------------------------------------------------ running as root when needed


def own_source() -> str | None:
    """The -c program this process was started with (to re-run it under sudo)."""
    try:
        args = _read_bytes("/proc/self/cmdline").split(b"\0")
        return args[args.index(b"-c") + 1].decode()
    except (OSError, ValueError, IndexError):
        return None


def run_as_root(mode: str, cfg: dict) -> tuple[dict | None, str]:
    """Run MODE with CFG under `sudo -n` (never prompts): (its JSON result, or None and why not)."""
    import subprocess  # here: the watchdog never needs it

    source = own_source()
    if source is None:
        return None, "cannot re-run under sudo (program source not found)"
    cfg = dict(cfg, elevated=True)
    argv, wait = ["sudo", "-n", sys.executable, "-c", source, mode, json.dumps(cfg)], float(cfg.get("grace", 10)) + 120
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=wait)
    except FileNotFoundError:
        return None, "sudo is not installed"
    except subprocess.TimeoutExpired:
        return None, "sudo -n timed out"
    if proc.returncode != 0:
        why = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        return None, "sudo -n refused" + (f" ({why[-1]})" if why else "")
    try:
        return json.loads(proc.stdout.decode()), ""
    except ValueError:
        return None, "sudo -n run printed no result"


def _scan_cfg(cfg: dict) -> tuple[list[str], str, list[str]]:
    home = cfg.get("home") or os.path.expanduser("~")
    locks = lock_files(cfg.get("lock_globs") or DEFAULT_LOCK_GLOBS, home)
    return cfg.get("device_globs") or DEFAULT_DEVICE_GLOBS, cfg.get("libtpu_glob") or DEFAULT_LIBTPU_GLOB, locks


def free_tpu(cfg: dict) -> KillStaleAnswer:
    # the login user's home, fixed before any sudo re-run (sudo may change HOME)
    cfg = dict(cfg, home=cfg.get("home") or os.path.expanduser("~"))
    device_globs, libtpu_glob, locks = _scan_cfg(cfg)
    device_globs = device_globs + lock_files(cfg.get("claim_files") or [], cfg["home"])
    found = find_holders(device_globs, libtpu_glob, locks)
    answer = KillStaleAnswer(root=os.geteuid() == 0, sudo=bool(cfg.get("elevated")))
    if found.denied and os.geteuid() != 0 and not cfg.get("elevated"):
        elevated, why = run_as_root("kill-stale", cfg)
        if elevated is not None:
            return KillStaleAnswer.from_dict(elevated)
        answer.errors.append(
            f"cannot inspect {len(found.denied)} processes of other users: {why}; holders among them are not "
            "shown (run as root or allow passwordless sudo)"
        )
    holders = answer.holders = found.holders
    if cfg.get("dry_run"):
        for h in holders:
            h.result = "kept (init)" if h.protected else "would kill"
    else:
        answer.errors += kill_holders(holders, float(cfg.get("grace", 10)))
    # What is left now decides whether the lock files are stale (a new holder may have started).
    after = find_holders(device_globs, libtpu_glob, locks) if not cfg.get("dry_run") else found
    left = after.holders
    known = {h.pid for h in holders}
    for h in left:
        if h.pid not in known:
            h.result = "appeared during kill-stale"
            holders.append(h)
    if left and not cfg.get("dry_run"):
        answer.locks = [LockFile(path=p, result="kept: the TPU is still held") for p in locks]
    else:
        answer.locks = unlock(locks, after.lock_users, bool(cfg.get("dry_run")))
    for h in holders:
        h.start = None  # the worker's own (it tells a reused pid apart)
    answer.denied, answer.free, answer.survivors = len(after.denied), not left, [h.pid for h in left]
    return answer


# ------------------------------------------------------------------ doctor


def disk_free(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def env_file_exports(home: str) -> list[EnvExport]:
    found = []
    for pattern in ENV_FILES:
        pattern = home + pattern[1:] if pattern.startswith("~") else pattern
        for path in sorted(glob.glob(pattern)):
            try:
                text = _read(path)
            except OSError:
                continue
            shown = "~" + path[len(home) :] if home and path.startswith(home + "/") else path
            for line, name, value in parse_env_exports(text):
                found.append(EnvExport(file=shown, line=line, name=name, value=value))
    return found


def metadata_status(key: str) -> int | None:
    """The HTTP status of this VM's metadata server for instance attribute KEY, as the runtimes ask it
    (GCE_METADATA_IP, else metadata.google.internal); None when no metadata server answers."""
    import urllib.error
    import urllib.request

    host = os.environ.get("GCE_METADATA_IP") or "metadata.google.internal"
    url = f"http://{host}/computeMetadata/v1/instance/attributes/{key}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Metadata-Flavor": "Google"}), timeout=3) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


def runtime_place(given: dict, devices: list[str]) -> RuntimePlace:
    """Where the runtimes of a process tpurun starts here read the slice from: the variables tpurun GIVEN it
    (TPU_SKIP_MDS_QUERY and the rest), else, where there are TPU devices, the metadata's `tpu-env`."""
    asked = bool(devices) and not given.get("TPU_SKIP_MDS_QUERY")
    return RuntimePlace(given=given, tpu_env=metadata_status("tpu-env") if asked else None)


def run_python_probe(python: str, probe: str, env: dict | None = None) -> PythonProbe:
    """What PYTHON sees (PROBE, tpurun.job.env_contract.PROBE_SCRIPT, run with it, ENV's variables added)."""
    import subprocess  # here: the watchdog never needs it

    env = {**os.environ, **(env or {})}
    try:
        proc = subprocess.run([python, "-c", probe], stdin=subprocess.DEVNULL, capture_output=True, timeout=60, env=env)
    except FileNotFoundError:
        return PythonProbe(error=f"{python}: not found")
    except PermissionError:
        return PythonProbe(error=f"{python}: not executable")
    except subprocess.TimeoutExpired:
        return PythonProbe(error=f"{python} did not answer within 60 s")
    lines = proc.stdout.decode("utf-8", "replace").strip().splitlines()
    if proc.returncode != 0 or not lines:
        err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        return PythonProbe(error=f"{python} failed: {err[-1] if err else 'exit ' + str(proc.returncode)}")
    try:
        return PythonProbe.from_dict(json.loads(lines[-1]))
    except ValueError:
        return PythonProbe(error=f"{python} printed no probe result")


def examine(cfg: dict) -> DoctorAnswer:
    clock = time.time()
    started = time.monotonic()
    home = cfg.get("home") or os.path.expanduser("~")
    cfg = dict(cfg, home=home)
    device_globs, libtpu_glob, locks = _scan_cfg(cfg)
    python = cfg.get("python") or "python3"
    found = find_holders(device_globs, libtpu_glob, locks)
    scan_note = ""
    if found.denied and os.geteuid() != 0:
        elevated, why = run_as_root("scan", cfg)
        if elevated is not None:
            found = Scan.from_dict(elevated)
        else:
            scan_note = f"could not inspect {len(found.denied)} processes of other users: {why}"
    for h in found.holders:
        h.start = None
    expected = cfg.get("expected_devices") or []
    present = sorted(p for g in device_globs for p in glob.glob(g))
    return DoctorAnswer(
        clock=clock,
        hostname=os.uname().nodename,
        user=_user(os.geteuid()),
        root=os.geteuid() == 0,
        python_probe=run_python_probe(python, cfg.get("probe", ""), cfg.get("vm_env")),
        runtime_place=runtime_place(cfg.get("vm_env") or {}, present),
        devices_present=present,
        devices_missing=[p for p in expected if not os.path.exists(p)],
        # a TPU's device files are character devices; plain files are an emulated worker's (no chip behind them)
        devices_plain=[p for p in present if os.path.isfile(p)],
        holders=found.holders,
        scan_note=scan_note,
        locks=[LockFile(path=p, open_in=found.lock_users.get(p, [])) for p in locks],
        env={k: os.environ[k] for k in XLA_VARS if k in os.environ},
        env_files=env_file_exports(home),
        disk={"home": DiskSpace(home, disk_free(home)), "tmp": DiskSpace("/tmp", disk_free("/tmp"))},
        elapsed=time.monotonic() - started,
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("kill-stale", "doctor", "scan"):
        sys.stderr.write("usage: MODE CONFIG_JSON (MODE: kill-stale, doctor, scan)\n")
        return 2
    cfg = json.loads(args[1])
    if cfg.pop("vm_env_on_stdin", False):  # each worker's own: the command line stays the same on every worker
        cfg["vm_env"] = json.loads(sys.stdin.read() or "{}")
    run = {"kill-stale": free_tpu, "doctor": examine, "scan": lambda c: find_holders(*_scan_cfg(c))}[args[0]]
    print(json.dumps(run(cfg).to_dict()), flush=True)
    return 0


def program_argv(python: str, mode: str, cfg: dict) -> list[str]:
    """The argv that runs MODE of this file on a worker: its own source, shipped with `-c`."""
    with open(__file__, encoding="utf-8") as f:
        source = f.read()
    return [python, "-c", source + "\nsys.exit(main())\n", mode, json.dumps(cfg)]
