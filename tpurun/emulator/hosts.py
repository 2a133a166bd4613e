"""Real hosts behind the emulated Cloud TPU API: one namespace "VM" per TPU worker.

Each worker of an emulated node is a host you log into with the system ``ssh`` client: its
own PID, mount, UTS and IPC namespaces (``unshare``), whose PID 1 (booted by
``_worker_init.py``, then the small C init ``_worker_init.c``; boot.py) listens on
``<address>:<ssh_port>`` and starts a real OpenSSH ``sshd -i`` inside the worker for each
connection, as inetd does: an idle worker is its namespaces and that init, a few hundred KiB.
Addresses follow model.py's address plan (worker ``i`` of a node whose first slot is ``s``:
``127.77.(s + i // 254).(i % 254 + 1)``); all of 127/8 is local on Linux, so no network
namespace or interface setup is needed: the network is shared with the host, and every
worker reaches every other at its address.

What a worker has of its own (everything else -- /usr, /opt, /work, ... -- is the
host's, shared by all workers):

* hostname ``t1v-n-<8 hex>-w-<i>`` (UTS namespace), ``/etc/hostname``;
* a process table: ``ps`` on worker 1 does not show worker 2's processes (PID namespace
  with its own /proc); killing the worker's init kills everything it ran;
* ``/root`` (a per-worker directory under the state dir, seeded from /etc/skel and kept across stop/start;
  0711: others pass through it to an image Python under /root), ``/home`` (likewise: the homes of its OS
  Login users without sudo), ``/tmp`` (per-worker directory, emptied on every boot, like a rebooted VM),
  ``/run`` (fresh tmpfs, with ``/run/sshd``), ``/dev`` (tmpfs with null/zero/full/random/urandom/tty, a
  private devpts on /dev/pts so ``ssh -t`` works, /dev/shm, and the fake TPU: one ``/dev/accelN`` per chip
  for v2/v3/v4, ``/dev/vfio/N`` and ``/dev/vfio/vfio`` for later generations -- plain files anyone can open
  read/write);
* ``/sys/bus/pci/devices``: the host's PCI functions plus one Google TPU function per chip
  (`tpu_vm.worker_image`), which is how torch_xla and tpu-info count a host's chips;
* ``/etc/hosts``: ``metadata.google.internal`` and every worker's hostname of the node;
* ``/etc/passwd``, ``/etc/shadow``, ``/etc/group``: the host's, plus users from metadata.

Users and keys (the choice made here): every user name in the ``ssh-keys`` metadata of the
node (or VM) and of its project (``USER:ssh-ed25519 AAAA... comment``, one per line; keys whose
``google-ssh {"expireOn": ...}`` comment lies in the past are ignored) becomes an alias
of root -- uid 0, gid 0, home /root -- in the worker's passwd (real TPU VMs give these
users sudo; mapping them to root keeps one home per worker and needs no sudo).  A key
listed for USER lets you log in as USER only: sshd reads ``AuthorizedKeysFile
<worker dir>/authorized_keys/%u``, one file per user.  Logging in as ``root`` needs a
key listed under ``root:``.  Names that already exist on the host other than root
(``daemon``, ``sshd``, ...) are not remapped.  Aliases are never removed once created
(like the guest agent, which keeps accounts and only drops keys).  Under OS Login
(``enable-oslogin``, the node's or else the project's) no metadata key is taken and the
project's OS Login accounts are its users (root aliases with the admin role, else users of their own
without sudo); sshd asks the worker's metadata server for their keys at each login (guest_login.py).
Metadata changes reach the workers ``key_propagation_delay`` seconds after `refresh_ssh_keys` (or
`refresh_project`, the project's);
a project's new or deleted OS Login account, or its new role, reaches its workers' passwd at once.

Each worker also gets a metadata server (`_metadata.py`: one listening socket per worker, all served
by one thread of this process) on port 80 of its address and runs the node's ``startup-script`` on
every boot, as root in its namespaces, from its init (log: `startup_log`; exit status:
`startup_exit_code`).  At boot the worker's host key is published in guest attribute ``hostkeys/ssh-ed25519``, as
Google's guest agent does. A private VM's worker (no external address) takes ssh from its network and IAP only.

Everything started here lives in the workers' namespaces or is a thread of this
process: `close` (or killing the inits, whose namespaces go with them) leaves no process and
no mount behind.  `kill_orphans` cleans up after a crashed
emulator process.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpurun import topology
from tpurun.emulator import boot, guest_login, procs
from tpurun.emulator._metadata import MetadataService
from tpurun.emulator.model import SLOTS, slots_for, worker_address
from tpurun.emulator.org import Organisation
from tpurun.emulator.sshd import admit, host_key, sshd_config, write_atomic, write_in_place
from tpurun.emulator.tpu_vm import (
    VmIdentity,
    WorkerImage,
    image_bin,
    image_paths,
    image_python,
    metadata_tree,
    stable_int,
    worker_image,
)

__all__ = ["WorkerInfo", "WorkerHosts", "GENERATIONS"]

GENERATIONS = tuple(topology.GENERATIONS)  # the one table of generations


@dataclass
class WorkerInfo:
    index: int
    address: str  # e.g. "127.77.3.1"
    hostname: str  # e.g. "t1v-n-<8hex>-w-<index>"
    ssh_port: int
    host_key: str  # public key line "ssh-ed25519 AAAA..." (no comment)
    init_pid: int | None  # pid (root pid ns) of the worker namespace's init; None when down


@dataclass(frozen=True)
class ComputeVms:
    """A node whose workers are Compute Engine instances (the VMs of one slice): each has its own name (its
    hostname), id and metadata, and none of the Cloud TPU API's own metadata (`tpu-env`, `agent-worker-number`,
    `worker-network-endpoints`)."""

    names: tuple[str, ...]
    ids: tuple[str, ...]
    machine_type: str
    metadata: Callable[[int], dict[str, str]]  # instance I's metadata, as the API holds it now


def _safe_name(key: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "_", key)[-60:]
    if name != key:
        name += "-" + hashlib.sha256(key.encode()).hexdigest()[:8]
    return name


@dataclass
class _Worker:
    index: int
    address: str
    hostname: str
    dir: Path
    host_key: str = ""
    proc: subprocess.Popen[bytes] | None = None
    init_pid: int | None = None
    pid_ns: str | None = None  # "pid:[inode]" of the last boot, for worker_root_pids
    guest: dict[tuple[str, str], str] = field(default_factory=dict)
    users: set[str] = field(default_factory=set)  # root aliases ever created on this worker
    # what its metadata server says of host events (tpu_vm.HOST_EVENTS' keys): a maintenance notice, preemption
    events: dict[str, str] = field(default_factory=dict)


@dataclass
class _Node:
    key: str
    slot: int
    dir: Path
    generation: str
    accelerator_type: str
    get_metadata: Callable[[], dict[str, str]]
    project: str
    zone: str
    workers: list[_Worker]
    span: range  # its address slots (model.py's address plan)
    boots: int = 0
    endpoints: str = ""  # `worker-network-endpoints`: hostname:uid:address of every worker
    # what a multislice node's `tpu-env` adds (the MEGASCALE values), asked for each time it is served
    extra_tpu_env: Callable[[], dict[str, str]] | None = None
    vms: ComputeVms | None = None  # the workers are Compute Engine instances
    private: Callable[[int], bool] = lambda i: False  # worker I's VM has no external address (sshd.admit)
    lock: threading.RLock = field(default_factory=threading.RLock)  # boot/stop/fault of this node
    # Guest attributes have their own lock: the metadata server writes them while a boot holds `lock`.
    guest_lock: threading.Lock = field(default_factory=threading.Lock)


class _WorkerSource:
    """What one worker's metadata server serves (implements _metadata.MetadataSource)."""

    def __init__(self, hosts: WorkerHosts, node: _Node, worker: _Worker) -> None:
        self._hosts, self._node, self._worker = hosts, node, worker

    def tree(self) -> dict[str, Any]:
        node, w = self._node, self._worker
        attrs = self._hosts.metadata_of(node, w.index)
        attrs.update(self._hosts._computed_attributes(node, w))
        vm = None
        if node.vms is not None:
            vm = VmIdentity(node.vms.names[w.index], node.vms.ids[w.index], node.vms.machine_type)
        return metadata_tree(
            attrs,
            project=node.project,
            project_attributes=self._hosts.org.projects.attributes(node.project),
            zone=node.zone,
            hostname=w.hostname,
            instance_id=str(stable_int(f"{node.key}/{w.index}", 19)),
            address=w.address,
            token=self._hosts.token_for(node.key),
            vm=vm,
            events=dict(w.events),
        )

    def oslogin(self, path: list[str], query: dict[str, str], body: Any = None) -> tuple[int, Any]:
        """`oslogin/...` of this worker's metadata server: 404 while OS Login is off here, as on a real VM."""
        node, org = self._node, self._hosts.org
        md = self._hosts.metadata_of(node, self._worker.index)
        here = guest_login.decide(md, org.projects.attributes(node.project))
        return org.oslogin.metadata_answer(node.project, path, query, body) if here.oslogin else (404, "Not Found\n")

    def guest_get(self, namespace: str, key: str) -> str | None:
        with self._node.guest_lock:
            return self._worker.guest.get((namespace, key))

    def guest_put(self, namespace: str, key: str, value: str) -> None:
        with self._node.guest_lock:
            self._worker.guest[(namespace, key)] = value

    def guest_items(self) -> dict[tuple[str, str], str]:
        with self._node.guest_lock:
            return dict(self._worker.guest)


