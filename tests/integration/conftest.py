"""Fixtures for integration tests that drive the real `tpurun` CLI against the emulator."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import Result, create_node, delete_every_tpu, tpurun


@dataclass
class Cli:
    """The `tpurun` command pointed at the emulator, with its own HOME, TPURUN_HOME and project dir."""

    cwd: Path
    home: Path
    env: dict[str, str]
    emulator: Any = None

    @classmethod
    def under(cls, root: Path, emulator: Any) -> Cli:
        """One for EMULATOR whose HOME and project directory are made under ROOT."""
        home, work = root / "home", root / "project"
        home.mkdir()
        work.mkdir()
        return cls(work, home, cli_env(emulator, home), emulator)

    def __call__(self, *args: str, timeout: float = 180, input: str | None = None) -> Result:
        return tpurun(*args, cwd=self.cwd, env=self.env, timeout=timeout, input=input)

    @property
    def tpurun_home(self) -> Path:
        return Path(self.env["TPURUN_HOME"])

    @property
    def key(self) -> Path:
        return self.tpurun_home / "ssh" / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.tpurun_home / "ssh" / "known_hosts"

    def host_key_alias(self, address: str) -> str:
        """The name tpurun pins the key of the worker at ADDRESS under: tpu.<node id>-<worker>."""
        for node in self.emulator.client().list_nodes(parent=self.emulator.parent):
            for i, ep in enumerate(node.network_endpoints):
                if ep.ip_address == address:
                    return f"tpu.{node.id}-{i}"
        raise AssertionError(f"no node has a worker at {address}")

    def ssh(self, address: str, *command: str, user: str | None = None) -> list[str]:
        """The system OpenSSH client with tpurun's key and pinned known_hosts (strict host key checking,
        under the worker's identity as tpurun pins it)."""
        return [
            "ssh",
            "-i", str(self.key),
            "-o", "IdentitiesOnly=yes",
            "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={self.known_hosts}",
            "-o", f"HostKeyAlias={self.host_key_alias(address)}",
            "-o", "BatchMode=yes",
            "-o", "ConnectTimeout=10",
            "-o", "LogLevel=ERROR",
            f"{user or os.environ.get('USER', 'root')}@{address}",
            *command,
        ]  # fmt: skip


def cli_env(emulator, home: Path) -> dict[str, str]:
    """Environment for the CLI against EMULATOR with its own HOME; fast polls and retries for tests."""
    env = dict(emulator.env)
    env.update(
        {
            "HOME": str(home),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "TPURUN_HOME": str(home / ".tpurun"),
            "TPURUN_POLL_INTERVAL": "0.1",
            "TPURUN_RETRY_DELAY": "0.05",
            "TPURUN_SSH_USER": "root",
        }
    )
    return env


@pytest.fixture
def cli(emulator, tmp_path) -> Cli:
    try:
        yield Cli.under(tmp_path, emulator)
    finally:
        emulator.restore()
        delete_every_tpu(emulator)


@dataclass
class SharedPod:
    """A TPU the tests of one file share: its name, `create --json`'s description of it, the Cli that made it,
    and the processes each of its workers had once it was made, by (node, worker) (what a test leaves beyond
    them is stopped)."""

    name: str
    node: dict
    made: Cli
    idle: dict[tuple[str, int], set[int]] = field(default_factory=dict)

    @classmethod
    def made_by(cls, made: Cli, name: str, node: dict, emulator) -> SharedPod:
        """The pod MADE made as NAME (`create --json` said NODE), its workers' processes as they are now."""
        hosts = emulator.emu.hosts
        keys = [emulator.node_name(s["name"]) for s in node.get("slices") or [{"name": name}]]  # each slice's node
        idle = {
            (key, w): set(hosts.worker_root_pids(key, w))
            for key in keys
            for w in range(len(emulator.node_info(key)["workers"]))
        }
        return cls(name, node, made, idle)

    def stop_what_is_left(self, emulator) -> None:
        """Every process a test started on the workers and left there, killed and waited for: the next test
        finds the pod as `create` left it (a test that proves a stop checks that stop itself)."""
        hosts = emulator.emu.hosts
        left = [pid for (key, w), idle in self.idle.items() for pid in hosts.worker_root_pids(key, w) if pid not in idle]
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in left):
            assert time.monotonic() < deadline, f"processes left on {self.name}: {left}"
            time.sleep(0.05)


def _state(pid: int) -> str:
    """PID's state letter (Z: a zombie, dead but not yet reaped by its worker's init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def one_pod_per_file(name: str, accel: str = "v4-16", *extra: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The fixtures of a test file whose tests share one TPU, made once for the file with `tpurun create`:
    `shared_pod` (the file's), and `cli` (each test's), which replaces this conftest's `cli` there. Each test
    gets a copy of the HOME that made the TPU (tpurun's key, its pinned host keys, its records) and of its
    project directory (whose tpurun.toml names the TPU the default), so no test sees another's jobs, settings
    or pins; what a test leaves running on the workers is stopped after it. A test that deletes the TPU,
    takes a worker down or changes what the others run with takes a TPU of its own (`own_cli`).
    Use: `shared_pod, cli = one_pod_per_file("name", "v4-16")` at the top of the test file."""

    @pytest.fixture(scope="module", name="shared_pod")
    def shared_pod(emulator, tmp_path_factory) -> Iterator[SharedPod]:
        made = Cli.under(tmp_path_factory.mktemp(name), emulator)
        try:
            yield SharedPod.made_by(made, name, create_node(made, name, accel, *extra), emulator)
        finally:
            emulator.restore()
            delete_every_tpu(emulator)

    @pytest.fixture(name="cli")
    def cli(shared_pod, emulator, tmp_path) -> Iterator[Cli]:
        home, work = tmp_path / "home", tmp_path / "project"
        shutil.copytree(shared_pod.made.home, home, symlinks=True)
        shutil.copytree(shared_pod.made.cwd, work, symlinks=True)
        try:
            yield Cli(work, home, cli_env(emulator, home), emulator)
        finally:
            emulator.restore()
            shared_pod.stop_what_is_left(emulator)

    return shared_pod, cli


@pytest.fixture
def own_cli(emulator, tmp_path) -> Iterator[Cli]:
    """As `cli`, beside a file's shared TPU: a HOME of the test's own, and every TPU it made deleted after it
    (the file's shared one is left)."""
    client, every_zone = emulator.client(), emulator.parent.rsplit("/", 1)[0] + "/-"
    there = frozenset(
        [node.name for node in client.list_nodes(parent=every_zone)]
        + [qr.name for qr in client.list_queued_resources(parent=emulator.parent)]
    )
    try:
        yield Cli.under(tmp_path, emulator)
    finally:
        emulator.restore()
        delete_every_tpu(emulator, keep=there)
