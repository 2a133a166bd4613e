"""The rendezvous watch: the hook's reports of where a process waits for the others, through the real agent
with the runtimes' own code (torch.distributed over gloo, jax.distributed), and who `Watch` then names."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.test_agent import RUN, agent, home, script, start, state, wait_over  # noqa: F401  (home: fixture)
from tpurun.job.watch import WAIT_SHOWN_AFTER, Watch
from tpurun.transport.runner import Worker
from tpurun.worker import AGENT_PATH, protocol

TORCH_RANKS = """
    import os, time
    import torch
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    if rank == 1:
        print("rank 1 dawdles", flush=True)
        time.sleep(float(os.environ["DAWDLE"]))
    dist.init_process_group("gloo", init_method=os.environ["INIT"], rank=rank, world_size=2)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.all_reduce(t)
    print("sum", t.item(), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def passages(st: dict) -> dict[int, list[protocol.Passage]]:
    return {s.slot: s.passages for s in protocol.JobState.from_dict(st).slots}


def test_torch_ranks_report_their_passages_and_the_one_that_dawdles_is_seen_missing(
    home: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    p = script(tmp_path, "ranks.py", TORCH_RANKS)
    init = f"tcp://127.0.0.1:{free_port()}"
    cores = [
        {"core": r, "argv": [sys.executable, p], "env": {"RANK": str(r), "INIT": init, "DAWDLE": "4"}} for r in (0, 1)
    ]
    job = f"rv1-{RUN}"
    start(home, job, cores, launch="chip")
    deadline = time.time() + 60
    while time.time() < deadline:  # rank 0 inside init_process_group, rank 1 not there yet
        seen = passages(state(home, job))
        if seen.get(0):
            break
        time.sleep(0.1)
    assert [(x.at, x.left) for x in seen[0]] == [("torch.distributed.init_process_group", None)], seen
    assert not seen.get(1)
    st = wait_over(home, job, timeout=120)
    assert st["status"] == "finished", (home / ".tpurun" / "jobs" / job / "supervisor.log").read_text()
    seen = passages(st)
    for rank in (0, 1):
        assert [x.at for x in seen[rank]] == [
            "torch.distributed.init_process_group",
            "first collective: torch.distributed.all_reduce",  # the first only: the second is not reported
        ], seen[rank]
        assert all(x.left is not None and x.left >= x.entered for x in seen[rank])
    init0, init1 = seen[0][0], seen[1][0]
    assert init1.entered - init0.entered > 3  # rank 0 waited for the dawdler ...
    assert abs(init0.left - init1.left) < 2  # ... and both left together

    # `stream` sends each process's passages as they change, with its lines
    r = subprocess.run([sys.executable, str(AGENT_PATH), "stream", job], capture_output=True, env=_env(home))
    recs = [protocol.decode(line) for line in r.stdout.splitlines()]
    sent = {rec.slot: rec.passages for rec in recs if isinstance(rec, protocol.Passages)}
    assert sent == seen


def test_a_host_process_reports_jax_distributed_initialize(home: Path, tmp_path: Path) -> None:  # noqa: F811
    p = script(
        tmp_path,
        "jx.py",
        """
        import os, jax
        jax.distributed.initialize(os.environ["COORD"], num_processes=1, process_id=0)
        print("processes", jax.process_count(), flush=True)
        """,
    )
    job = f"rv2-{RUN}"
    start(
        home,
        job,
        [{"core": protocol.HOST, "argv": [sys.executable, p], "env": {"COORD": f"127.0.0.1:{free_port()}"}}],
        launch="host",
    )
    st = wait_over(home, job, timeout=120)
    assert st["status"] == "finished", (home / ".tpurun" / "jobs" / job / "w0.log").read_text()
    (only,) = passages(st)[protocol.HOST]
    assert only.at == "jax.distributed.initialize" and only.left is not None


def _env(where: Path) -> dict[str, str]:
    import os

    return dict(os.environ, HOME=str(where))


# ---------------------------------------------------------------- who Watch names

WORKERS = [Worker(i, f"127.0.0.{10 + i}") for i in range(4)]
T0 = 1_000_000.0


def watch_with(entered: dict[tuple[int, int], tuple[float, float | None]], at: str = "jax.distributed.initialize"):
    w = Watch(WORKERS)
    for (worker, slot), (t, left) in entered.items():
        w.take(protocol.Passages(worker, slot, [protocol.Passage(at, t, left)]))
    return w


def test_a_host_that_never_arrives_is_named_with_its_address_and_last_line() -> None:
    w = watch_with({(i, protocol.HOST): (T0 + i, None) for i in (0, 1, 3)})
    w.lines(2, protocol.HOST, "sleeping before initialize", T0 - 5)
    assert w.waiting(T0 + WAIT_SHOWN_AFTER - 1) is None  # not yet: start-up skew is normal
    got = w.waiting(T0 + 40)
    assert got is not None and (got.at, got.arrived, got.expected) == ("jax.distributed.initialize", 3, 4)
    assert [(m.name, m.address, m.last_line, m.quiet_for) for m in got.missing] == [
        ("w2", "127.0.0.12", "sleeping before initialize", 45.0)
    ]
    assert got.text() == (
        "waiting at jax.distributed.initialize for 40 s: 3 of 4 processes in; not there: w2 (127.0.0.12), "
        "last line 45 s ago: 'sleeping before initialize'"
    )
    assert json.loads(json.dumps(got.to_dict()))["missing"][0]["name"] == "w2"


def test_chip_processes_missing_on_one_worker_are_named_each_and_a_silent_worker_once() -> None:
    got_in = {(w, c): (T0, None) for w in (0, 1) for c in range(4)}
    got_in |= {(2, c): (T0, None) for c in (0, 1, 3)}
    w = watch_with(got_in, at="xm.rendezvous('init')")
    got = w.waiting(T0 + 30)
    assert got is not None and (got.arrived, got.expected) == (11, 16)
    assert [(m.name, m.last_line) for m in got.missing] == [("w2/c2", None), ("w3", None)]
    assert "w3 (127.0.0.13), nothing printed yet" in got.text()


def test_a_process_that_met_the_others_before_and_not_now_is_missing_on_its_own_worker_too() -> None:
    w = watch_with({(0, c): (T0, T0 + 1) for c in range(3)}, at="torch.distributed.init_process_group")
    for c in (0, 2):
        w.take(
            protocol.Passages(
                0,
                c,
                [
                    protocol.Passage("torch.distributed.init_process_group", T0, T0 + 1),
                    protocol.Passage("first collective: torch.distributed.all_reduce", T0 + 1),
                ],
            )
        )
    got = w.waiting(T0 + 30)
    # c1 of w0 met the others at init_process_group, not at the collective; the other workers run nothing
    assert got is not None and [m.name for m in got.missing] == ["w0/c1", "w1", "w2", "w3"]


def test_a_passage_of_an_earlier_round_does_not_count_as_arrived() -> None:
    w = watch_with({(0, 0): (T0 + 100, None), (1, 0): (T0, T0 + 1)}, at="xm.rendezvous('epoch')")
    got = w.waiting(T0 + 130)
    assert got is not None and [m.name for m in got.missing] == ["w1/c0", "w2/c0", "w3/c0"]
    # all through this round: nobody waits
    done = watch_with({(i, 0): (T0 + 100, T0 + 101) for i in range(4)})
    assert done.waiting(T0 + 500) is None


@pytest.mark.parametrize("left", [None, T0 + 2])
def test_nobody_missing_is_not_a_wait_for_others(left: float | None) -> None:
    w = watch_with({(i, protocol.HOST): (T0, left) for i in range(4)})
    assert w.waiting(T0 + 100) is None


def running_state(cores: list[dict]) -> protocol.JobState:
    return protocol.JobState.from_dict({"status": "running", "cores": cores})


def test_the_state_a_worker_keeps_gives_the_same_answer() -> None:
    w = Watch(WORKERS[:2])
    w.take_state(
        0,
        running_state(
            [  # the state as state.json has it
                {
                    "core": -1,
                    "last_line": "in",
                    "last_line_at": T0,
                    "passages": [{"at": "torch.distributed.init_process_group", "entered": T0, "left": None}],
                }
            ]
        ),
    )
    w.take_state(1, running_state([{"core": -1, "last_line": "loading data", "last_line_at": T0 - 3, "passages": []}]))
    got = w.waiting(T0 + 20)
    assert got is not None and [(m.name, m.last_line, m.quiet_for) for m in got.missing] == [
        ("w1", "loading data", 23.0)
    ]
