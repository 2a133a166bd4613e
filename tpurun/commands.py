"""Registers every command group on the CLI; what is not built yet stays a visible placeholder."""

from __future__ import annotations

from tpurun import cli_nodes  # noqa: F401  (registers create, attach, list, describe, delete, stop, start)
from tpurun.cli import register_placeholders

IMPLEMENTED: set[str] = {"create", "attach", "list", "describe", "delete", "stop", "start"}

register_placeholders(IMPLEMENTED)
