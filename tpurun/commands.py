"""Registers every command group on the CLI; what is not built yet stays a visible placeholder."""

from __future__ import annotations

from tpurun import cli_health, cli_nodes, cli_remote, cli_sync, cli_train  # noqa: F401  (importing registers their commands)
from tpurun.cli import register_placeholders

IMPLEMENTED: set[str] = {
    "create",
    "attach",
    "list",
    "describe",
    "delete",
    "stop",
    "start",
    "exec",
    "ssh",
    "sync",
    "train",
    "jobs",
    "logs",
    "cancel",
    "kill-stale",
    "doctor",
}

register_placeholders(IMPLEMENTED)
