"""An exception tpurun did not expect is tpurun's bug: one line saying so, exit 70 (ExitCode.INTERNAL), never
1 (the user's program failed); the traceback only with --debug. The fault planted: a job record cut short on
disk (tpurun reads its own records as it wrote them, so nothing catches a broken one)."""

from __future__ import annotations

from tests.helpers import assert_clean_error, tpurun
from tpurun.errors import ExitCode


def _broken_record(tmp_path) -> dict[str, str]:
    home = tmp_path / "home"
    (home / "jobs").mkdir(parents=True)
    (home / "jobs" / "j1.json").write_text('{"job_id": ')
    return {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "TPURUN_HOME": str(home)}


def test_an_internal_error_exits_70_in_one_line_naming_it_a_bug(tmp_path):
    env = _broken_record(tmp_path)
    r = tpurun("jobs", cwd=tmp_path, env=env)
    assert_clean_error(r, ExitCode.INTERNAL)
    assert r.code == 70 and r.out == ""
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert lines[0].startswith("error: internal error, a bug in tpurun: JSONDecodeError: "), r.err
    assert "no traceback was kept: run again with --debug to see it" in lines[0]


def test_with_debug_the_traceback_is_shown_and_the_line_says_where(tmp_path):
    r = tpurun("--debug", "jobs", cwd=tmp_path, env=_broken_record(tmp_path))
    assert r.code == ExitCode.INTERNAL, r.err
    assert "Traceback (most recent call last)" in r.err
    last = r.err.strip().splitlines()[-1]
    assert last.startswith("error: internal error, a bug in tpurun: ") and "its traceback is above" in last, r.err
