#!/usr/bin/env python3
"""The hook's cost per Python process: how much longer a Python process of a job takes to start and end
when tpurun's hook gives it channels of its own (docs/benchmarks.md, "One road to every worker (#41)").

It runs `tpurun train --local` of a script that starts `python3 -c pass` (and `python3 -c "import json"`)
REPS times each with the job's own environment (the hook first on PYTHONPATH, TPURUN_STDIO naming the
inherited channels: the hook connects the child's stdout and stderr to the supervisor) and with the hook
taken out (the same variables without the hook's directory and TPURUN_STDIO), interleaved, and prints the
medians. Bytecode is cached (PYTHONDONTWRITEBYTECODE is taken out of the job's environment). No root
and no emulator: the local pod is this machine. Usage:

    .venv/bin/python scripts/bench/hook_bench.py --reps 200
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402

# what the job's host process runs: children started with and without the hook, interleaved
_SCRIPT = r"""
import os, statistics, subprocess, sys, time
reps = int(sys.argv[1])
hooked = dict(os.environ)
path = hooked.get("PYTHONPATH", "").split(os.pathsep)
hook_dirs = [p for p in path if p and os.path.exists(os.path.join(p, "sitecustomize.py"))]
assert hook_dirs, "not a tpurun job: no hook on PYTHONPATH"
bare = {k: v for k, v in hooked.items() if k != "TPURUN_STDIO"}
bare["PYTHONPATH"] = os.pathsep.join(p for p in path if p and p not in hook_dirs)
bodies = ("pass", "import json")
times = {(body, name): [] for body in bodies for name in ("hook", "bare")}
for _ in range(reps):
    for body in bodies:
        for name, env in (("hook", hooked), ("bare", bare)):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", body], env=env, check=True)
            times[(body, name)].append((time.perf_counter() - t) * 1000)
for body in bodies:
    h, b = statistics.median(times[(body, "hook")]), statistics.median(times[(body, "bare")])
    print(f"RESULT|{body}|{h:.2f}|{b:.2f}|{h - b:.2f}")
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp, "hook_cost.py")
        script.write_text(_SCRIPT)
        argv = [*common.tpurun_bin(), "--plain", "train", "--local", script.name, str(args.reps)]
        argv += ["--runtime", "cpu", "--cores", "1", "--python", sys.executable]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # bytecode cached, as usual
        out = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True)
    rows = [line.split("RESULT|", 1)[1].split("|") for line in out.stdout.splitlines() if "RESULT|" in line]
    if out.returncode or len(rows) != 2:
        sys.stderr.write(out.stdout[-2000:] + out.stderr[-2000:])
        return 1
    print(common.machine_line(common.machine()))
    print()
    print(f"A child Python started by a job's process on the local pod, {args.reps} runs each, medians (ms):")
    print()
    print("| child runs | with the hook | without | the hook's cost |")
    print("| --- | ---: | ---: | ---: |")
    for body, hook, bare, cost in rows:
        print(f"| `python -c '{body}'` | {hook} | {bare} | {cost} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
