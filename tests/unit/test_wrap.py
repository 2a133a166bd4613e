"""The one shell line a worker's sshd runs for `exec`: arguments and added variables arrive exactly, through
the remote login shell as sshd runs it (`sh -c LINE`, its stdin the channel, open until the end)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpurun.errors import UsageError
from tpurun.transport.ssh import wrap_command

_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30)
_name = st.from_regex(r"T_[A-Za-z0-9_]{0,8}", fullmatch=True)  # not a variable the shell or Python reads itself


def run_line(line: str) -> tuple[int, str, str]:
    """LINE as sshd runs it: the leash in it reads stdin (the channel), which stays open meanwhile."""
    p = subprocess.Popen(
        ["sh", "-c", line], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = p.stdout.read(), p.stderr.read()  # type: ignore[union-attr]
    rc = p.wait(timeout=30)
    p.stdin.close()  # type: ignore[union-attr]
    return rc, out, err


@settings(max_examples=40, deadline=None)
@given(env=st.dictionaries(_name, _text, max_size=4), args=st.lists(_text, max_size=3))
def test_variables_and_arguments_arrive_exactly(env: dict[str, str], args: list[str]) -> None:
    show = (
        "import json, os, sys; print(json.dumps([sys.argv[1:], {k: os.environ.get(k) for k in sys.argv[1].split()}]))"
    )
    argv = [sys.executable, "-c", show, " ".join(env), *args]
    rc, out, err = run_line(wrap_command(argv, 1, env))
    assert rc == 0, err
    got_args, got_env = json.loads(out)
    assert got_args == [" ".join(env), *args]
    assert got_env == env


@pytest.mark.parametrize("bad", ["1X", "A B", "A=B", "", "A;rm"])
def test_a_name_that_is_not_a_variable_is_refused(bad: str) -> None:
    with pytest.raises(UsageError):
        wrap_command(["true"], 1, {bad: "x"})


def test_a_missing_command_is_still_named_when_variables_are_added() -> None:
    rc, _, err = run_line(wrap_command(["nosuchcommand"], 1, {"A": "1"}))
    assert rc == 127 and err.strip() == "cannot start nosuchcommand: command not found"
