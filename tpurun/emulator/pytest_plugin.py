"""pytest fixtures for tests that need Cloud TPU: the emulator, a real TpuClient to it, READY nodes.

Register with ``pytest_plugins = ["tpurun.emulator.pytest_plugin"]`` in a conftest.py. Then::

    def test_something(tpu_node):
        node = tpu_node("v4-16")               # READY, startup script finished, ssh key installed
        subprocess.run(node.ssh(0, "hostname"), check=True)

Fixtures:

* ``emulator`` (session): the emulator server on a thread of the test process, with its own state
  dir; torn down at session end, checking that no process or mount of it is left. Tests needing
  it are skipped when not root or when /usr/sbin/sshd is missing.
* ``tpu_client``: a ``google.cloud.tpu_v2.TpuClient`` talking to it. After each test that used it,
  injected faults are cleared and delays and capacity restored.
* ``tpu_node``: a factory of READY nodes with external addresses (deleted at the end of the test).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tpurun import config

DEFAULT_PROJECT = "emulated-project"
DEFAULT_ZONE = "us-central2-b"
FAST = {"create": 0.05, "delete": 0.05, "stop": 0.05, "start": 0.05, "update": 0.02, "queue": 0.1}


def fast_polling() -> Any:
    """LRO polling for tests: every 50-200 ms instead of the client's 1-20 s backoff."""
    from google.api_core.future import polling

    return polling.DEFAULT_POLLING.with_delay(initial=0.05, maximum=0.2, multiplier=1.3).with_timeout(120)


def global_client(endpoint: str, cls: Any) -> Any:
    """Compute Engine's client CLS (projects, firewalls: resources with global operations) on the emulator at
    ENDPOINT, its operations' `result()` asking the emulator too (the client's own would poll
    compute.googleapis.com, whatever endpoint it was given)."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import compute_v1

    kw: dict[str, Any] = {"client_options": {"api_endpoint": endpoint}, "credentials": AnonymousCredentials()}
    client = cls(transport="rest", **kw)
    client._transport._extended_operations_services["global_operations"] = compute_v1.GlobalOperationsClient(
        transport="rest", **kw
    )
    return client


def host_problem() -> str | None:
    """Why the emulator cannot run here, or None."""
    if os.geteuid() != 0:
        return "the tpurun emulator needs root"
    if not Path("/usr/sbin/sshd").exists():
        return "the tpurun emulator needs /usr/sbin/sshd (Debian package openssh-server)"
    if shutil.which("unshare") is None:
        return "the tpurun emulator needs unshare (util-linux)"
    from tpurun.emulator.boot import compiler

    if compiler() is None:
        return "the tpurun emulator needs a C compiler to build its workers' init (Debian package gcc)"
    return None


def _slots() -> range:
    """The address slots of this session's emulator: under pytest-xdist each worker process has its own
    share, so the emulators of a parallel run never reach for the same addresses (nor those a test's own
    `tpurun emulator start` takes: standalone_slots_env)."""
    from tpurun.emulator.model import SLOTS, STANDALONE_SLOTS

    slots = range(SLOTS.start, STANDALONE_SLOTS.start)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count <= 1:
        return slots
    size = len(slots) // count  # a block each: a node of more than 254 workers takes consecutive slots
    first = slots.start + int(worker[2:]) * size
    return range(first, first + size)


def pytest_configure(config: Any) -> None:
    """Every emulator a test starts itself (`tpurun emulator start`, inheriting this environment) takes this
    process's standalone slots."""
    for key, value in standalone_slots_env().items():
        os.environ.setdefault(key, value)


def standalone_slots_env() -> dict[str, str]:
    """TPURUN_EMULATOR_SLOTS for an emulator a test starts itself (`tpurun emulator start`): this worker
    process's share of the slots no session emulator takes, so the two never share an address."""
    from tpurun.emulator.model import STANDALONE_SLOTS

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index, count = (int(worker[2:]), count) if worker.startswith("gw") and count > 1 else (0, 1)
    size = len(STANDALONE_SLOTS) // count  # a block each (the variable names one FIRST-LAST range)
    first = STANDALONE_SLOTS.start + index * size
    return {"TPURUN_EMULATOR_SLOTS": f"{first}-{first + size - 1}"}


