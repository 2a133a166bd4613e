"""Help and docs agree: every command is in the contract's command table with the page that documents it,
that page names every option the command has, arguments are written one way (capitals, as the docs
write them), every command says what it does, and every bounded number has its range declared to the
parser (so --help shows it, and refuses what is outside it, one way)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer

from tpurun import cli

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _commands() -> dict[str, Any]:
    """Every command as the parser sees it (typer may vendor its own click: no isinstance on click's classes)."""
    for name in cli.COMMANDS:
        cli._register(name)
    root = typer.main.get_command(cli.app)
    found: dict[str, Any] = {}
    for name, command in root.commands.items():  # type: ignore[attr-defined]
        if hasattr(command, "commands"):  # a group
            found.update({f"{name} {sub}": c for sub, c in command.commands.items()})
        else:
            found[name] = command
    return found


def _pages() -> dict[str, list[str]]:
    """The contract's command table: command -> the pages that document it."""
    pages: dict[str, list[str]] = {}
    for line in (DOCS / "contract.md").read_text().splitlines():
        m = re.match(r"^\| [\w ]+ \| (.+?) \| (.+) \|$", line)
        if m:
            files = re.findall(r"\(([\w-]+\.md)", m.group(2))
            for name in re.findall(r"`([a-z][\w /-]*?)`", m.group(1)):
                pages[name.split(" /")[0].strip()] = files
                pages.setdefault(name.split()[0], files)  # a group: `emulator start / stop / ...`
    return pages


COMMANDS = _commands()


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_is_documented_with_every_option(name):
    pages = _pages()
    group = name.split()[0]
    files = pages.get(name) or pages.get(group)
    assert files, f"`{name}` is missing from the command table in docs/contract.md"
    text = "".join((DOCS / f).read_text() for f in files)
    command = COMMANDS[name]
    assert (command.help or "").strip(), f"`tpurun {name}` has no description"
    if command.context_settings.get("help_option_names") == []:
        return  # a passthrough (the emulator's own parser documents its options)
    missing = [o for p in command.params for o in p.opts if o.startswith("--") and o != "--help" and o not in text]
    assert not missing, f"{', '.join(files)} do not mention {missing} of `tpurun {name}`"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_arguments_are_written_in_capitals(name):
    for p in COMMANDS[name].params:
        if p.param_type_name == "argument":
            metavar = p.metavar or p.name or ""
            words = metavar.replace("|off", "")  # `autostop NAME IDLE|off`: off is a literal word
            assert words == words.upper(), (
                f"`tpurun {name}`: argument {metavar!r} is not in capitals (NAME, JOB, PATH, ...)"
            )


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_number_declares_its_range(name):
    for p in COMMANDS[name].params:
        if p.param_type_name == "option":
            assert p.type.name not in ("integer", "float"), (
                f"`tpurun {name} {p.opts[0]}` takes a number without a declared range"
            )


def test_installation_page_names_what_the_test_command_installs():
    script = (DOCS.parent / "scripts" / "test").read_text()
    page = (DOCS / "installation.md").read_text()
    packages = re.findall(r"need_apt\+=\(([\w-]+)\)", script)
    extras = re.search(r"pip install .* -e '\.\[([\w,]+)\]'", script)
    assert packages and extras, "scripts/test no longer reads as this test expects: update both"
    missing = [p for p in packages if f"`{p}`" not in page]
    missing += [f"the {e} extra" for e in extras.group(1).split(",") if f"`{e}`" not in page]
    missing += [f".[{extras.group(1)}]"] if f".[{extras.group(1)}]" not in page else []
    assert not missing, f"docs/installation.md does not say that scripts/test installs {missing}"
