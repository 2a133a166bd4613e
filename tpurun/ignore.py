"""Which files of a project directory travel to the workers, and what tpurun writes there that git and sync
should not see.

Used by `create --code` (packed into metadata) and by `sync`. The rules are git's: `.gitignore` and
`.tpurunignore` files (gitignore syntax, through the `pathspec` library) in the directory and in any
directory under it, each for the paths below its own directory, the deepest one with a matching rule
deciding. .git itself, tpurun's own temp files and its settings file (tpurun.toml) never travel.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import pathspec

from tpurun.config import PROJECT_FILE

ALWAYS_IGNORED = [
    ".git/",
    "__pycache__/",
    "*.pyc",
    ".tpurun-tmp-*",
    ".venv/",
    ".mypy_cache/",
    ".pytest_cache/",
    PROJECT_FILE,  # this machine's settings (which TPU, which zone): nothing a worker reads
]
IGNORE_FILES = (".gitignore", ".tpurunignore")
# what `tpurun download` writes into a directory it makes: git and sync leave the directory out
DOWNLOAD_IGNORE = (
    "# Written by `tpurun download`: git and `tpurun sync` (and `train`) leave this directory out.\n"
    "# Delete this file to have them see it.\n"
    "*\n"
)

Layers = tuple[tuple[str, pathspec.GitIgnoreSpec], ...]  # (directory with "/", or "" for the root; its rules)


def load_spec(root: Path, extra: Iterable[str] = ()) -> pathspec.GitIgnoreSpec:
    """The rules of ROOT itself: ALWAYS_IGNORED, ROOT's ignore files, then EXTRA (later rules win)."""
    lines = list(ALWAYS_IGNORED)
    for name in IGNORE_FILES:
        path = root / name
        if path.is_file():
            lines.extend(path.read_text(encoding="utf-8", errors="replace").splitlines())
    lines.extend(extra)
    return pathspec.GitIgnoreSpec.from_lines(lines)  # gitignore semantics, as git itself applies them


class Rules:
    """Whether a path under ROOT is ignored, as git decides it: ROOT's rules (load_spec) for every path,
    and each directory's own ignore files for the paths under that directory. The deepest file with a
    rule that matches decides (so a deeper `!keep.txt` takes back a shallower `*.txt`); within one file,
    the last matching rule. Each directory's files are read once."""

    def __init__(self, root: Path, extra: Iterable[str] = ()) -> None:
        self.root = root
        self.layers: dict[str, Layers] = {"": (("", load_spec(root, extra)),)}

    def layers_of(self, directory: str, names: Collection[str] | None = None) -> Layers:
        """The rules that apply in DIRECTORY ("" or "a/b/"); NAMES: its entries, when the caller listed it."""
        known = self.layers.get(directory)
        if known is not None:
            return known
        parent = directory[:-1].rpartition("/")[0]
        layers = self.layers_of(parent + "/" if parent else "")
        lines: list[str] = []
        for name in IGNORE_FILES:
            path = os.path.join(self.root, directory, name)
            if (name in names) if names is not None else os.path.isfile(path):
                try:
                    with open(path, encoding="utf-8", errors="replace") as f:
                        lines += f.read().splitlines()
                except OSError:
                    pass  # unreadable (or a directory of that name): no rules from it
        if lines:
            layers = (*layers, (directory, pathspec.GitIgnoreSpec.from_lines(lines)))
        self.layers[directory] = layers
        return layers

    @staticmethod
    def match(path: str, layers: Layers) -> bool:
        """Whether PATH (relative to the root; a directory's with a trailing "/") is ignored by LAYERS."""
        if len(layers) == 1:
            return layers[0][1].match_file(path)  # the common case, without the layers' bookkeeping
        for directory, spec in reversed(layers):
            include = spec.check_file(path[len(directory) :]).include
            if include is not None:
                return include
        return False

    def ignored(self, path: str, *, directory: bool = False) -> bool:
        """Whether PATH (relative to the root: a file's, or a directory's) or one of its directories is ignored."""
        parent = ""
        parts = path.split("/")
        for part in parts[:-1]:
            if self.match(f"{parent}{part}/", self.layers_of(parent)):
                return True
            parent += part + "/"
        return self.match(path + "/" if directory else path, self.layers_of(parent))