class WorkerHosts:
    """Boots, faults and tears down the namespace hosts of every emulated TPU node."""

    def __init__(
        self, state_dir: Path, *, ssh_port: int = 22, key_propagation_delay: float = 0.5, metadata_port: int = 80
    ) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.root = self.state_dir / "hosts"
        self.root.mkdir(parents=True, exist_ok=True)
        self.ssh_port = ssh_port
        self.metadata_port = metadata_port
        self.key_propagation_delay = key_propagation_delay
        self._nodes: dict[str, _Node] = {}
        self._lock = threading.Lock()
        self._timers: set[threading.Timer] = set()
        self._metadata: MetadataService | None = None
        self._closed = False
        self._base = {name: Path(f"/etc/{name}").read_text() for name in ("passwd", "shadow", "group")}
        self._token_key = secrets.token_bytes(32)  # signs each node's service-account token
        self._base_users = {ln.split(":", 1)[0] for ln in self._base["passwd"].splitlines() if ":" in ln}
        self.init_binary = boot.build_init(self.root)
        self.pam_module = boot.build_pam(self.root)
        self.org = Organisation()  # an organisation of its own until the emulator's is given (use_organisation)
        self.use_organisation(self.org)
        # a metadata listener per worker: 2,048 workers need more descriptors than the usual soft limit
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    def use_organisation(self, org: Organisation) -> None:
        """Serve ORG's project metadata and OS Login accounts to the workers, and follow its changes."""
        self.org = org
        org.projects.watch(self.refresh_project)
        org.oslogin.watch(self._accounts_changed)

    # ------------------------------------------------------------------ service-account tokens

    def token_for(self, node_key: str) -> str:
        """The access token a node's workers get from their metadata server (stable while the emulator runs)."""
        return "ya29.emulated." + hmac.new(self._token_key, node_key.encode(), hashlib.sha256).hexdigest()[:40]

    def node_of_token(self, token: str) -> str | None:
        """The node whose workers were given TOKEN, if it still exists."""
        with self._lock:
            keys = list(self._nodes)
        return next((k for k in keys if hmac.compare_digest(self.token_for(k), token)), None)

    # ------------------------------------------------------------------ boot
    def boot_node(
        self,
        node_key: str,
        slot: int,
        *,
        num_workers: int,
        generation: str,
        accelerator_type: str,
        get_metadata: Callable[[], dict[str, str]],
        project: str = "emulated-project",
        zone: str = "emulated-zone",
        extra_tpu_env: Callable[[], dict[str, str]] | None = None,
        vms: ComputeVms | None = None,
        private: Callable[[int], bool] | None = None,
    ) -> list[WorkerInfo]:
        """Boot (or reboot) every worker of a node; returns once each sshd accepts connections. VMS: the
        workers are these Compute Engine instances (one per name), not a Cloud TPU API node's. PRIVATE: whether
        worker I's VM is without an external address (then only its network and IAP reach its sshd)."""
        span = range(slot, slot + slots_for(num_workers))
        if num_workers < 1 or span.start not in SLOTS or span[-1] not in SLOTS:
            raise ValueError(
                f"{num_workers} workers from slot {slot} do not fit in slots {SLOTS.start}..{SLOTS.stop - 1}"
            )
        if generation not in GENERATIONS:
            raise ValueError(f"unknown TPU generation {generation!r}; one of {', '.join(GENERATIONS)}")
        with self._lock:
            if self._closed:
                raise RuntimeError("WorkerHosts is closed")
            node = self._nodes.get(node_key)
            if node is not None and node.slot != slot:
                raise ValueError(f"node {node_key} already uses slot {node.slot}")
            if node is None:
                for other in self._nodes.values():
                    if set(span) & set(other.span):
                        raise ValueError(f"slots {span.start}..{span[-1]} overlap those of node {other.key}")
                node = _Node(
                    node_key,
                    slot,
                    self.root / _safe_name(node_key),
                    generation,
                    accelerator_type,
                    get_metadata,
                    project,
                    zone,
                    [],
                    span,
                )
                self._nodes[node_key] = node
            if self._metadata is None:
                self._metadata = MetadataService(self.metadata_port)
            metadata = self._metadata
        with node.lock:
            self._stop_workers(node)
            node.generation, node.accelerator_type, node.get_metadata = generation, accelerator_type, get_metadata
            node.project, node.zone, node.extra_tpu_env, node.vms = project, zone, extra_tpu_env, vms
            node.private = private or node.private
            tag = hashlib.sha256(node_key.encode()).hexdigest()[:8]
            names = list(vms.names) if vms else [f"t1v-n-{tag}-w-{i}" for i in range(num_workers)]
            node.workers = [
                node.workers[i]
                if i < len(node.workers) and node.workers[i].hostname == names[i]
                else _Worker(i, worker_address(slot, i), names[i], node.dir / f"w{i}")
                for i in range(num_workers)
            ]
            node.boots += 1
            node.endpoints = ",".join(
                f"{o.hostname}:{stable_int(f'{node.key}/{o.index}', 19)}:{o.address}" for o in node.workers
            )  # every worker's, asked by each of them: made once a boot
            for w in node.workers:
                self._prepare(node, w, self.metadata_of(node, w.index))
            try:
                for w in node.workers:
                    metadata.add(w.address, _WorkerSource(self, node, w))
                self._boot(node)
            except BaseException:
                self._stop_workers(node)
                raise
            return [self._info(w) for w in node.workers]

    def _prepare(self, node: _Node, w: _Worker, md: dict[str, str]) -> None:
        """Write everything a worker's init reads (host side)."""
        d = w.dir
        image = self._image(node, w)
        fresh_home = not (d / "home").exists()
        for sub in ("home", "homes", "tmp", "etc", "authorized_keys"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        if fresh_home:
            shutil.copytree("/etc/skel", d / "home", dirs_exist_ok=True)
        os.chmod(d / "home", 0o711)  # others pass through root's home to an image Python kept under /root
        # /tmp of a rebooted VM is empty.
        for entry in (d / "tmp").iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        os.chmod(d / "tmp", 0o1777)
        view = "/run/tpurun" + str(d)  # where the init re-attaches d inside the worker
        w.host_key = host_key(d)
        admit(d, node.private(w.index))
        hosts = [
            "127.0.0.1\tlocalhost",
            "::1\tlocalhost ip6-localhost ip6-loopback",
            f"{w.address}\tmetadata.google.internal metadata",
        ]
        if node.vms is None:
            hosts += [f"{o.address}\t{o.hostname}" for o in node.workers]
        else:  # an instance's internal DNS name, then its short name
            hosts += [
                f"{o.address}\t{o.hostname}.{node.zone}.c.{node.project}.internal {o.hostname}" for o in node.workers
            ]
        write_in_place(d / "etc" / "hosts", "\n".join(hosts) + "\n")
        write_in_place(d / "etc" / "hostname", w.hostname + "\n")
        md_host = f"metadata.google.internal:{self.metadata_port}"
        guest_login.write_keys_command(d, md_host)
        guest_login.write_second_step(d, md_host, self.pam_module, image_python(), view)  # for 2FA, on now or later
        self._apply_logins(node, w, md)
        script = md.get("startup-script")
        if script:
            write_atomic(d / "startup-script", script, 0o755)
        else:
            (d / "startup-script").unlink(missing_ok=True)
        (d / "startup.status").unlink(missing_ok=True)
        boot.forget(d)
        (d / "startup.log").touch()
        (d / "image" / "bin").mkdir(parents=True, exist_ok=True)
        for name, text in image_bin().items():
            write_atomic(d / "image" / "bin" / name, text, 0o755)
        write_atomic(
            d / "init.json",
            json.dumps(
                {
                    "view": view,
                    "hostname": w.hostname,
                    "boot": node.boots,
                    "devices": list(image.device_files),
                    "pci": [{"address": f.address, "files": f.files, "links": f.links} for f in image.pci],
                    "metadata_host": f"{w.address}:{self.metadata_port}",
                    "image_paths": image_paths(),
                    "image_bin": "image/bin",
                    "init": str(self.init_binary),
                    "ssh_address": w.address,
                    "ssh_port": self.ssh_port,
                }
            ),
        )
        with node.guest_lock:
            w.guest.clear()  # guest attributes do not survive a reboot; the agent republishes
            # Google's guest agent publishes each host key as hostkeys/<type> = <base64 key>, where guest
            # attributes are enabled: always on a Cloud TPU API node, by metadata on a Compute Engine VM
            if node.vms is None or md.get("enable-guest-attributes", "").upper() == "TRUE":
                kind, blob = w.host_key.split()[:2]
                w.guest[("hostkeys", kind)] = blob
            if node.vms is None:  # a Cloud TPU worker's VM name, which IAP's tunnel takes as its instance
                w.guest[("tpu", "hostname")] = w.hostname

    def _apply_logins(self, node: _Node, w: _Worker, md: dict[str, str]) -> None:
        """Write who may log in to a worker whose metadata is MD (guest_login: metadata keys or OS Login)."""
        logins = guest_login.decide(md, self.org.projects.attributes(node.project))
        w.users |= {u for u in logins.keys if u not in self._base_users}
        listed = self.org.oslogin.accounts(node.project) if logins.oslogin else []  # what the NSS module lists
        admins, users = guest_login.split(listed, self._base_users | w.users)
        view = "/run/tpurun" + str(w.dir)
        extra = guest_login.sshd_lines(logins, image_python(), view)
        config = sshd_config(w.address, self.ssh_port, view, kbd_interactive=logins.two_factor, extra=extra)
        guest_login.write_logins(w.dir, logins, sorted(w.users | admins), self._base, config, users)

    def _boot(self, node: _Node) -> None:
        """Boot every worker of NODE (boot.boot_all) and learn each init's pid; worker 0's sshd must answer."""

        def started(i: int, proc: subprocess.Popen[bytes]) -> None:
            node.workers[i].proc = proc

        boot.boot_all([w.dir for w in node.workers], started, lambda i: self._why(node.workers[i]))
        for w in node.workers:
            w.init_pid = boot.init_pid(w.dir)
            w.pid_ns = procs.ns(w.init_pid) if w.init_pid else None
        w = node.workers[0]  # every worker's sshd is the same program and configuration: one connection tells
        if not self._accepts(w.address, self.ssh_port, banner=True):
            raise RuntimeError(f"worker 0 of {node.key} does not answer ssh: {self._why(w)}")

    @staticmethod
    def _accepts(address: str, port: int, *, banner: bool = False) -> bool:
        """Whether ADDRESS:PORT takes a connection (and, with BANNER, an sshd greets it), asked from ADDRESS itself:
        a private VM's sshd answers its own network only."""
        try:
            with socket.create_connection((address, port), 5.0 if banner else 1.0, (address, 0)) as sock:
                return not banner or sock.recv(4) == b"SSH-"
        except OSError:
            return False

    @staticmethod
    def _why(w: _Worker) -> str:
        out = []
        for name in ("init.log", "sshd.log"):  # the init's own, then what sshd said of a connection
            p = w.dir / name
            if p.exists():
                tail = p.read_text(errors="replace").strip().splitlines()[-5:]
                out += [f"{name}: {ln}" for ln in tail]
        return "; ".join(out) or "no log output"

    # ------------------------------------------------------------------ stop
    def _stop_workers(self, node: _Node) -> None:
        """Kill every worker of the node and wait until their namespaces are empty."""
        with node.lock:
            self._kill(node.workers)
            if self._metadata is not None:
                for w in node.workers:
                    self._metadata.remove(w.address)

    @staticmethod
    def _kill(workers: list[_Worker]) -> None:
        # Only namespaces of workers alive now are waited on: a dead worker's namespace id may
        # already have been reused by a running worker, and waiting on it would time out.
        namespaces = {w.pid_ns for w in workers if w.pid_ns is not None and w.init_pid is not None}
        # Signal all first, then wait: stopping 128 workers takes one wait, not 128.
        for w in workers:
            if w.init_pid is not None:
                try:
                    os.kill(w.init_pid, signal.SIGKILL)  # the kernel then kills the whole pid namespace
                except ProcessLookupError:
                    pass
            elif w.proc is not None and w.proc.poll() is None:
                w.proc.kill()  # init not known yet: unshare's --kill-child takes it along
        for w in workers:
            if w.proc is not None:
                # unshare reaps its child, the init (killing unshare instead would leave init a zombie).
                try:
                    w.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                    w.proc.wait()
                w.proc = None
            w.init_pid = None
            w.pid_ns = None
        # Under gVisor a namespace's other processes may outlive its reaped init for a moment.
        deadline = time.monotonic() + 10
        while namespaces and time.monotonic() < deadline:
            if not any(procs.ns(pid) in namespaces for pid in procs.all_pids()):
                break
            time.sleep(0.01)

    def shutdown_node(self, node_key: str, *, delete: bool = False) -> None:
        """Kill every process of every worker (stop/preempt/delete); delete=True also removes its dirs."""
        node = self._get(node_key)
        self._stop_workers(node)
        if delete:
            with self._lock:
                self._nodes.pop(node_key, None)
            shutil.rmtree(node.dir, ignore_errors=True)

    def kill_sshd(self, node_key: str, index: int) -> None:
        """Fault: that worker stops taking ssh connections (its init closes its listener: no sshd is started
        for a new one); its sessions and other processes live on."""
        self._listen(node_key, index, signal.SIGUSR2, False)

    def restart_sshd(self, node_key: str, index: int) -> None:
        """Undo kill_sshd: the worker's init listens again; returns once it accepts connections."""
        self._listen(node_key, index, signal.SIGUSR1, True)

    def _listen(self, node_key: str, index: int, sig: signal.Signals, up: bool) -> None:
        w = self._worker(node_key, index)
        if w.init_pid is None:
            if up:
                raise RuntimeError(f"worker {index} of {node_key} is down")
            return
        os.kill(w.init_pid, sig)
        deadline = time.monotonic() + 10
        while boot.listening(w.dir) != up or self._accepts(w.address, self.ssh_port) != up:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"ssh of worker {index} of {node_key} did not go {'up' if up else 'down'}: {self._why(w)}"
                )
            time.sleep(0.02)

    def kill_worker(self, node_key: str, index: int) -> None:
        """Fault: the whole worker namespace dies (its metadata server stays up, like a hung VM's)."""
        w = self._worker(node_key, index)
        with self._get(node_key).lock:
            self._kill([w])

    def set_events(self, node_key: str, indices: list[int], events: dict[str, str | None]) -> None:
        """What the metadata servers of the workers at INDICES say of host events from now on (tpu_vm.HOST_EVENTS'
        keys; None: back to the key's quiet value), told at once to the GETs that wait for a change."""
        node = self._get(node_key)
        with node.guest_lock:
            for w in (node.workers[i] for i in indices):
                w.events.update({k: v for k, v in events.items() if v is not None})
                for key in [k for k, v in events.items() if v is None]:
                    w.events.pop(key, None)
        if self._metadata is not None:
            self._metadata.touch()

    def refresh_access(self, node_key: str) -> None:
        """Whether each worker's VM is private changed: its init follows at the next connection."""
        node = self._get(node_key)
        with node.lock:
            for w in node.workers:
                admit(w.dir, node.private(w.index))

    # ------------------------------------------------------------------ keys, queries
    def refresh_ssh_keys(self, node_key: str) -> None:
        """`ssh-keys` metadata changed: rewrite authorized keys after the propagation delay (background)."""
        node = self._get(node_key)
        if self._metadata is not None:  # the metadata server shows the change now: its waiting GETs look again
            self._metadata.touch()

        def apply() -> None:
            with self._lock:
                self._timers.discard(timer)
                if self._closed or self._nodes.get(node_key) is not node:
                    return
            self._refresh_now(node)

        timer = threading.Timer(self.key_propagation_delay, apply)
        timer.daemon = True
        with self._lock:
            self._timers.add(timer)
        timer.start()

    def refresh_project(self, project: str) -> None:
        """PROJECT's common metadata changed: every worker of it takes it after the propagation delay."""
        for node in self._nodes_of(project):
            with contextlib.suppress(KeyError):  # deleted meanwhile
                self.refresh_ssh_keys(node.key)

    def _accounts_changed(self, project: str) -> None:
        """PROJECT's OS Login accounts changed: its workers' passwd follows at once (NSS asks on every lookup)."""
        for node in self._nodes_of(project):
            with contextlib.suppress(OSError):  # its directory went with a delete meanwhile
                self._refresh_now(node)

    def _nodes_of(self, project: str) -> list[_Node]:
        with self._lock:
            return [n for n in self._nodes.values() if n.project == project]

    def _refresh_now(self, node: _Node) -> None:
        with node.lock:
            for w in node.workers:
                if w.dir.exists():
                    self._apply_logins(node, w, self.metadata_of(node, w.index))

    @staticmethod
    def metadata_of(node: _Node, index: int) -> dict[str, str]:
        """Worker INDEX's metadata attributes as the API holds them (a node's are every worker's)."""
        return dict(node.vms.metadata(index) if node.vms is not None else node.get_metadata())

    def guest_attributes(self, node_key: str) -> list[dict[tuple[str, str], str]]:
        node = self._get(node_key)
        with node.guest_lock:
            return [dict(w.guest) for w in node.workers]

    def workers(self, node_key: str) -> list[WorkerInfo]:
        node = self._get(node_key)
        with node.lock:
            return [self._info(w) for w in node.workers]

    def startup_log(self, node_key: str, index: int) -> Path:
        return self._worker(node_key, index).dir / "startup.log"

    def startup_exit_code(self, node_key: str, index: int) -> int | None:
        """Exit status of this boot's startup script (0 if there was none); None while it runs."""
        try:
            return int((self._worker(node_key, index).dir / "startup.status").read_text())
        except (OSError, ValueError):
            return None

    def worker_root_pids(self, node_key: str, index: int) -> list[int]:
        """Pids (root pid ns) of every process in the worker's pid namespace of its last boot."""
        ns = self._worker(node_key, index).pid_ns
        if ns is None:
            return []
        return sorted(pid for pid in procs.all_pids() if procs.ns(pid) == ns)

    def _info(self, w: _Worker) -> WorkerInfo:
        alive = w.proc is not None and w.proc.poll() is None
        return WorkerInfo(w.index, w.address, w.hostname, self.ssh_port, w.host_key, w.init_pid if alive else None)

    @staticmethod
    def _image(node: _Node, w: _Worker) -> WorkerImage:
        return worker_image(
            node.accelerator_type,
            worker=w.index,
            node_id=node.key.rsplit("/", 1)[-1],
            zone=node.zone,
            project=node.project,
            extra=node.extra_tpu_env() if node.extra_tpu_env else None,
        )

    def _computed_attributes(self, node: _Node, w: _Worker) -> dict[str, str]:
        """What the Cloud TPU API adds to each worker's metadata (a Compute Engine VM has none of it)."""
        if node.vms is not None:
            return {}
        return {
            "agent-worker-number": str(w.index),
            "accelerator-type": node.accelerator_type,
            "worker-network-endpoints": node.endpoints,
            "tpu-env": self._image(node, w).tpu_env_text(),
        }

    def _get(self, node_key: str) -> _Node:
        with self._lock:
            node = self._nodes.get(node_key)
        if node is None:
            raise KeyError(f"no hosts for node {node_key!r}")
        return node

    def _worker(self, node_key: str, index: int) -> _Worker:
        node = self._get(node_key)
        if not 0 <= index < len(node.workers):
            raise IndexError(f"node {node_key} has no worker {index}")
        return node.workers[index]

    def node_keys(self) -> list[str]:
        with self._lock:
            return list(self._nodes)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Shut everything down: no process, mount or namespace is left behind."""
        with self._lock:
            self._closed = True
            timers, self._timers = self._timers, set()
            nodes = list(self._nodes.values())
        for t in timers:
            t.cancel()
        for node in nodes:
            self._stop_workers(node)
        if self._metadata is not None:
            self._metadata.close()
            self._metadata = None

    def __enter__(self) -> WorkerHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
