"""What commands print about many workers fits a screen: rendered from results made here (no pod), at 1, 8 and
2,048 workers, lines counted."""

from __future__ import annotations

import pytest

from tpurun.cli import grouped
from tpurun.cli.output import summarize
from tpurun.naming import unfold, worker_name
from tpurun.remote import ExecResult, RunResult

SCREEN = 40  # lines


def refused(w: int) -> str:
    return f"cannot reach worker w{w} (10.0.{w // 250}.{w % 250}) of TPU big on port 22: connection refused"


def results(n: int, failed: set[int] = frozenset(), unreached: set[int] = frozenset()) -> ExecResult:
    made = []
    for w in range(n):
        if w in unreached:
            made.append(RunResult(w, None, error=refused(w) if w % 2 else f"HOST KEY CHANGED for worker w{w} (x)"))
        else:
            made.append(RunResult(w, 3 if w in failed else 0, duration=0.1 + (w % 4) / 10))
    return ExecResult(made, {w: worker_name(w) for w in range(n)})


def test_one_worker_says_only_what_failed(capsys):
    assert summarize(results(1)) == 0
    assert capsys.readouterr().err == ""
    assert summarize(results(1, failed={0})) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "error: the command failed on w0 with exit code 3"
    assert "w0      exit 3  0.1 s" in err


def test_eight_workers_keep_a_row_each(capsys):
    assert summarize(results(8, failed={3, 5})) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].split() == ["WORKER", "RESULT", "TIME"]
    assert [line.split()[0] for line in err[1:9]] == [f"w{w}" for w in range(8)]
    assert err[-1] == "error: the command failed on 2 of 8 workers (w3, w5) with exit code 3"


def test_2048_workers_fit_a_screen_one_row_per_outcome(capsys):
    failed, unreached = {5, 700, 2000}, set(range(1000, 1040))
    said = grouped.Unreachable()
    for r in results(2048, failed, unreached).results:
        if r.exit_code is None:
            said(r.error)  # as the fleet reports them, in worker order, once every connection was tried
    assert summarize(results(2048, failed, unreached), unreachable=said) == 4
    err = capsys.readouterr().err.splitlines()
    assert len(err) <= SCREEN, err
    # as they come: each reason once (a worker's words, the others only counted until the end)
    assert err[:2] == ["error: HOST KEY CHANGED for worker w1000 (x)", f"error: {refused(1001)}"]
    table = err[2:]
    assert table[0].split() == ["RESULT", "WORKERS", "WHICH", "TIME"]
    assert table[1].split() == ["exit", "0", "2,005", "w[0-4,6-699,701-999,1040-1999,2001-2047]", "0.1–0.4", "s"]
    assert table[2].split() == ["unreachable", "40", "w[1000-1039]", "-"]
    assert table[3].split() == ["exit", "3", "3", "w[5,700,2000]", "0.1–0.2", "s"]
    # the held reasons, each once: the first worker's words, the others alike folded
    assert table[4:] == [
        "error: HOST KEY CHANGED for worker w1002 (x) (and 18 more workers alike: "
        "w[1004,1006,1008,1010,1012,1014,1016,1018,1020,1022,1024,…])",
        f"error: {refused(1003)} (and 18 more workers alike: w[1005,1007,1009,1011,1013,1015,1017,1019,1021,1023,1025,…])",
    ]


def test_workers_lost_after_their_start_are_in_the_summary_only(capsys):
    said = grouped.Unreachable()  # nothing said at connect: every worker was reached
    lost = ExecResult([RunResult(w, None, error="relay w5 went away") for w in range(3)])
    assert summarize(lost, unreachable=said) == 4
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")] == []


def test_2048_workers_lost_after_their_start_say_why_once(capsys):
    lost = results(2048, unreached=set(range(64, 128)))
    assert summarize(lost, unreachable=grouped.Unreachable()) == 4
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert errors == [
        "error: HOST KEY CHANGED for worker w64 (x) (and 31 more workers alike: "
        "w[66,68,70,72,74,76,78,80,82,84,86,88,90,92,94,96,98,100,…])",
        f"error: {refused(65)} (and 31 more workers alike: w[67,69,71,73,75,77,79,81,83,85,87,89,91,93,95,97,99,101,…])",
    ]


