"""Registers every command group on the CLI; what is not built yet stays a visible placeholder."""

from __future__ import annotations

from tpurun import cli_nodes, cli_remote  # noqa: F401  (importing registers their commands)
from tpurun.cli import register_placeholders

IMPLEMENTED: set[str] = {"create", "attach", "list", "describe", "delete", "stop", "start", "exec", "ssh"}

register_placeholders(IMPLEMENTED)
