"""The relay tree's wire and plan (tpurun/worker/relay_wire.py): frames survive any cutting of the byte
stream, a set frame keeps its channels and data, and a plan puts every worker in the tree once, no relay
with more children than its fan-out, each tree as shallow as the fan-out allows."""

from __future__ import annotations

import math
import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpurun.worker import WORKER_DIR, relay_wire
from tpurun.worker.relay_wire import Node, Opening

frames_st = st.lists(
    st.tuples(st.sampled_from(sorted(relay_wire.SET_KINDS | {relay_wire.OUT, relay_wire.EXIT})),
              st.integers(0, 2**32 - 1), st.binary(max_size=300)),
    max_size=20,
)  # fmt: skip


@given(frames_st, st.lists(st.integers(1, 50), min_size=1, max_size=30))
@settings(max_examples=200, deadline=None)
def test_frames_survive_any_cutting(frames, cuts):
    stream = b"".join(relay_wire.frame(k, n, p) for k, n, p in frames)
    reader = relay_wire.Frames()
    got, at, i = [], 0, 0
    while at < len(stream):
        step = cuts[i % len(cuts)]
        got.extend(reader.feed(stream[at : at + step]))
        at, i = at + step, i + 1
    assert got == frames and not reader.buf


@given(st.lists(st.integers(0, 2**32 - 1), max_size=50), st.binary(max_size=200))
def test_a_set_frame_keeps_its_channels_and_data(channels, data):
    ((kind, count, payload),) = list(relay_wire.Frames().feed(relay_wire.set_frame(relay_wire.INPUT, channels, data)))
    assert kind == relay_wire.INPUT and relay_wire.split_set(count, payload) == (channels, data)


def test_a_frame_too_big_is_a_broken_link():
    with pytest.raises(ValueError):
        list(relay_wire.Frames().feed(relay_wire.HEADER.pack(relay_wire.OUT, 1, relay_wire.MAX_PAYLOAD + 1)))


def _nodes(n: int) -> list[Node]:
    return [Node(i, f"w{i}", f"10.0.0.{i}", 22, "u", f"tpu.x-{i}", "ssh-ed25519 AAAA") for i in range(n)]


def _depth(node: Node) -> int:
    return 1 + max((_depth(c) for c in node.children), default=0)


@given(st.integers(1, 2500), st.integers(2, 64), st.integers(1, 8))
@settings(max_examples=150, deadline=None)
def test_a_plan_holds_every_worker_once_in_shallow_trees(n, fanout, roots):
    trees = relay_wire.plan(_nodes(n), fanout, roots=roots)
    assert len(trees) == min(roots, n)
    every = [i for t in trees for i in t.indexes()]
    assert sorted(every) == list(range(n))
    for t in trees:
        for node in t.walk():
            assert len(node.children) <= fanout
        # each level multiplies what a subtree holds by about the fan-out
        size = len(t.indexes())
        assert _depth(t) <= 2 + math.ceil(math.log(size, fanout))


def test_a_plan_travels_whole_and_an_opening_splits_by_subtree():
    (tree,) = relay_wire.plan(_nodes(40), 4, roots=1)
    again = Node.from_wire(tree.to_wire())
    assert [n.to_wire() for n in again.walk()] == [n.to_wire() for n in tree.walk()]
    opening = Opening(["true"], {100 + w: (w, {"W": str(w)}) for w in range(40)})
    parts = [opening.only(lambda w, c=c: w in set(c.indexes())) for c in tree.children]
    got = {c: w for p in parts for c, w in p.workers.items()}
    assert got == {c: w for c, w in opening.workers.items() if w[0] != tree.index}
    assert Opening.from_wire(opening.to_wire()).workers == opening.workers


def test_a_child_whose_bytes_wait_unread_is_not_silent() -> None:
    """A relay gives a child up after its silence, unless what the child sent waits unread in the pipe: then the
    relay's own reader is behind (starved of CPU), the child is not silent. A real pipe, a relay's Child as its
    reader left it."""
    import sys
    import threading
    import types

    sys.path.insert(0, str(WORKER_DIR))
    try:
        import relay
    finally:
        sys.path.remove(str(WORKER_DIR))
    r, w = os.pipe()
    lost: list[str] = []
    child = relay.Child.__new__(relay.Child)
    child.proc = types.SimpleNamespace(stdout=os.fdopen(r, "rb", buffering=0))
    child.relay = types.SimpleNamespace(dead=1.0)
    child.node = types.SimpleNamespace(label="w5")
    child.ready, child.passing, child.gone = threading.Event(), False, ""
    child.ready.set()
    child.heard = time.monotonic() - 5
    child.lose = lost.append
    os.write(w, relay_wire.frame(relay_wire.BEAT))
    child.watch()
    assert lost == []
    os.read(r, 1 << 16)  # read at last: nothing waits, and nothing came for 5 s
    child.watch()
    assert lost == ["relay w5 stopped answering for 1 s"]
    os.close(w)
    child.proc.stdout.close()