def test_2048_workers_failing_name_them_folded(capsys):
    assert summarize(results(2048, failed=set(range(2048)))) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "RESULT  WORKERS  WHICH      TIME",
        "exit 3  2,048    w[0-2047]  0.1–0.4 s",
        "error: the command failed on every worker (w[0-2047]) with exit code 3",
    ]


def test_by_worker_is_a_row_each_at_any_size(capsys):
    summarize(results(2048, failed={9}), by_worker=True)
    assert len(capsys.readouterr().err.splitlines()) == 1 + 2048 + 1


@pytest.mark.parametrize("n", [1, 8, 2048])
def test_gather_prints_each_distinct_output_once_under_its_workers(capsys, n):
    g = grouped.Gathered()
    for w in reversed(range(n)):  # in any order
        g(w, "out", "odd" if w == n - 1 and n > 1 else "same")
        g(w, "err", "warn")
    g.print({w: worker_name(w) for w in range(n)})
    out, err = capsys.readouterr()
    blocks = out.split("---------------\n")[1:]
    heads, bodies = blocks[0::2], blocks[1::2]
    assert len(out.splitlines()) <= 8 and err == "warn\n" * len(heads)
    assert sorted(w for h in heads for w in unfold(h.split()[0])) == sorted(worker_name(w) for w in range(n))
    assert heads[0] == ("w0 (1)\n" if n == 1 else f"w[0-{n - 2}] ({n - 1:,})\n")
    assert bodies[0] == "same\n"


def _start(out, clock, workers: int, step: float) -> None:
    """A start on WORKERS workers as `train` reports it: each second how many have started, one more every
    STEP seconds (2,048 at 0.01 s: a 20-second start)."""
    started, t = 0, 0.0
    while started < workers:
        t += 1.0
        clock[0] = t
        started = min(workers, int(t / step))
        out.starting(started, workers)
    out.starting(workers, workers)


@pytest.mark.parametrize("live", [False, True])
def test_the_start_of_2048_workers_is_a_few_lines(capsys, monkeypatch, live):
    from tpurun.cli import train

    clock = [0.0]
    monkeypatch.setattr(train.time, "monotonic", lambda: clock[0])
    out = train.TerminalOutput(colour=False, quiet=False, chatter=False)
    out.renderer.live = live
    _start(out, clock, 2048, 0.01)
    err = capsys.readouterr().err
    said = err.splitlines()
    assert said[-1].endswith("started on every worker (2,048)"), said
    if live:  # one live line, redrawn in place; then the one line that stays
        assert err.count("\n") == 1 and "tpurun: starting: the job has started on 1,000 of 2,048 workers" in err
    else:  # a line at most every START_REPEAT seconds of a 20-second start
        assert 3 <= len(said) <= 20 / train.START_REPEAT + 1, said
        assert said[0] == "starting: the job has started on 500 of 2,048 workers", said


@pytest.mark.parametrize("workers", [1, 8])
def test_the_start_of_a_few_workers_says_nothing_more(capsys, monkeypatch, workers):
    from tpurun.cli import train

    clock = [0.0]
    monkeypatch.setattr(train.time, "monotonic", lambda: clock[0])
    out = train.TerminalOutput(colour=False, quiet=False, chatter=False)
    _start(out, clock, workers, 10.0)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("workers", "rows"), [(1, 4), (8, 32), (2048, 3)])
def test_a_jobs_processes_fit_a_screen(capsys, workers, rows):
    ended = [
        (f"w{w}/c{c}", "failed" if (w, c) == (5, 1) else "killed" if w == 5 else "exited", 1 if (w, c) == (5, 1) else 0,
         1.0 + c / 10, "done")
        for w in range(workers)
        for c in range(4)
    ]  # fmt: skip
    grouped.processes("job j", ended)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "job j" and len(err) == 2 + rows, err
    if workers == 2048:
        assert err[2].split() == ["exited", "0", "8,188", "w[0-4,6-2047]/c[0-3]", "1.0–1.3", "s", "done"]
        assert err[3].split() == ["killed", "0", "3", "w5/c[0,2-3]", "1.0–1.3", "s", "done"]
        assert err[4].split() == ["failed", "1", "1", "w5/c1", "1.1", "s", "done"]


