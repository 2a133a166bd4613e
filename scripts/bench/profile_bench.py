#!/usr/bin/env python3
"""What the profiler server tpurun starts in every process of a job costs a step, and what a capture takes
(docs/benchmarks.md, "Profiles (#54)").

It runs `tpurun train --local` of a JAX loop (a jitted 256x256 matmul and tanh, CPU) with `--profile` and with
`--no-profile`, ROUNDS times each, interleaved; each run times STEPS steps after a warm-up and prints its median
step. Then one detached run with the server, captured by `tpurun profile --duration 1s` REPS times: the command's
wall time and the file's size. No root and no emulator: the local pod is this machine (one host; the 2-host
figure of the integration test, tests/integration/test_profile.py, is beside it in the docs). Usage:

    .venv/bin/python scripts/bench/profile_bench.py --rounds 5 --steps 2000 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402

LOOP = r"""
import statistics, sys, time
import jax, jax.numpy as jnp

@jax.jit
def step(x):
    return jnp.tanh(x @ x) * 0.5

x = jnp.ones((256, 256))
for _ in range(50):
    x = step(x).block_until_ready()
steps = int(sys.argv[1])
if steps == 0:
    print("stepping", flush=True)
    while True:
        x = step(x).block_until_ready()
times = []
for _ in range(steps):
    t = time.perf_counter()
    x = step(x).block_until_ready()
    times.append(time.perf_counter() - t)
print("STEP_US", statistics.median(times) * 1e6, flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    tp = common.tpurun_bin()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "loop.py").write_text(LOOP)
        env = {**os.environ, "TPURUN_HOME": str(work / "home")}
        step = {"--profile": [], "--no-profile": []}
        for _ in range(args.rounds):
            for flag in step:
                argv = [*tp, "--plain", "train", "--local", "loop.py", "--runtime", "cpu", flag, "--", str(args.steps)]
                out = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, check=True).stdout
                step[flag].append(float(next(x for x in out.split() if x.replace(".", "").isdigit())))
        argv = [*tp, "train", "--local", "loop.py", "--runtime", "cpu", "--detach", "--", "0"]
        job = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, check=True).stdout.split()[-1]
        deadline = time.monotonic() + 120
        while "stepping" not in subprocess.run([*tp, "logs", job], cwd=work, env=env, capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        walls, sizes = [], []
        try:
            for _ in range(args.reps):
                t = time.monotonic()
                r = subprocess.run([*tp, "profile", job, "--duration", "1s", "--json"], cwd=work, env=env,
                                   capture_output=True, text=True, check=True)  # fmt: skip
                walls.append(time.monotonic() - t)
                sizes.append(json.loads(r.stdout)["bytes"])
        finally:
            subprocess.run([*tp, "cancel", job], cwd=work, env=env, capture_output=True)
    on, off = statistics.median(step["--profile"]), statistics.median(step["--no-profile"])
    print(common.machine_line(common.machine()))
    print("| JAX loop step, median (µs) | with the server | without | difference |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| {args.rounds} runs × {args.steps} steps each | {on:.1f} | {off:.1f} | {100 * (on - off) / off:+.1f}% |")
    print(f"capture of 1 host, 1 s: {statistics.median(walls):.2f} s wall (median of {args.reps}), "
          f"{statistics.median(sizes) / 1e6:.1f} MB")  # fmt: skip


if __name__ == "__main__":
    main()
