"""The repository stands on its own, and the package keeps the shape docs/architecture.md describes."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import pytest

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
    assert _lines_outside(pattern, ("transport",)) == []


def _lines_outside(pattern: re.Pattern[str], folders: tuple[str, ...]) -> list[str]:
    """The lines of the package's modules outside FOLDERS that PATTERN finds."""
    return [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] not in folders
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]


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
    assert _lines_outside(asks, ("cloud", "emulator")) == []


# ---------------------------------------------------------------------------- static rules
# Each rule is a function over a package directory returning its violations; each runs on tpurun and on a
# copy with a violation planted, which it must find (a rule that cannot fail proves nothing).


def _module_name(package: Path, path: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path) -> list[ast.ImportFrom | ast.Import]:
    return [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.Import | ast.ImportFrom)]


def _run_time_imports(path: Path) -> list[ast.ImportFrom | ast.Import]:
    """Every import PATH makes when it runs: at module level and inside functions (made on first call), not
    those under `if TYPE_CHECKING:` (read by the type checker only, never executed)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in typing_only]


def import_cycles(package: Path) -> list[str]:
    """Circles among the package's modules through the imports they make when they run, function-local ones
    included: a lazy import points one way (downwards) like any other, and only defers the cost of loading.
    The lazy imports that stay are all for speed, each to a module below its importer: `cloud/routing.py`
    loads a backend's module (and its API's client: Compute Engine's takes a second) only when that API is
    asked; `fleet/targets.py`, `job/`, `diagnose.py` and `cli/output.py` load the cloud layer (google-cloud-tpu)
    only when a command asks the API, so `exec` and `train` on remembered workers never do; `watchdogs.py` loads `targets`
    (paramiko) only when a worker must be reached; `settings.py` loads `ignore.py` (pathspec) only when
    it makes a settings file; and the like for rich, cryptography and other libraries. An import under `if
    TYPE_CHECKING:` only names a type and is not counted."""
    name = package.name
    graph: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        deps = set()
        for node in _run_time_imports(path):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == name:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    is_module = (package.parent / (sub.replace(".", "/") + ".py")).is_file()
                    deps.add(sub if is_module else str(node.module))
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == name)
        graph[_module_name(package, path)] = deps
    return [" -> ".join((*c, c[0])) for c in sorted(_circles(graph))]


def _circles(graph: Mapping[str, Iterable[str]]) -> set[tuple[str, ...]]:
    """Every circle in GRAPH (a node: the nodes it points to), each once, starting at its least node."""
    found: set[tuple[str, ...]] = set()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        for other in sorted(graph.get(node, ())):
            if other in path:
                cycle = path[path.index(other) :]
                start = cycle.index(min(cycle))
                found.add(tuple(cycle[start:] + cycle[:start]))
            elif other in graph and other not in done:
                visit(other, [*path, other])
        done.add(node)

    for node in sorted(graph):
        if node not in done:
            visit(node, [node])
    return found


def _unit(package: Path, module: str) -> str:
    """The part of the package MODULE belongs to: its folder (`fleet/`), or itself at the top level (`remote`)."""
    parts = module.split(".")[1:]
    if parts and (package / parts[0]).is_dir():
        return parts[0] + "/"
    return parts[0] if parts else "__init__"


def folder_cycles(package: Path) -> list[str]:
    """Circles among the package's folders (each taken as one, with the top-level modules each its own) through
    every import, those in a function and those under `if TYPE_CHECKING:` too: a folder stands above or below
    another, and a type named across the line is as much a dependency for the reader as a call. Each step of a
    circle is shown with one import that makes it."""
    edges: dict[str, dict[str, str]] = {}
    for path in sorted(package.rglob("*.py")):
        unit = _unit(package, _module_name(package, path))
        for line, module in _imports_of(path):
            if module.split(".")[0] != package.name or module == package.name:
                continue
            other = _unit(package, module)
            if other != unit:
                where = f"{path.relative_to(package)}:{line}: {module}"
                edges.setdefault(unit, {}).setdefault(other, where)
    return [
        " -> ".join(f"{a} ({edges[a][b]})" for a, b in zip(c, (*c[1:], c[0]), strict=True)) + f" -> {c[0]}"
        for c in sorted(_circles(edges))
    ]


def private_imports(package: Path) -> list[str]:
    """`from package.module import _name`: a module's private name used by another module."""
    name = package.name
    out = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == name:
                out += [
                    f"{path.relative_to(package.parent)}:{node.lineno}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    return out


def bundle_imports(package: Path) -> list[str]:
    """What the worker bundle (and the programs that travel inline: probe, sync's helper) imports beyond the
    standard library and the bundle's own files, at module level: a worker has only a bare python3."""
    from tpurun.worker import BUNDLE

    worker = package / "worker"
    own = {Path(f).stem for f in BUNDLE} | {"sync_helper", "tpurun"}  # tpurun: the `if __package__:` branch
    out = []
    for rel in [*BUNDLE, "sync_helper.py"]:
        for node in _top_level_imports(worker / rel):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            out += [
                f"worker/{rel}: {n}"
                for n in names
                if node.__class__ is ast.Import or getattr(node, "level", 0) == 0
                if n.split(".")[0] not in sys.stdlib_module_names and n.split(".")[0] not in own
            ]
    return out


def renamed_imports(package: Path) -> list[str]:
    """A module or name of the package imported under another name (`from tpurun.job import plan as envc`):
    each is called by its own name everywhere."""
    name = package.name
    out = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == name:
                renamed = [a for a in node.names if a.asname and a.asname != a.name]
            elif isinstance(node, ast.Import):
                renamed = [a for a in node.names if a.name.split(".")[0] == name and a.asname]
            else:
                continue
            out += [f"{path.relative_to(package.parent)}:{node.lineno}: {a.name} as {a.asname}" for a in renamed]
    return out


def _imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of PATH, at any depth (in a function too): a module, or the module
    a `from` takes names from, each name that is itself a module counted as one."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def cli_transport_imports(package: Path) -> list[str]:
    """The command line reaching into the transport or the fan-out: it parses, calls the library and renders;
    connecting, fanning out and running on workers are the library's. Of `fleet/` it may ask `targets` only
    whether a word names a TPU (`tpurun ssh NAME` against `tpurun ssh -- CMD`)."""
    below = [f"{package.name}.transport", f"{package.name}.fleet"]
    allowed = {f"{package.name}.fleet", f"{package.name}.fleet.targets"}  # the package itself: only a docstring
    return [
        f"{path.relative_to(package.parent)}:{line}: {module}"
        for path in sorted((package / "cli").rglob("*.py"))
        for line, module in _imports_of(path)
        if any(module == b or module.startswith(b + ".") for b in below) and module not in allowed
    ]


def cloud_reaching_workers(package: Path) -> list[str]:
    """The cloud layer reaching workers: it asks the APIs about TPUs, never a worker; what reaches workers
    (the transport, the fleet and its targets, the jobs, the watchdogs' setup) stands above it, even in a function."""
    above = [f"{package.name}.{m}" for m in ("transport", "fleet", "job", "watchdogs")]
    return [
        f"{path.relative_to(package.parent)}:{line}: {module}"
        for path in sorted((package / "cloud").rglob("*.py"))
        for line, module in _imports_of(path)
        if any(module == a or module.startswith(a + ".") for a in above)
    ]


def runners_outside_the_fleet(package: Path) -> list[str]:
    """A worker's runner taken outside the fan-out (`target.runners`): callers reach workers through the
    target's `Fleet` only, and take from the target the `Worker` records they count and name (`workers`), so
    whether a fleet connects from this machine or through relays is never theirs to know."""
    out = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] == "fleet":
            continue
        out += [
            f"{path.relative_to(package.parent)}:{node.lineno}: .runners"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr == "runners"
        ]
    return out


