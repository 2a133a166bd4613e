"""The runtime half of `tpurun train`: the env contract (env.py, pure functions) and the worker agent
(agent.py, a stdlib-only program shipped to each worker and run there with `python3 agent.py ...`)."""

from __future__ import annotations

from pathlib import Path

AGENT_PATH = Path(__file__).with_name("agent.py")


def agent_source() -> str:
    """The agent's source, as shipped to workers (it imports nothing from tpurun)."""
    return AGENT_PATH.read_text(encoding="utf-8")
