"""Sets of workers folded as output prints them (`w[0-4,6-2047]`), unfolded back, and read by `--worker`."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpurun.errors import UsageError
from tpurun.naming import fold, shown, spec_words, unfold, worker_name
from tpurun.transport.runner import parse_worker_spec

single = st.sets(st.integers(0, 2100), min_size=1, max_size=300).map(lambda ws: [worker_name(w) for w in ws])
multi = st.sets(st.tuples(st.integers(0, 40), st.integers(0, 300)), min_size=1, max_size=300).map(
    lambda ws: [worker_name(w, s) for s, w in ws]
)
processes = st.sets(st.tuples(st.integers(0, 300), st.integers(0, 7)), min_size=1, max_size=200).map(
    lambda ps: [f"{worker_name(w)}/c{c}" for w, c in ps]
)
other = st.text(alphabet="abwcs/-_.0123456789", min_size=1, max_size=8)  # any name without brackets or commas
names = st.one_of(single, multi, processes, st.lists(other, min_size=1, max_size=30, unique=True))


@settings(deadline=None)  # a loaded machine is no failure of the fold
@given(names)
def test_fold_then_unfold_is_the_identity(ns):
    back = unfold(fold(ns))
    assert sorted(back) == sorted(set(ns))
    assert len(back) == len(set(back))


@settings(deadline=None)  # a loaded machine is no failure of the fold
@given(names, st.randoms(use_true_random=False))
def test_folding_is_deterministic_whatever_the_order(ns, rnd):
    again = list(ns) + list(ns)[:3]  # duplicates change nothing either
    rnd.shuffle(again)
    assert fold(again) == fold(ns)


@settings(deadline=None)  # a loaded machine is no failure of the fold
@given(single)
def test_a_fold_is_never_much_longer_than_its_names(ns):
    # one prefix and a pair of brackets at most more than the names listed; runs are one range each
    assert len(fold(ns)) <= len(",".join(ns)) + 3
    assert fold(ns).count(",") < len(ns)


@settings(deadline=None)  # a loaded machine is no failure of the fold
@given(st.integers(1, 10_000), st.integers(0, 10_000))
def test_a_run_of_workers_folds_to_one_range(n, start):
    assert fold(worker_name(w) for w in range(start, start + n)) == (
        f"w{start}" if n == 1 else f"w[{start}-{start + n - 1}]"
    )


@settings(deadline=None)  # a loaded machine is no failure of the fold
@given(names, st.integers(6, 200))
def test_shown_fits_its_width_and_is_the_whole_set_where_that_fits(ns, width):
    text = shown(ns, width)
    assert len(text) <= width
    if len(fold(ns)) <= width:
        assert text == fold(ns)
    else:
        assert "…" in text


def test_folds_as_output_prints_them():
    assert fold([worker_name(w) for w in range(2048) if w not in (5, 2000)]) == "w[0-4,6-1999,2001-2047]"
    assert fold(["w5"]) == "w5"
    assert fold([worker_name(w, s) for s in range(4) for w in range(256) if (s, w) != (1, 4)]) == (
        "s[0,2-3]/w[0-255],s1/w[0-3,5-255]"
    )
    assert fold(f"w{w}/c{c}" for w in range(2048) for c in range(4)) == "w[0-2047]/c[0-3]"
    assert shown([worker_name(w) for w in range(0, 2048, 2)], 30) == "w[0,2,4,6,8,10,12,14,16,18,…]"


@settings(deadline=None)  # a loaded machine is no failure of the fold
@given(single)
def test_the_worker_option_takes_a_fold_back(ns):
    indexes = sorted(int(n[1:]) for n in ns)
    assert parse_worker_spec(fold(ns), 2101) == indexes


@settings(deadline=None)  # a loaded machine is no failure of the fold
@given(multi)
def test_the_worker_option_takes_a_multislice_fold_back(ns):
    every = [worker_name(w, s) for s in range(41) for w in range(301)]
    chosen = parse_worker_spec(fold(ns), len(every), every)
    assert sorted(every[i] for i in chosen) == sorted(ns)


def test_the_worker_option_still_reads_its_own_forms_and_names():
    assert parse_worker_spec("1-2,5", 8) == [1, 2, 5]
    assert parse_worker_spec("w3,w5-6, w[0-1]", 8) == [0, 1, 3, 5, 6]
    assert spec_words("s1/w[0-1],s2", True) == ["s1/w0", "s1/w1", "s2"]
    every = [worker_name(w, s) for s in range(2) for w in range(4)]
    assert parse_worker_spec("s1", 8, every) == [4, 5, 6, 7]
    for bad in ("w[0-", "w[3-1]", "w0]", "w[a]", "w[0-99999999]"):
        with pytest.raises(UsageError, match="bad --worker"):
            parse_worker_spec(bad, 8)
    with pytest.raises(UsageError, match="bad --worker"):
        parse_worker_spec("w3", 8, every)  # a multislice TPU's workers are sS/wN


def test_a_large_fold_is_quick():
    started = time.monotonic()
    assert fold(f"w{w}/c{c}" for w in range(10_000) for c in range(8) if (w, c) != (7, 3)) == (
        "w[0-6,8-9999]/c[0-7],w7/c[0-2,4-7]"
    )
    assert time.monotonic() - started < 10.0
