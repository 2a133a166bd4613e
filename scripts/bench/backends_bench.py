"""Both APIs: create-to-usable and train-to-every-process-started for v5p slices of 1, 4 and 16 VMs, made by
the Cloud TPU API (a node) and by Compute Engine (one instance; a MIG with its workload policy and template).

    sudo .venv/bin/python scripts/bench/backends_bench.py            # 2 rounds; writes docs/bench/backends.json
    sudo .venv/bin/python scripts/bench/backends_bench.py --reps 1 --no-write

One run against the emulator in this process, zero API delays on both fronts, so what differs is what
tpurun asks of each API (Compute Engine takes a policy, a template and a group, then lists the group's
VMs and reads each VM's guest attributes on its own) and the workers' boot. Each round makes every
(backend, size) once, in a rotated order:

- create: `tpurun create NAME -t v5p-N --backend B` until it returns (every VM booted, its startup script
  done, its host key pinned), then `tpurun exec -- true` on every worker (the first command that uses them,
  which asks the API where the workers are);
- train: `tpurun train start.py --runtime cpu --launch host`: invocation to the last process's first line
  (the script prints time.time() first; emulated workers share this machine's clock), and to tpurun's exit.

The Cloud TPU API's node of the same size is the floor each Compute Engine row is divided by.
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
SIZES = {"v5p-8": 1, "v5p-32": 4, "v5p-128": 16}  # accelerator type: VMs
BACKENDS = ("tpu-api", "compute")


def run(bench: common.Bench, jobs: Path, backend: str, kind: str) -> dict[str, float] | None:
    """Seconds to usable, of the first exec, to every process started and to tpurun's exit."""
    name = f"{'gce' if backend == 'compute' else 'tpu'}{SIZES[kind]}"
    t0 = time.perf_counter()
    bench.tpurun("create", name, "-t", kind, "--backend", backend)
    made = time.perf_counter() - t0
    t1 = time.perf_counter()
    bench.tpurun("exec", "--tpu", name, "--", "true")
    first = time.perf_counter() - t1
    argv = [
        *common.tpurun_bin(), "--plain", "train", "start.py", "--tpu", name, "--runtime", "cpu",
        "--launch", "host", "--python", common.WORKER_PYTHON,
    ]  # fmt: skip
    t2 = time.time()
    with tempfile.TemporaryFile("w+") as f:
        s = common.timed_to(argv, f, bench.env, jobs)
        f.seek(0)
        starts = [float(m.group(1)) for m in re.finditer(r"\] S (\S+) \d+", f.read())]
    bench.tpurun("delete", name, "--yes", check=False)
    if s.code or len(starts) != SIZES[kind]:
        print(f"  ! {backend} {kind}: {len(starts)} processes reported, exit {s.code}", file=sys.stderr)
        return None
    return {"create": made, "exec": first, "started": max(starts) - t2, "exit": s.wall}


def render(res: dict[str, Any]) -> str:
    ms = common.ms_cell

    def ratio(a: dict[str, float], b: dict[str, float]) -> str:
        return f"{a['median'] / b['median']:.2f}x" if a and b else "-"

    lines = [
        common.measured(res, f"{res['reps']} rounds, order rotated each round"),
        "",
        "| type | VMs | made by | create to usable, ms | first `exec -- true`, ms | train: every process started, "
        "ms | train: tpurun exit, ms | create / Cloud TPU API | started / Cloud TPU API |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind, vms in SIZES.items():
        floor = res["runs"][f"tpu-api {kind}"]
        for backend in BACKENDS:
            r = res["runs"][f"{backend} {kind}"]
            lines.append(
                f"| {kind} | {vms} | {backend} | {ms(r['create'])} | {ms(r['exec'])} | {ms(r['started'])} | "
                f"{ms(r['exit'])} | {ratio(r['create'], floor['create'])} | {ratio(r['started'], floor['started'])} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    t0 = time.monotonic()
    res = common.record(__file__, reps=args.reps)
    cases = [(b, k) for k in SIZES for b in BACKENDS]
    samples: dict[str, dict[str, list[float]]] = {f"{b} {k}": {} for b, k in cases}
    with common.bench_emulator() as bench:
        jobs = bench.job_dir(start=START)
        for rnd in range(args.reps):
            for backend, kind in cases[rnd % len(cases) :] + cases[: rnd % len(cases)]:
                got = run(bench, jobs, backend, kind)
                for key, value in (got or {}).items():
                    samples[f"{backend} {kind}"].setdefault(key, []).append(value)
                print(f"round {rnd + 1}: {backend} {kind}: {got}", flush=True)
    res["runs"] = {
        case: {k: common.spread(v.get(k, [])) for k in ("create", "exec", "started", "exit")}
        for case, v in samples.items()
    }
    res["seconds"] = time.monotonic() - t0
    common.publish(
        res,
        render(res),
        "backends",
        "### Both APIs: v5p through the Cloud TPU API and Compute Engine",
        write=not args.no_write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
