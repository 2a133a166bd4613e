"""Which files of a project directory travel to the workers: .gitignore and .tpurunignore rules.

Used by `create --code` (packed into metadata) and by `sync`. Patterns follow gitignore syntax
(through the `pathspec` library); .git itself and tpurun's own temp files never travel.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import pathspec

ALWAYS_IGNORED = [".git/", "__pycache__/", "*.pyc", ".tpurun-tmp-*", ".venv/", ".mypy_cache/", ".pytest_cache/"]
IGNORE_FILES = (".gitignore", ".tpurunignore")


def load_spec(root: Path, extra: Iterable[str] = ()) -> pathspec.GitIgnoreSpec:
    lines = list(ALWAYS_IGNORED)
    for name in IGNORE_FILES:
        path = root / name
        if path.is_file():
            lines.extend(path.read_text(encoding="utf-8", errors="replace").splitlines())
    lines.extend(extra)
    return pathspec.GitIgnoreSpec.from_lines(lines)  # gitignore semantics, as git itself applies them


def walk(root: Path, extra_excludes: Iterable[str] = ()) -> Iterator[Path]:
    """Relative paths of the regular files and symlinks under ROOT that are not ignored, sorted."""
    spec = load_spec(root, extra_excludes)
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        # prune ignored directories so that big ones (data/, .git/) are never even listed
        dirnames[:] = sorted(d for d in dirnames if not spec.match_file(str(rel_dir / d) + "/"))
        for name in sorted(filenames):
            rel = rel_dir / name
            if spec.match_file(str(rel)):
                continue
            full = Path(dirpath) / name
            if full.is_symlink() or full.is_file():
                yield rel