def walk_stat(
    root: Path, extra_excludes: Iterable[str] = (), *, under: str = ""
) -> Iterator[tuple[str, os.stat_result]]:
    """(relative POSIX path, lstat) of the regular files and symlinks under ROOT (or only under its
    directory UNDER, "a/b/") that are not ignored: a directory's files in name order, then its
    subdirectories. Symlinks to directories are not followed (nor listed). Plain strings and os.scandir's
    cached stat: a 5,000-file tree costs milliseconds, not the quarter second that pathlib and a second
    stat per file took."""
    rules = Rules(root, extra_excludes)
    if under and rules.ignored(under[:-1], directory=True):
        return

    def visit(full: str, rel: str) -> Iterator[tuple[str, os.stat_result]]:
        try:
            with os.scandir(full) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            return  # unreadable or vanished while walking
        layers = rules.layers_of(rel, {e.name for e in entries})
        match = layers[0][1].match_file if len(layers) == 1 else functools.partial(rules.match, layers=layers)
        subdirs = []
        for e in entries:
            r = rel + e.name
            try:
                if e.is_dir(follow_symlinks=False):
                    # prune ignored directories so that big ones (data/, .git/) are never even listed
                    if not match(r + "/"):
                        subdirs.append((e.path, r + "/"))
                    continue
                if match(r):
                    continue
                st = e.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    if e.is_dir():  # a symlink to a directory
                        continue
                elif not stat.S_ISREG(st.st_mode):
                    continue
            except OSError:
                continue
            yield r, st
        for sub_full, sub_rel in subdirs:
            yield from visit(sub_full, sub_rel)

    yield from visit(os.path.join(root, under), under)


def walk(root: Path, extra_excludes: Iterable[str] = ()) -> Iterator[Path]:
    """Relative paths of the regular files and symlinks under ROOT that are not ignored (walk_stat's order)."""
    for rel, _st in walk_stat(root, extra_excludes):
        yield Path(rel)


def pattern(path: str) -> str:
    """The gitignore rule that matches exactly PATH (relative to the ignore file's directory), nothing else."""
    escaped = "".join("\\" + c if c in "\\*?[" else c for c in path)
    stripped = escaped.rstrip(" ")
    return "/" + stripped + "\\ " * (len(escaped) - len(stripped))  # trailing spaces kept, escaped


def mark_download(directory: Path) -> bool:
    """Leave DIRECTORY (one `tpurun download` made) out of git and sync: a .gitignore in it that ignores
    everything (itself included). False when it has one already, or it cannot be written (the download goes
    on; what it brings is then reported as what a sync would send)."""
    try:
        fd = os.open(
            directory / ".gitignore", os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666
        )
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(DOWNLOAD_IGNORE)
    except OSError:
        return False
    return True


def _git_exclude(directory: Path) -> tuple[Path, Path] | None:
    """(the work tree's top, the info/exclude file git reads for it) of the git repository DIRECTORY is in."""
    for top in (directory, *directory.parents):
        dot_git = top / ".git"
        if dot_git.is_dir():
            return top, dot_git / "info" / "exclude"
        if dot_git.is_file():  # a linked worktree or a submodule: "gitdir: <its git directory>"
            text = dot_git.read_text(encoding="utf-8", errors="replace").strip()
            if not text.startswith("gitdir:"):
                return None
            git_dir = top / text.partition(":")[2].strip()
            common = git_dir / "commondir"  # a worktree's: where info/exclude lives
            if common.is_file():
                git_dir = git_dir / common.read_text(encoding="utf-8", errors="replace").strip()
            return top, git_dir / "info" / "exclude"
    return None


def keep_out_of_git(path: Path) -> Path | None:
    """A rule for PATH in the info/exclude file of the git repository it is in (git reads that file as it
    reads .gitignore, but it is never committed): a file tpurun made does not show in `git status`. The
    exclude file, or None outside a repository or when it cannot be written (nothing else changes)."""
    try:
        found = _git_exclude(path.parent.resolve())
        if found is None:
            return None
        top, exclude = found
        rule = pattern(path.resolve().relative_to(top).as_posix())
        text = exclude.read_text(encoding="utf-8") if exclude.is_file() else ""
        if rule not in text.splitlines():
            exclude.parent.mkdir(parents=True, exist_ok=True)
            with open(exclude, "a", encoding="utf-8") as f:
                f.write(("" if not text or text.endswith("\n") else "\n") + rule + "\n")
        return exclude
    except (OSError, ValueError):
        return None