@dataclass
class EmulatorHandle:
    """A running emulator: its endpoint, its model (for direct inspection) and fault helpers."""

    endpoint: str
    state_dir: Path
    server: Any  # api.EmulatorServer
    project: str = DEFAULT_PROJECT
    zone: str = DEFAULT_ZONE

    @property
    def emu(self) -> Any:
        return self.server.emu

    @property
    def parent(self) -> str:
        return f"projects/{self.project}/locations/{self.zone}"

    @property
    def env(self) -> dict[str, str]:
        """Environment that points tpurun at this emulator."""
        return {"TPURUN_API_ENDPOINT": self.endpoint, "TPURUN_PROJECT": self.project, "TPURUN_ZONE": self.zone}

    @property
    def admin(self) -> Any:
        from tpurun.emulator.admin_client import AdminClient

        return AdminClient(self.endpoint)

    def client(self) -> Any:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import tpu_v2

        return tpu_v2.TpuClient(
            transport="rest",
            client_options={"api_endpoint": self.endpoint},
            credentials=AnonymousCredentials(),
        )

    def node_name(self, node_id: str) -> str:
        return f"{self.parent}/nodes/{node_id}"

    def requests(self, since: int = 0) -> list[dict[str, Any]]:
        """The API request log from the SINCE-th request ever logged on (`request_count`), as far as the log,
        which keeps the last ones only, still holds them."""
        with self.emu.lock:
            first = self.emu.requests_logged - len(self.emu.request_log)  # the count of the log's first entry
            return [r for r in self.emu.request_log[max(0, since - first) :] if r["method"] != "EVENT"]

    def request_count(self) -> int:
        """How many requests were ever logged (a full log drops its oldest: its length stops counting)."""
        with self.emu.lock:
            return self.emu.requests_logged

    def preempt(self, node: str, force: bool = False) -> None:
        self.emu.preempt(node, force=force)

    def kill_worker(self, node: str, worker: int) -> None:
        self.emu.kill_worker(node, worker)

    def kill_sshd(self, node: str, worker: int) -> None:
        self.emu.kill_sshd(node, worker)

    def fail_api(self, count: int, code: int, match: str = "") -> None:
        self.emu.add_fail_rule(count, code, match)

    def set_delays(self, **delays: float) -> None:
        self.emu.config.delays.update_from(delays)

    def set_capacity(self, *specs: str, clear: bool = False) -> None:
        from tpurun.emulator.model import Capacity

        with self.emu.lock:
            if clear:
                self.emu.config.capacity.limits.clear()
            for spec in specs:
                k, v = Capacity.parse(spec)
                self.emu.config.capacity.limits[k] = v

    def node_info(self, node: str) -> dict[str, Any]:
        info: dict[str, Any] = self.emu.node_info(node)
        return info

    def wait_startup(self, node: str, timeout: float = 60.0) -> list[int]:
        """Wait until every worker's startup script finished; their exit codes."""
        deadline = time.time() + timeout
        while True:
            codes = [w["startupExitCode"] for w in self.node_info(node)["workers"]]
            if codes and all(c is not None for c in codes):
                return codes
            if time.time() > deadline:
                raise TimeoutError(f"startup scripts of {node} still running after {timeout:.0f}s: {codes}")
            time.sleep(0.05)

    def restore(self) -> None:
        """Clear faults, restore fast delays and unlimited capacity."""
        from tpurun.emulator.model import Delays, default_max_workers

        with self.emu.lock:
            self.emu._fail_rules.clear()
            self.emu.config.delays = Delays(**FAST)
            self.emu.config.capacity.limits.clear()
            self.emu.config.max_workers_per_node = default_max_workers()


@dataclass
class ReadyWorker:
    index: int
    address: str
    hostname: str
    host_key: str  # "ssh-ed25519 AAAA..." as getGuestAttributes published it
    ssh_port: int = 22


@dataclass
class ReadyNode:
    """A READY node with finished startup scripts, reachable with `ssh` under StrictHostKeyChecking=yes."""

    name: str
    node_id: str
    accelerator_type: str
    user: str
    key_path: Path
    known_hosts_path: Path
    workers: list[ReadyWorker] = field(default_factory=list)
    node: Any = None  # the tpu_v2.Node as the API returned it when READY

    def ssh_options(self, index: int = 0) -> list[str]:
        w = self.workers[index]
        return [
            "-i",
            str(self.key_path),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            f"UserKnownHostsFile={self.known_hosts_path}",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=10",
            "-o",
            "LogLevel=ERROR",
            "-p",
            str(w.ssh_port),
        ]

    def ssh(self, index: int, *command: str) -> list[str]:
        """argv that runs COMMAND (one remote shell line) on worker INDEX."""
        return ["ssh", *self.ssh_options(index), f"{self.user}@{self.workers[index].address}", *command]


