#!/usr/bin/env python3
"""Launch models benchmark: `tpurun train` start-up and stop latency, host launch vs chip launch.

On emulated v4 nodes of 8 and 32 workers (4 chips per host), in one run, interleaved:

* chip launch (what `tpurun train` did before host launch existed): tpurun starts one process per
  chip, each prints `S <time.time()>` as its first line;
* host launch (the default now on TPUs): tpurun starts one process per worker, whose process pool
  starts one process per chip and sets PJRT_LOCAL_PROCESS_RANK in each, as xmp.spawn does; each
  chip process then prints `S <time>` (through tpurun's hook and the agent's log socket).

* floor: the same spawner script run by `tpurun exec -- python3 host.py` (one SSH command per worker,
  no agent, no per-chip logs): what the spawner itself costs, so host launch / floor is tpurun's share.

All use the workers' own python3 and the standard library only, so the numbers are tpurun's cost,
not torch_xla's import (which is the same per chip process in both, plus one import per host in host
launch). Emulated workers share this machine's clock, so "every replica started" = the latest `S`
time - the time tpurun was invoked.

Stop latency (8 workers x 4 chips, host launch): one chip process raises one second after all have
started (printing `F <time>` just before); measured is the time from then to the last process of
the job gone from every worker (found by the TPURUN_JOB_ID each inherits), and to tpurun's exit.

Writes docs/bench/launch_model.json and a section of docs/benchmarks.md. Needs root (the emulator).
    sudo .venv/bin/python scripts/bench/launch_model_bench.py [--reps 5] [--stop-reps 10] [--sizes 8,32]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402

CHIP = """
import sys, time
print("S", time.time(), flush=True)
"""

HOST = """
import concurrent.futures, multiprocessing, os, sys, time

def replica(rank):
    os.environ.setdefault("PJRT_LOCAL_PROCESS_RANK", str(rank))  # what torch_xla's spawner sets first
    print("S", time.time(), flush=True)
    if sys.argv[1:] == ["fail"]:
        time.sleep(1.0)
        if os.environ["TPURUN_WORKER_ID"] == "1" and rank == 0:
            print("F", time.time(), flush=True)
            raise RuntimeError("replica failed")
        time.sleep(600)
    time.sleep(0.2)  # replicas run side by side, as real ones do
    return rank

if __name__ == "__main__":
    with concurrent.futures.ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(replica, range(4)))
