"""Registers every command group on the CLI; what later issues have not built yet stays a visible placeholder."""

from __future__ import annotations

from tpurun.cli import register_placeholders

IMPLEMENTED: set[str] = set()

register_placeholders(IMPLEMENTED)
