"""Fixtures for integration tests that drive the real `tpurun` CLI against the emulator."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import Result, delete_every_tpu, tpurun


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
