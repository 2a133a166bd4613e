"""How a worker's namespaces come up: the init every worker ends as (`_worker_init.c`, built here once per
emulator with the C compiler, as is the PAM module of its sshd's second step, `_pam_conv.c`), and booting many
workers a few at a time.

A worker boots in two steps. `unshare` starts `_worker_init.py` as PID 1 of fresh namespaces, which builds the
worker's view of the machine (a Python interpreter, about 10 MiB, for some 50 ms), then becomes the C init by
exec (a few hundred KiB for the worker's life). At most `BOOT_WINDOW` workers are in the first step at once,
so a 2,048-worker boot never holds 2,048 interpreters. A worker is up once its init listens for ssh (it writes
`listening` in the worker's directory: a test connection would start an sshd for nothing).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

INIT_SOURCE = Path(__file__).with_name("_worker_init.c")
INIT_SCRIPT = Path(__file__).with_name("_worker_init.py")
PAM_SOURCE = Path(__file__).with_name("_pam_conv.c")
INIT_NAME = "tpurun-worker-init"  # the C init's argv[0], what `ps` on a worker shows as PID 1
UNSHARE = [
    "unshare",
    "--pid",
    "--mount",
    "--uts",
    "--ipc",
    "--fork",
    "--kill-child=SIGKILL",
    "--propagation",
    "private",
]
BOOT_WINDOW = max(4, 4 * (os.cpu_count() or 1))
BOOT_TIMEOUT = 60.0


def compiler() -> str | None:
    """The C compiler that builds the workers' init, or None."""
    return next((c for c in (os.environ.get("CC", ""), "cc", "gcc", "clang") if c and shutil.which(c)), None)


def build_init(directory: Path) -> Path:
    """The workers' init, compiled into DIRECTORY (once per source: its name carries the source's hash)."""
    return _build(INIT_SOURCE, directory, INIT_NAME, [["-static"], []])  # no static libc: a dynamic one does too


def build_pam(directory: Path) -> Path:
    """The workers' PAM module (sshd's keyboard-interactive step under OS Login 2FA), compiled into DIRECTORY."""
    return _build(PAM_SOURCE, directory, "pam_conv", [["-shared", "-fPIC"]], ".so")


def _build(source_path: Path, directory: Path, name: str, tries: list[list[str]], suffix: str = "") -> Path:
    """SOURCE_PATH compiled into DIRECTORY (with the flags of the first of TRIES that builds), once per source."""
    source = source_path.read_bytes()
    binary = directory / f"{name}-{hashlib.sha256(source).hexdigest()[:12]}{suffix}"
    if binary.exists():
        return binary
    cc = compiler()
    if cc is None:
        raise RuntimeError("the tpurun emulator needs a C compiler (cc) to build its workers' init: install gcc")
    directory.mkdir(parents=True, exist_ok=True)
    tmp = binary.with_name(binary.name + f".{os.getpid()}.tmp")
    for flags in tries:
        done = subprocess.run([cc, "-O2", *flags, "-o", str(tmp), str(source_path)], capture_output=True, text=True)
        if done.returncode == 0:
            break
    if done.returncode != 0:
        raise RuntimeError(f"cannot build {source_path.name} with {cc}: {done.stderr.strip()[-300:]}")
    os.replace(tmp, binary)
    return binary


def start(wdir: Path) -> subprocess.Popen[bytes]:
    """Start the boot of the worker whose directory (with its init.json) is WDIR."""
    with open(wdir / "init.log", "ab") as log:
        return subprocess.Popen(
            [*UNSHARE, sys.executable, "-I", "-S", str(INIT_SCRIPT), str(wdir)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,  # the emulator's Ctrl-C must not reach workers
        )


def init_pid(wdir: Path) -> int | None:
    """The pid (on this machine) of the init of the worker in WDIR, once its boot wrote it."""
    try:
        return int((wdir / "init.pid").read_text())
    except (OSError, ValueError):
        return None


def listening(wdir: Path) -> bool:
    return (wdir / "listening").exists()


def forget(wdir: Path) -> None:
    """Before a boot: what the last one left in WDIR says nothing of the next."""
    for name in ("init.pid", "listening"):
        (wdir / name).unlink(missing_ok=True)


def boot_all(
    dirs: list[Path], started: Callable[[int, subprocess.Popen[bytes]], None], failed: Callable[[int], str]
) -> None:
    """Boot the workers of DIRS, at most BOOT_WINDOW in their Python step at once; returns once every init
    listens. STARTED(i, proc) is told each worker's unshare as it starts; a worker whose boot ends raises
    RuntimeError with FAILED(i)'s account of it."""
    procs: dict[int, subprocess.Popen[bytes]] = {}
    waiting = list(range(len(dirs)))
    booting: list[int] = []
    deadline = time.monotonic() + BOOT_TIMEOUT
    while waiting or booting:
        while waiting and len(booting) < BOOT_WINDOW:
            i = waiting.pop(0)
            procs[i] = start(dirs[i])
            started(i, procs[i])
            booting.append(i)
            deadline = max(deadline, time.monotonic() + BOOT_TIMEOUT)
        still = []
        for i in booting:
            if procs[i].poll() is not None:
                raise RuntimeError(f"worker {i} failed to boot: {failed(i)}")
            if not listening(dirs[i]):
                still.append(i)
        booting = still
        if booting:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"worker {booting[0]} did not boot within {BOOT_TIMEOUT:.0f} s: {failed(booting[0])}"
                )
            time.sleep(0.005 if waiting else 0.02)
