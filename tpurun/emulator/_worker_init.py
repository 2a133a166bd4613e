"""The boot of one emulated TPU worker: the Python half of its PID 1.

`hosts.WorkerHosts` starts this file (as a script, stdlib only) through
``unshare --pid --mount --uts --ipc --fork``; it therefore runs as PID 1 of a fresh
PID namespace, in a private mount namespace and its own UTS namespace.  It:

1. writes its pid on this machine to ``init.pid`` (how the emulator finds and kills the worker),
2. builds the worker's private view of the machine (``/proc``, ``/run``, ``/dev`` with
   fake TPU device files, ``/sys/bus/pci/devices`` with the TPU chips' PCI functions, ``/root``,
   ``/home``, ``/tmp``, ``/etc/{hosts,passwd,shadow,group,hostname}``, ``/etc/pam.d/sshd``) and sets the hostname,
3. starts the node's startup script, if it has one,
4. becomes (exec) the worker's lasting init, ``_worker_init.c`` built by hosts.py: a few hundred KiB
   that reap every process of the namespace, record the startup script's exit status, and start
   ``sshd -i`` for each ssh connection to the worker's address (no sshd runs while nobody is connected).

When the init dies the kernel kills every other process of the namespace and the
mount namespace (with every mount made here) disappears with its last process; nothing
is ever mounted in the host's namespace.

Signals from the host to the init: SIGUSR2 closes its ssh listener (kill-sshd), SIGUSR1 opens it
again.  Everything else is the host's business (it kills the init with SIGKILL).

Argument: the host-side worker directory, which holds ``init.json`` written by hosts.py.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import stat
import sys
import time

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

STD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _b(s: str | None) -> bytes | None:
    return None if s is None else s.encode()


def mount(source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    if _libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target} ({fstype}): {os.strerror(err)}")


def bind(source: str, target: str) -> None:
    mount(source, target, None, MS_BIND)


def log(msg: str) -> None:
    sys.stderr.write(f"[init {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


# Character devices a login shell, sshd and ordinary tools need: (name, major, minor).
_CHAR_DEVICES = [("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0)]


def setup_dev(fake_devices: list[str]) -> None:
    # Keep handles on the host's device nodes before /dev is covered, in case mknod is
    # refused (device cgroup); then we bind-mount them instead.
    host_fds = {
        name: os.open(f"/dev/{name}", os.O_PATH) for name, _, _ in _CHAR_DEVICES if os.path.exists(f"/dev/{name}")
    }
    mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=4m")
    for name, major, minor in _CHAR_DEVICES:
        path = f"/dev/{name}"
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
            os.chmod(path, 0o666)
        except PermissionError:
            if name in host_fds:
                open(path, "w").close()
                bind(f"/proc/self/fd/{host_fds[name]}", path)
    for fd in host_fds.values():
        os.close(fd)
    # A private devpts instance: ptys allocated for `ssh -t` sessions belong to this worker.
    os.mkdir("/dev/pts")
    mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5")
    os.symlink("pts/ptmx", "/dev/ptmx")
    os.mkdir("/dev/shm")
    mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    os.symlink("/proc/self/fd", "/dev/fd")
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"/dev/{name}")
    # The fake TPU: plain files that anyone can open read/write; a holder shows up in
    # /proc/PID/fd as /dev/accel0 (or /dev/vfio/0), which is what stale-process hunters look at.
    for path in fake_devices:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o666)
        os.close(fd)
        os.chmod(path, 0o666)


def setup_pci(functions: list[dict]) -> None:
    """The worker's PCI bus as software counts TPU chips on it: the host's own functions (symlinks into
    /sys/devices, as sysfs has them) plus one directory per emulated chip with its id files."""
    base = "/sys/bus/pci/devices"
    host = {name: os.readlink(f"{base}/{name}") for name in os.listdir(base)} if os.path.isdir(base) else {}
    if not os.path.isdir(base):
        return
    mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=755,size=1m")
    for name, target in host.items():
        os.symlink(target, f"{base}/{name}")
    for fn in functions:
        d = f"{base}/{fn['address']}"
        if os.path.lexists(d):
            os.unlink(d)  # an emulated chip takes the address over
        os.mkdir(d)
        for key, value in fn["files"].items():
            with open(f"{d}/{key}", "w") as f:
                f.write(value + "\n")
        for key, target in fn.get("links", {}).items():
            os.symlink(target, f"{d}/{key}")
    mount(None, base, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)


def setup_image_dir(view: str, i: int, path: str, fd: int) -> None:
    """PATH (held by FD) as part of the worker's disk: the host's directory below, a layer of the worker's
    own above (kept in its directory across reboots), so what a worker installs stays on that worker."""
    layer = f"{view}/image/layer{i}"
    for sub in ("lower", "upper", "work"):
        os.makedirs(f"{layer}/{sub}", exist_ok=True)
    bind(f"/proc/self/fd/{fd}", f"{layer}/lower")
    os.makedirs(path, exist_ok=True)
    try:
        mount("overlay", path, "overlay", 0, f"lowerdir={layer}/lower,upperdir={layer}/upper,workdir={layer}/work")
    except OSError as e:  # no overlay here: the image is read-only instead
        log(f"{e}; {path} is read-only")
        bind(f"{layer}/lower", path)
        mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY)


def build_view(wdir: str, cfg: dict) -> None:
    view = cfg["view"]
    # The host path of the worker directory may be hidden by what we mount below
    # (it may live under /tmp, /root or /run), so hold it by a file descriptor and
    # re-attach it at `view`, a path under our own /run that contains the host path
    # (so `pgrep -f STATE_DIR` still finds this worker's processes).
    wfd = os.open(wdir, os.O_PATH | os.O_DIRECTORY)
    # the image's Python installation (see hosts.image_paths), which may live under /root or /tmp: held the same way
    image_fds = [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in cfg.get("image_paths", []) if os.path.isdir(p)]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # never propagate anything to the host
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64m")
    os.makedirs(view)
    bind(f"/proc/self/fd/{wfd}", view)
    os.close(wfd)
    os.mkdir("/run/sshd", 0o755)  # sshd's privilege-separation directory
    os.mkdir("/run/lock")
    os.chmod("/run/lock", 0o1777)
    setup_dev(cfg["devices"])
    setup_pci(cfg.get("pci", []))
    bind(f"{view}/home", "/root")
    if os.path.isdir("/home") and os.path.isdir(f"{view}/homes"):
        bind(f"{view}/homes", "/home")  # its own /home: its OS Login users without sudo live there
    bind(f"{view}/tmp", "/tmp")
    for name in ("hosts", "hostname", "passwd", "shadow", "group"):
        bind(f"{view}/etc/{name}", f"/etc/{name}")
    if os.path.exists("/etc/pam.d/sshd") and os.path.exists(f"{view}/etc/pam-sshd"):
        bind(f"{view}/etc/pam-sshd", "/etc/pam.d/sshd")  # sshd's PAM service: its second step under OS Login 2FA
    for i, (path, fd) in enumerate(image_fds):
        setup_image_dir(view, i, path, fd)
        os.close(fd)
    if cfg.get("image_bin"):
        # the image's python3/pip first on PATH; the host's other commands stay visible below them
        mount("overlay", "/usr/local/bin", "overlay", MS_RDONLY, f"lowerdir={view}/{cfg['image_bin']}:/usr/local/bin")
    socket.sethostname(cfg["hostname"])
    os.chdir("/")


def start_script(cfg: dict) -> int:
    """Start the node's startup script (as root, in the worker's namespaces); its pid, 0 when there is none."""
    view = cfg["view"]
    script, status = f"{view}/startup-script", f"{view}/startup.status"
    if os.path.exists(status):
        os.unlink(status)
    if not cfg.get("run_startup_script", True):
        return 0
    if not os.path.exists(script):
        with open(f"{status}.tmp", "w") as f:  # like google-startup-scripts.service with no script: done
            f.write("0\n")
        os.rename(f"{status}.tmp", status)
        return 0
    env = {
        "PATH": STD_PATH,
        "HOME": "/root",
        "USER": "root",
        "LOGNAME": "root",
        "SHELL": "/bin/bash",
        "LANG": "C.UTF-8",
        "GCE_METADATA_HOST": cfg["metadata_host"],
    }
    with open(script, "rb") as f:
        shebang = f.read(2) == b"#!"
    argv = [script] if shebang else ["/bin/bash", script]
    logf = f"{view}/startup.log"
    with open(logf, "a") as f:
        f.write(
            f"--- startup-script: boot {cfg['boot']} on {cfg['hostname']} at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n"
        )
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, logf, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    return os.posix_spawn(
        argv[0], argv, env, file_actions=actions, setsid=True, setsigdef=(signal.SIGCHLD, signal.SIGPIPE)
    )


def main() -> None:
    wdir = sys.argv[1]
    os.umask(0o022)
    with open(os.path.join(wdir, "init.json")) as f:
        cfg = json.load(f)
    # the init this process becomes, held before the mounts may hide the state dir it lies in
    init_fd = os.open(cfg["init"], os.O_RDONLY)
    # our pid on this machine, read while /proc is still the host's: how the emulator finds and kills the worker
    host_pid = os.readlink("/proc/self")
    with open(os.path.join(wdir, "init.pid.tmp"), "w") as f:
        f.write(host_pid + "\n")
    os.rename(os.path.join(wdir, "init.pid.tmp"), os.path.join(wdir, "init.pid"))
    try:
        build_view(wdir, cfg)
    except OSError as e:
        log(f"cannot build the worker's view: {e}")
        sys.exit(3)
    script = start_script(cfg)
    host, port = cfg["ssh_address"], str(cfg["ssh_port"])
    os.execve(init_fd, ["tpurun-worker-init", cfg["view"], host, port, str(script), wdir], {})


if __name__ == "__main__":
    main()