def _resolves(path: Path, package: Path, name: str, module: str) -> list[str]:
    """Where PATH calls `NAME.resolve` or imports `resolve` from MODULE."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        called = (
            isinstance(node, ast.Attribute)
            and node.attr == "resolve"
            and isinstance(node.value, ast.Name)
            and node.value.id == name
        )
        imported = (
            isinstance(node, ast.ImportFrom) and node.module == module and any(a.name == "resolve" for a in node.names)
        )
        if called or imported:
            out.append(f"{path.relative_to(package.parent)}:{node.lineno}: {name}.resolve")
    return out


def library_settings_resolved(package: Path) -> list[str]:
    """Settings resolved (flags, environment, files) outside the command line: each command resolves them
    once and passes them down, so one command never sees two answers."""
    out = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] != "cli" and rel != Path("settings.py"):
            out += _resolves(path, package, "settings", f"{package.name}.settings")
    return out


def cli_targets_resolved(package: Path) -> list[str]:
    """The command line resolving which workers a command acts on: every command that reaches workers hands
    the library its settings and worker spec, and the library resolves them, one way for every command."""
    out = []
    for path in sorted((package / "cli").rglob("*.py")):
        out += _resolves(path, package, "targets", f"{package.name}.fleet.targets")
    return out


MAX_MODULE_LINES = 700
# A module that is one thing though longer, with the reason it stays whole (the rule gives way for it alone).
LONGER: dict[str, tuple[int, str]] = {  # {module: (its own limit, why it holds one thing however long)}
    "worker/agent_supervisor.py": (
        780,
        "one object: the hook's log socket (_attach, chip, own_channel, _read_ctl) and the end's judgement (watch_chip,"
        " blame_died, finish) read and write the same slots under one lock; a part split off would take the"
        " Supervisor back as an argument",
    ),
    "worker/probe.py": (
        800,
        "one program that travels alone on the command line: its records, the /proc scan both modes share and"
        " doctor's checks cannot become modules without shipping them beside it",
    ),
}
MAX_FUNCTION_LINES = 80


def long_modules(package: Path) -> list[str]:
    """A module over MAX_MODULE_LINES lines (or its own limit in LONGER): it holds more than one thing, each of which
    can be a module."""
    out = []
    for path in sorted(package.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        limit, _ = LONGER.get(str(path.relative_to(package)), (MAX_MODULE_LINES, ""))
        if lines > limit:
            out.append(f"{path.relative_to(package.parent)}: {lines} lines")
    return out


def long_functions(package: Path) -> list[str]:
    """A function over MAX_FUNCTION_LINES lines, from its `def` to its last line: sync or async, a method or
    nested in another function, each counts on its own."""
    out = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    out.append(f"{path.relative_to(package.parent)}:{node.lineno}: {node.name}, {lines} lines")
    return out


RULES = {
    "import circle": import_cycles,
    "folder circle": folder_cycles,
    "private name": private_imports,
    "bundle beyond stdlib": bundle_imports,
    "renamed import": renamed_imports,
    "cli imports transport": cli_transport_imports,
    "cloud reaches workers": cloud_reaching_workers,
    "runners outside the fleet": runners_outside_the_fleet,
    "library resolves settings": library_settings_resolved,
    "cli resolves targets": cli_targets_resolved,
    "module size": long_modules,
    "function size": long_functions,
}

# where each rule's violation is planted, and what: the text itself, or made from the module's own text
PLANTED: dict[str, tuple[str, str | Callable[[str], str]]] = {
    "import circle": ("transport/runner.py", "from tpurun.transport.ssh import SshRunner\n"),
    # a type named across folders, under TYPE_CHECKING (the module rule lets it pass: see below)
    "folder circle": ("transport/runner.py", "if TYPE_CHECKING:\n    from tpurun.fleet.targets import Target\n"),
    "private name": ("cli/train.py", "from tpurun.transport.ssh import _fast_transport\n"),
    "bundle beyond stdlib": ("worker/protocol.py", "import paramiko\n"),
    "renamed import": ("cli/health.py", "from tpurun.job import launcher as train\n"),
    "cli imports transport": ("cli/remote.py", "from tpurun.fleet.interface import Call\n"),
    "cloud reaches workers": ("cloud/backend.py", "from tpurun.transport.runner import Worker\n"),
    "runners outside the fleet": ("job/attempt.py", "def planted(target):\n    return len(target.runners)\n"),
    "library resolves settings": ("job/launcher.py", "from tpurun.settings import resolve\n"),
    "cli resolves targets": ("cli/health.py", "from tpurun.fleet.targets import resolve\n"),
    # one line over each limit: a module of 701 lines, a function of 81 from its `def` to its last line
    "module size": ("job/status.py", lambda text: "#\n" * (MAX_MODULE_LINES + 1 - len(text.splitlines()))),
    "function size": ("job/status.py", "def planted():\n" + "    pass\n" * MAX_FUNCTION_LINES),
}


@pytest.mark.parametrize("rule", RULES)
def test_the_package_keeps_each_static_rule(rule: str) -> None:
    assert RULES[rule](PACKAGE) == []


@pytest.mark.parametrize("rule", RULES)
def test_each_static_rule_finds_a_planted_violation(rule: str, tmp_path: Path) -> None:
    copy = tmp_path / "tpurun"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    where, plant = PLANTED[rule]
    target = copy / where
    text = target.read_text()
    line = plant(text) if callable(plant) else plant
    cut = text.index("\nfrom ") + 1  # among the module's imports
    target.write_text(text[:cut] + line + text[cut:])
    found = RULES[rule](copy)
    assert found and any(Path(where).stem in f for f in found), found


def test_a_circle_through_a_function_local_import_is_found(tmp_path: Path) -> None:
    """The cloud layer points one way: the interface (cloud/backend.py) knows neither backend. A lazy import of
    one, inside a function, closes a circle (compute.py imports the interface) and is found; the same import
    under `if TYPE_CHECKING:` names a type only and is not."""
    copy = tmp_path / "tpurun"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "cloud" / "backend.py"
    text = target.read_text()
    lazy = "\n\ndef planted() -> object:\n    from tpurun.cloud.compute import Compute\n\n    return Compute\n"
    target.write_text(text + lazy)
    found = import_cycles(copy)
    assert any("tpurun.cloud.backend" in f and "tpurun.cloud.compute" in f for f in found), found
    target.write_text(text + "\nif TYPE_CHECKING:\n    from tpurun.cloud.compute import Compute\n")
    assert import_cycles(copy) == []


def test_a_folder_circle_through_a_type_is_found(tmp_path: Path) -> None:
    """The transport (one worker's connection) stands below the fleet that builds on it. A type of the fleet
    named in the transport under `if TYPE_CHECKING:` is no circle of modules at run time, but it is one of
    folders, and is found with the import that makes each step; in a function it is found as well."""
    copy = tmp_path / "tpurun"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "transport" / "ssh.py"
    text = target.read_text()
    target.write_text(text + "\nif TYPE_CHECKING:\n    from tpurun.fleet.targets import Target\n")
    assert import_cycles(copy) == []
    found = folder_cycles(copy)
    assert any(f.startswith("fleet/ (") and "transport/ssh.py" in f and "tpurun.fleet.targets" in f for f in found)
    target.write_text(
        text + "\n\ndef planted() -> object:\n    from tpurun.fleet import interface\n\n    return interface\n"
    )
    assert any("transport/ssh.py" in f for f in folder_cycles(copy))


def test_the_size_rules_allow_their_limits(tmp_path: Path) -> None:
    """A module of exactly MAX_MODULE_LINES lines and a function of exactly MAX_FUNCTION_LINES pass (the
    planted violations show one line more is found)."""
    package = tmp_path / "tpurun"
    package.mkdir()
    function = "async def at_the_limit():\n" + "    pass\n" * (MAX_FUNCTION_LINES - 1)
    (package / "whole.py").write_text(function + "#\n" * (MAX_MODULE_LINES - MAX_FUNCTION_LINES))
    assert len((package / "whole.py").read_text().splitlines()) == MAX_MODULE_LINES
    assert long_modules(package) == [] and long_functions(package) == []


def test_every_name_the_scripts_import_from_tpurun_exists() -> None:
    """The benchmarks and tools under scripts/ run outside the suite: a name they import that a change
    renamed or moved would only show when someone next runs them."""
    import importlib
    import importlib.util

    missing = []
    for path in sorted((ROOT / "scripts").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tpurun"):
                continue
            module = importlib.import_module(str(node.module))
            for alias in node.names:
                if not hasattr(module, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}")
    assert missing == []
