"""The repository stands on its own, and the package keeps the shape docs/architecture.md describes."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "tpurun"


def outside_paths() -> list[str]:
    """What only the machine running the test has, derived from where the checkout sits: its own absolute
    path, whatever lies beside it (notes, tools, other checkouts), and the interpreter's installation."""
    here = ROOT.resolve()
    found = [str(here) + "/"]
    # beside a checkout in a shared scratch directory (the temp dir, /) lie strangers, not the project's
    # neighbours: a test's made-up /tmp/x path would match one by chance
    shared = {Path(tempfile.gettempdir()).resolve(), Path("/")}
    for sibling in sorted(here.parent.iterdir()) if here.parent not in shared else []:
        if sibling != here:
            found += [f"../{sibling.name}/", f"{sibling}/"]
    base = Path(sys.base_prefix).resolve()
    # a private interpreter (pyenv's, a toolchain's) is this machine's own; the system's (/usr) is every one's
    if here not in base.parents and base not in (Path("/usr"), Path("/usr/local")):
        found.append(str(base) + "/")
    return [n for n in found if n.strip("./")]


def tracked_files() -> list[Path]:
    if (ROOT / ".git").exists():
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        names = [n for n in out.decode().split("\0") if n]
    else:
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts]
    return [ROOT / n for n in names]


def test_the_repository_names_no_path_outside_itself():
    needles = outside_paths()
    files = tracked_files()
    assert ROOT / "README.md" in files and ROOT / "tpurun" / "config.py" in files
    found = []
    for path in files:
        if path == Path(__file__) or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
        for n, line in enumerate(text.splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{n}: {needle}" for needle in needles if needle in line]
    assert found == [], "the repository must stand on its own:\n" + "\n".join(found)


def test_no_caller_asks_which_runner_it_has():
    """Runners are polymorphic (run, stream, pipe): only tpurun/transport/ may look at their types."""
    pattern = re.compile(r"isinstance\([^)]*\b(SshRunner|LocalRunner|SshStream|LocalStream|SshPipe|LocalPipe)\b")
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if "transport" in path.relative_to(PACKAGE).parts:
            continue
        offenders += [
            f"{path.relative_to(ROOT)}:{n}"
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if pattern.search(line)
        ]
    assert offenders == []


def test_every_module_of_the_map_exists():
    page = (ROOT / "docs" / "architecture.md").read_text()
    for package, modules in re.findall(r"^\| `tpurun/(\w+)/`[^|]*\| ([^|]+) \|", page, re.M):
        for module in re.findall(r"`([\w/]+\.py)`", modules):
            assert (PACKAGE / package / module).is_file(), f"docs/architecture.md names tpurun/{package}/{module}"


def test_no_caller_asks_which_api_made_a_tpu():
    """Backends answer in the same views: outside tpurun/cloud/ only the CLI's option parsing and list
    rendering name them, and nothing but the cloud layer imports an API's client or a backend module."""
    asks = re.compile(
        r"\.backend\b\s*(==|!=|in\b)|Kind\.(TPU_API|COMPUTE)\b|\b(tpu_v2|compute_v1)\b|"
        r"cloud\.(tpu_api|compute)\b|import (TpuApi|Compute)\b"
    )
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] in ("cloud", "emulator"):
            continue
        offenders += [
            f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if asks.search(line)
        ]
    assert offenders == []