def test_the_same_failure_on_many_workers_is_one_line():
    from tpurun.naming import each_or_by_reason

    def failures(n: int) -> list[tuple[str, str]]:
        return [(f"w{w}", f"w{w}: {refused(w)}" if w != 3 else "w3: agent exited 2") for w in range(n)]

    assert each_or_by_reason(failures(8)) == [why for _, why in failures(8)]  # a few: each in its own words
    assert each_or_by_reason(failures(2048)) == [
        f"w0: {refused(0)} (and 2,046 more workers alike: w[1-2,4-2047])",
        "w3: agent exited 2",
    ]
    assert each_or_by_reason(failures(2)[:1], among=2048) == [f"w0: {refused(0)}"]


def test_subtrees_lost_with_different_relays_are_one_line_and_reasons_are_bounded():
    from tpurun.naming import REASONS_UP_TO, each_or_by_reason

    lost = [(f"w{w}", f"relay w{w - w % 8 + 1} did not start within 90 s") for w in range(1024) if w % 8]
    unreached = [
        (f"w{w}", f"cannot reach worker w{w} (127.77.1.{w % 250}) from relay w{w - 1}: exit 255") for w in (8, 16, 24)
    ]
    odd = [(f"w{w}", f"w{w}: odd failure number {w}") for w in range(1024, 1024 + 2 * REASONS_UP_TO)]
    lines = each_or_by_reason(lost + unreached + odd)
    assert lines[0] == "relay w1 did not start within 90 s (and 895 more workers alike: " + lines[0].split(": ", 1)[1]
    assert lines[1].startswith("cannot reach worker w8 (127.77.1.8) from relay w7: exit 255 (and 2 more workers")
    assert len(lines) == REASONS_UP_TO + 1
    assert lines[-1] == f"{REASONS_UP_TO + 2} other reasons on {REASONS_UP_TO + 2} workers: w[1032-1043]"


def test_a_changed_host_key_is_said_however_many_other_reasons():
    from tpurun.naming import REASONS_UP_TO, each_or_by_reason

    odd = [(f"w{w}", f"w{w}: odd failure number {w}") for w in range(2 * REASONS_UP_TO)]
    changed = [("w99", "HOST KEY CHANGED for worker w99 (127.0.0.9): relay w1 refused it")]
    lines = each_or_by_reason(odd + changed)
    assert changed[0][1] in lines and len(lines) == REASONS_UP_TO + 2
    assert lines[-1] == f"{REASONS_UP_TO} other reasons on {REASONS_UP_TO} workers: w[10-19]"


def test_a_relay_lost_with_its_subtree_is_named_once_with_its_workers(capsys):
    from tpurun.fleet.tree import lost_with
    from tpurun.naming import each_or_by_reason

    why = lost_with("relay w4 went away", [f"w{w}" for w in range(4, 8)])
    assert why == "relay w4 went away; w[4-7] unreachable through it"
    assert lost_with("relay w7 went away", ["w7"]) == "relay w7 went away"  # a leaf's relay is only itself
    assert each_or_by_reason([(f"w{w}", why) for w in range(4, 8)]) == [why]  # a few: once, not once each
    # the rows of exec's summary say unreachable; why, once, under them
    lost = ExecResult([RunResult(w, 0) for w in range(4)] + [RunResult(w, None, error=why) for w in range(4, 8)])
    assert summarize(lost, unreachable=grouped.Unreachable()) == 4
    err = capsys.readouterr().err.splitlines()
    assert [line.split()[:2] for line in err[5:9]] == [[f"w{w}", "unreachable"] for w in range(4, 8)], err
    assert [line for line in err if "went away" in line] == [f"error: {why}"], err
    # lost while the tree was being built: said as it came, once, for all four
    said = grouped.Unreachable()
    for _ in range(4):
        said(why)
    assert summarize(lost, unreachable=said) == 4
    assert [line for line in capsys.readouterr().err.splitlines() if "went away" in line] == [f"error: {why}"]
    # a root's subtree of a 2,048-worker slice: one line, which names them itself (not "and 511 more alike")
    big = lost_with("relay w512 went away", [f"w{w}" for w in range(512, 1024)])
    many = ExecResult(
        [RunResult(w, None, error=big) if 512 <= w < 1024 else RunResult(w, 0, duration=0.1) for w in range(2048)]
    )
    assert summarize(many, unreachable=grouped.Unreachable()) == 4
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert errors == ["error: relay w512 went away; w[512-1023] unreachable through it"]