def _ssh_key(directory: Path) -> tuple[Path, str]:
    key = directory / "id_ed25519"
    if not key.exists():
        directory.mkdir(parents=True, exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tpurun-test", "-f", str(key)], check=True)
    return key, (directory / "id_ed25519.pub").read_text().strip()


@pytest.fixture(scope="session")
def emulator() -> Iterator[EmulatorHandle]:
    """The Cloud TPU emulator for the whole test session (skips the test when the host cannot run it)."""
    problem = host_problem()
    if problem:
        # scripts/test sets TPURUN_REQUIRE_EMULATOR=1: there a missing piece is a failure, not a skip
        if config.REQUIRE_EMULATOR.on():
            pytest.fail(problem)
        pytest.skip(problem)
    from tpurun.emulator.api import EmulatorServer
    from tpurun.emulator.cli import leftovers
    from tpurun.emulator.hosts import WorkerHosts
    from tpurun.emulator.model import Delays, EmulatorConfig
    from tpurun.emulator.state import Emulator

    state_dir = Path(tempfile.mkdtemp(prefix="tpurun-emulator-")).resolve()
    hosts = WorkerHosts(state_dir, key_propagation_delay=0.1)
    emu = Emulator(hosts, EmulatorConfig(state_dir=state_dir, delays=Delays(**FAST), slots=_slots()))
    server = EmulatorServer(emu)
    server.start_thread()
    handle = EmulatorHandle(endpoint=server.endpoint, state_dir=state_dir, server=server)
    try:
        yield handle
    finally:
        server.stop()
        left = leftovers(state_dir)
        if not left:
            shutil.rmtree(state_dir, ignore_errors=True)
    assert not left, f"the emulator left things behind: {left}"


@pytest.fixture
def tpu_client(emulator: EmulatorHandle) -> Iterator[Any]:
    """A real google.cloud.tpu_v2.TpuClient (REST) talking to the emulator."""
    try:
        yield emulator.client()
    finally:
        emulator.restore()


@pytest.fixture
def tpu_node(
    emulator: EmulatorHandle, tpu_client: Any, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Callable[..., ReadyNode]]:
    """Factory: ``tpu_node("v4-16")`` -> a READY node (startup done, ssh key in its metadata)."""
    from google.cloud import tpu_v2

    created: list[str] = []
    key_dir = tmp_path_factory.getbasetemp() / "tpurun-emulator-ssh"
    counter = [0]

    def make(
        accelerator_type: str = "v4-8",
        *,
        node_id: str | None = None,
        startup_script: str | None = None,
        metadata: dict[str, str] | None = None,
        labels: dict[str, str] | None = None,
        spot: bool = False,
        user: str = "tpurun",
        runtime_version: str | None = None,
        wait_startup: bool = True,
        external_ips: bool = True,
    ) -> ReadyNode:
        from tpurun.topology import default_runtime_version, parse_accelerator_type

        topo = parse_accelerator_type(accelerator_type)
        counter[0] += 1
        nid = node_id or f"t{abs(hash(request.node.nodeid)) % 10**8}-{counter[0]}"
        key, pub = _ssh_key(key_dir)
        md = dict(metadata or {})
        md["ssh-keys"] = (md["ssh-keys"] + "\n" if md.get("ssh-keys") else "") + f"{user}:{pub}"
        if startup_script is not None:
            md["startup-script"] = startup_script
        node = tpu_v2.Node(
            accelerator_type=accelerator_type,
            runtime_version=runtime_version or default_runtime_version(topo.generation),
            metadata=md,
            labels=labels or {},
            scheduling_config=tpu_v2.SchedulingConfig(spot=spot),
            network_config=tpu_v2.NetworkConfig(enable_external_ips=external_ips),  # gcloud's default (the API's: no)
        )
        op = tpu_client.create_node(parent=emulator.parent, node_id=nid, node=node)
        name = emulator.node_name(nid)
        created.append(name)
        ready = op.result(polling=fast_polling())
        if wait_startup:
            emulator.wait_startup(name)
        attrs = tpu_client.get_guest_attributes(request={"name": name, "query_path": "hostkeys/"})
        known = tmp_path_factory.mktemp("known-hosts") / "known_hosts"
        workers = []
        lines = []
        for i, (ep, ga) in enumerate(zip(ready.network_endpoints, attrs.guest_attributes, strict=True)):
            host_key = "ssh-ed25519 " + next(it.value for it in ga.query_value.items if it.key == "ssh-ed25519")
            info = emulator.node_info(name)["workers"][i]
            workers.append(ReadyWorker(i, ep.ip_address, info["hostname"], host_key, info["sshPort"]))
            host = ep.ip_address if info["sshPort"] == 22 else f"[{ep.ip_address}]:{info['sshPort']}"
            lines.append(f"{host} {host_key}")
        known.write_text("\n".join(lines) + "\n")
        return ReadyNode(
            name=name,
            node_id=nid,
            accelerator_type=accelerator_type,
            user=user,
            key_path=key,
            known_hosts_path=known,
            workers=workers,
            node=ready,
        )

    try:
        yield make
    finally:
        ops = []
        for name in created:
            try:
                ops.append(tpu_client.delete_node(request={"name": name}))
            except Exception:
                pass  # already gone (or being deleted by the test itself)
        for op in ops:
            op.result(polling=fast_polling())


__all__ = ["EmulatorHandle", "ReadyNode", "ReadyWorker", "fast_polling", "host_problem"]