"""

S_RE = re.compile(r"^\[w\d+(?:/c\d+)?\] S (\S+)$", re.M)


def stats(xs: list[float]) -> dict[str, Any]:
    xs = sorted(xs)
    if not xs:
        return {"n": 0}
    p95 = xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]
    return {"n": len(xs), "median": statistics.median(xs), "p95": p95, "min": xs[0], "max": xs[-1]}


class LaunchBench:
    def __init__(self, bench: common.Bench, args: argparse.Namespace, jobs: Path) -> None:
        self.bench, self.args, self.jobs = bench, args, jobs

    def argv(self, node: common.Node, launch: str, *extra: str) -> list[str]:
        script = "host.py" if launch == "host" else "chip.py"
        cores = ["--cores", "4"] if launch == "chip" else []
        return [
            *common.tpurun_bin(), "train", script, *extra, "--tpu", node.name, "--runtime", "cpu",
            "--launch", launch, *cores, "--python", common.WORKER_PYTHON, "--grace", "2",
        ]  # fmt: skip

    def start_once(self, node: common.Node, launch: str) -> float | None:
        want = len(node.workers) * 4
        t0 = time.time()
        if launch == "floor":
            argv = [*common.tpurun_bin(), "exec", "--tpu", node.name, "--", "sh", "-c", "cd ~/jobs && python3 host.py"]
        else:
            argv = self.argv(node, launch)
        with tempfile.TemporaryFile("w+") as f:
            s = common.timed_to(argv, f, self.bench.env, self.jobs)
            f.seek(0)
            starts = [float(x) for x in S_RE.findall(f.read())]
        if len(starts) != want or s.code:
            print(f"  ! {launch}: {len(starts)}/{want} replicas started, exit {s.code}", file=sys.stderr)
            return None
        return max(starts) - t0

    def start(self, node: common.Node) -> dict[str, Any]:
        got: dict[str, list[float]] = {"chip": [], "host": [], "floor": []}
        order = list(got)
        self.bench.tpurun("sync", "--tpu", node.name, str(self.jobs), "--dest", "~/jobs")  # for the floor
        for rnd in range(1 + self.args.reps):
            k = rnd % len(order)
            for launch in order[k:] + order[:k]:
                t = self.start_once(node, launch)
                if rnd and t is not None:
                    got[launch].append(t)
        out = {k: stats(v) for k, v in got.items()}
        for k, v in out.items():
            print(f"  {len(node.workers):>3} workers {k:>5}: every replica started median "
                  f"{v['median'] * 1000:.0f} ms [{v['min'] * 1000:.0f}-{v['max'] * 1000:.0f}]", flush=True)  # fmt: skip
        return out

    def job_processes(self, node: common.Node) -> int:
        from tpurun.emulator import procs

        hosts = self.bench.server.emu.hosts
        key = f"projects/{common.PROJECT}/locations/{common.ZONE}/nodes/{node.name}"
        nss = {hosts._worker(key, i).pid_ns for i in range(len(node.workers))} - {None}
        n = 0
        for pid in procs.all_pids():
            if procs.ns(pid) not in nss:
                continue
            try:
                if b"\0TPURUN_JOB_ID=" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes():
                    n += 1
            except OSError:
                pass
        return n

    def stop_once(self, node: common.Node) -> dict[str, float] | None:
        want = len(node.workers) * 4
        proc = subprocess.Popen(
            self.argv(node, "host", "fail"), env=self.bench.env, cwd=self.jobs, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        started, failed_at = [0], [0.0]

        def reader() -> None:
            assert proc.stdout
            for line in proc.stdout:
                if " S " in line:
                    started[0] += 1
                elif " F " in line:
                    failed_at[0] = float(line.split()[-1])

        threading.Thread(target=reader, daemon=True).start()
        deadline = time.time() + 120
        while not failed_at[0] and time.time() < deadline and proc.poll() is None:
            time.sleep(0.005)
        if not failed_at[0] or started[0] != want:
            proc.kill()
            print(f"  ! stop: {started[0]}/{want} started, failure seen: {bool(failed_at[0])}", file=sys.stderr)
            return None
        gone = None
        while time.time() < deadline:
            if self.job_processes(node) == 0:
                gone = time.time()
                break
            time.sleep(0.01)
        code = proc.wait(timeout=120)
        exited = time.time()
        if gone is None:
            return None
        return {"gone": gone - failed_at[0], "exit": exited - failed_at[0], "code": code}

    def stop(self, node: common.Node) -> dict[str, Any]:
        runs = [r for r in (self.stop_once(node) for _ in range(self.args.stop_reps)) if r]
        out = {
            "gone": stats([r["gone"] for r in runs]),
            "exit": stats([r["exit"] for r in runs]),
            "exit_codes": sorted({int(r["code"]) for r in runs}),
        }
        print(f"  stop after a chip process fails: last process gone p50 {out['gone']['median'] * 1000:.0f} ms "
              f"p95 {out['gone']['p95'] * 1000:.0f} ms; tpurun exit p50 {out['exit']['median'] * 1000:.0f} ms; "
              f"exit codes {out['exit_codes']}", flush=True)  # fmt: skip
        return out


def render(res: dict[str, Any]) -> str:
    lines = [
        common.measured(res, f"{res['reps']} interleaved repetitions after one warm-up round"),
        "",
        "| workers | chips | chip launch (before) | host launch (now) | floor: the spawner by `tpurun exec` | host / chip | host / floor |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for size, r in res["start"].items():
        c, h, f = r["chip"], r["host"], r["floor"]

        def cell(x: dict[str, Any]) -> str:
            return f"{x['median'] * 1000:.0f} ms [{x['min'] * 1000:.0f}–{x['max'] * 1000:.0f}]"

        lines.append(
            f"| {size} | {int(size) * 4} | {cell(c)} | {cell(h)} | {cell(f)} | {h['median'] / c['median']:.2f}× "
            f"| {h['median'] / f['median']:.2f}× |"
        )
    s = res["stop"]
    lines += [
        "",
        f"Stop after one chip process of a host launch fails ({s['workers']} workers × 4 chips, {s['gone']['n']} runs): "
        f"last process of the job gone from every worker p50 {s['gone']['median'] * 1000:.0f} ms, "
        f"**p95 {s['gone']['p95'] * 1000:.0f} ms** (target ≤ 2 s); tpurun's exit p50 "
        f"{s['exit']['median'] * 1000:.0f} ms, p95 {s['exit']['p95'] * 1000:.0f} ms; exit codes {s['exit_codes']}.",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--stop-reps", type=int, default=10)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    t0 = time.monotonic()
    res = common.record(__file__, reps=args.reps, start={})
    with common.bench_emulator() as bench:
        jobs = bench.job_dir(chip=CHIP, host=HOST)
        lb = LaunchBench(bench, args, jobs)
        for size in [int(x) for x in args.sizes.split(",")]:
            node = bench.create(size)
            res["start"][str(size)] = lb.start(node)
            if size == 8:
                res["stop"] = {**lb.stop(node), "workers": size}
            bench.delete(node)
    res["seconds"] = time.monotonic() - t0
    if not args.no_write:
        common.write_json(common.BENCH_DOCS / "launch_model.json", res)
        common.replace_section(
            common.DOCS / "benchmarks.md", "launch-model", render(res), "### Launch models: host vs chip launch"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
