"""config.py is the one place tpurun reads its TPURUN_* variables, and docs/configuration.md names each."""

from __future__ import annotations

import ast
from pathlib import Path

from tpurun import config

PACKAGE = Path(config.__file__).parent
# programs shipped to workers run without this package: they read the variables tpurun sets for them
WORKER_PROGRAMS = {
    "worker/agent.py",
    "worker/agent_files.py",
    "worker/agent_supervisor.py",
    "worker/hook/sitecustomize.py",
    "worker/sync_helper.py",
    "worker/probe.py",
}


def _reads(tree: ast.AST) -> list[int]:
    """Lines that read a TPURUN_* variable: X.get("TPURUN_..."), getenv("TPURUN_..."), X["TPURUN_..."]."""
    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, (ast.Attribute, ast.Name)):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if name in ("get", "getenv", "pop"):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.startswith("TPURUN_"):
            found.append(node.lineno)
    return found


def test_no_tpurun_variable_is_read_outside_config():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "config.py" or rel in WORKER_PROGRAMS:
            continue
        offenders += [f"tpurun/{rel}:{line}" for line in _reads(ast.parse(path.read_text()))]
    assert offenders == [], "read these through tpurun.config: " + ", ".join(offenders)


def test_the_scan_sees_reads():
    tree = ast.parse('import os\na = os.environ.get("TPURUN_X")\nb = env["TPURUN_Y"]\nenv["TPURUN_Z"] = "1"\n')
    assert _reads(tree) == [2, 3]


def test_every_variable_is_documented_once_with_its_default():
    names = [t.name for t in config.ALL]
    assert len(names) == len(set(names))
    page = (PACKAGE.parent / "docs" / "configuration.md").read_text()
    missing = [n for n in names if f"`{n}`" not in page]
    assert missing == [], f"docs/configuration.md does not name {missing}"
