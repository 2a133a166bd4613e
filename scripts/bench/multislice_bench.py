"""Multislice: create-to-usable and train-to-every-process-started for 1, 2 and 4 slices of v4-16.

    sudo .venv/bin/python scripts/bench/multislice_bench.py            # 3 rounds; writes docs/bench/multislice.json
    sudo .venv/bin/python scripts/bench/multislice_bench.py --reps 1 --no-write

One run against the emulator in this process (zero API delays: what is measured is tpurun, the queued
resource's scheduling and the workers' boot). Each round makes every size once, in a rotated order:

- create: `tpurun create NAME -t v4-16 [--slices N]` until it returns, i.e. every worker of every slice
  booted, its startup script done and its host key pinned; then `tpurun exec -- true` on every worker
  (the first command that uses them).
- train: `tpurun train start.py --runtime cpu --launch host` (one process per host; the script's first
  statement prints time.time(), and emulated workers share this machine's clock): invocation to the last
  process's first line, and to tpurun's exit.

The one-slice v4-16 is the floor: the table gives each size's ratio to it (N slices have N times its
workers, booted by one queued resource).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402

START = """import os, time
print("S", repr(time.time()), os.environ["TPURUN_WORKER_ID"], flush=True)
"""
SLICES = (1, 2, 4)


def create(bench: common.Bench, slices: int) -> tuple[float, float]:
    """(seconds to a usable TPU, seconds of the first exec on every worker)."""
    name = f"ms{slices}"
    extra = ["--slices", str(slices)] if slices > 1 else []
    t0 = time.perf_counter()
    bench.tpurun("create", name, "-t", "v4-16", *extra)
    made = time.perf_counter() - t0
    t1 = time.perf_counter()
    bench.tpurun("exec", "--tpu", name, "--", "true")
    return made, time.perf_counter() - t1


def train(bench: common.Bench, jobs: Path, slices: int) -> tuple[float, float] | None:
    """(seconds to every process's first line, seconds to tpurun's exit); None if a process was missing."""
    argv = [
        *common.tpurun_bin(), "--plain", "train", "start.py", "--tpu", f"ms{slices}", "--runtime", "cpu",
        "--launch", "host", "--python", common.WORKER_PYTHON,
    ]  # fmt: skip
    t0 = time.time()
    with tempfile.TemporaryFile("w+") as f:
        s = common.timed_to(argv, f, bench.env, jobs)
        f.seek(0)
        starts = [float(m.group(1)) for m in re.finditer(r"\] S (\S+) \d+", f.read())]
    if s.code or len(starts) != 2 * slices:
        print(f"  ! train on {slices} slice(s): {len(starts)} processes reported, exit {s.code}", file=sys.stderr)
        return None
    return max(starts) - t0, s.wall


def render(res: dict[str, Any]) -> str:
    ms = common.ms_cell

    base = res["sizes"]["1"]
    lines = [
        common.measured(res, f"{res['reps']} rounds, sizes rotated each round"),
        "",
        "| slices of v4-16 | workers | create to usable, ms | first `exec -- true`, ms | train: every process "
        "started, ms | train: tpurun exit, ms | create / 1 slice | started / 1 slice |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in SLICES:
        r = res["sizes"][str(n)]
        ratio_c = r["create"]["median"] / base["create"]["median"]
        ratio_s = r["started"]["median"] / base["started"]["median"] if r["started"] else float("nan")
        lines.append(
            f"| {n} | {2 * n} | {ms(r['create'])} | {ms(r['exec'])} | {ms(r['started'])} | {ms(r['exit'])} | "
            f"{ratio_c:.2f}x | {ratio_s:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    t0 = time.monotonic()
    res = common.record(__file__, reps=args.reps, sizes={})
    samples: dict[int, dict[str, list[float]]] = {n: {"create": [], "exec": [], "started": [], "exit": []} for n in SLICES}
    with common.bench_emulator() as bench:
        jobs = bench.job_dir(start=START)
        for rnd in range(args.reps):
            order = SLICES[rnd % len(SLICES) :] + SLICES[: rnd % len(SLICES)]
            for n in order:
                made, first = create(bench, n)
                got = train(bench, jobs, n)
                bench.tpurun("delete", f"ms{n}", "--yes", check=False)
                samples[n]["create"].append(made)
                samples[n]["exec"].append(first)
                if got:
                    samples[n]["started"].append(got[0])
                    samples[n]["exit"].append(got[1])
                print(f"round {rnd + 1}: {n} slice(s): create {made:.2f} s, exec {first:.2f} s, train {got}", flush=True)
    res["sizes"] = {str(n): {k: common.spread(v) for k, v in samples[n].items()} for n in SLICES}
    res["seconds"] = time.monotonic() - t0
    common.publish(res, render(res), "multislice", "### Multislice: 1, 2 and 4 slices", write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
