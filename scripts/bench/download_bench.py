#!/usr/bin/env python3
"""`tpurun download` against parallel `rsync -a` pulls over ssh, on an emulated v4-32 (4 workers).

Writes on every worker a tree of FILES files and MB megabytes (a checkpoint directory's shape: many
shards), then times, best of REPEAT:

* tpurun: `tpurun download ckpt DEST` (one directory per worker): first download, no-op, and again
  after one file changed on every worker;
* rsync: the same three, one `rsync -a` pull per worker over OpenSSH (tpurun's key, the workers'
  pinned keys, strict checking), all at once, into a directory per worker.

Prints a table, the ratios and the exact commands; needs root (the emulator). Usage:

    sudo .venv/bin/python scripts/bench/download_bench.py [--files 2000] [--mb 100] [--repeat 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402

# run on every worker through `tpurun exec`: the tree, its files an hour old
_MAKE = """
import os, sys, time
files, size = int(sys.argv[1]), int(sys.argv[2])
for i in range(files):
    d = os.path.expanduser(f"~/ckpt/shard{i % 20:02d}")
    os.makedirs(d, exist_ok=True)
    with open(f"{d}/part{i:05d}.bin", "wb") as f:
        f.write(os.urandom(size))
old = time.time() - 3600
for root, _, names in os.walk(os.path.expanduser("~/ckpt")):
    for n in names:
        os.utime(os.path.join(root, n), (old, old))
"""
_CHANGE = "import os; p = os.path.expanduser('~/ckpt/shard00/part00000.bin'); d = open(p, 'rb').read(); open(p, 'wb').write(d[::-1])"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4, choices=sorted(common.V4_FOR_WORKERS))
    ap.add_argument("--json", type=Path, help="Also write the results here.")
    args = ap.parse_args()

    with common.bench_emulator() as bench:
        node = bench.create(args.workers)
        tpu = ("--tpu", node.name)
        bench.tpurun("exec", *tpu, "--", "python3", "-c", _MAKE, str(args.files), str(args.mb * 1_000_000 // args.files))
        ssh_e = shlex.join(["ssh", *bench.ssh_options()])
        out = bench.home / "downloads"
        rnd = [0]

        def tpurun_download() -> None:
            bench.tpurun("download", *tpu, "--json", "ckpt", str(out / f"tpurun-r{rnd[0]}"))

        def rsync_all() -> None:
            procs = []
            for i, address in enumerate(node.workers):
                dest = out / f"rsync-r{rnd[0]}" / f"w{i}"
                dest.mkdir(parents=True, exist_ok=True)
                argv = ["rsync", "-a", "-e", ssh_e, f"{node.user}@{address}:/root/ckpt", f"{dest}/"]
                procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            for p in procs:
                _, err = p.communicate()
                if p.returncode:
                    raise SystemExit(f"rsync failed: {err.decode()}")

        results: dict[str, dict[str, float]] = {"tpurun download": {}, "rsync -a pull xN": {}}
        for round_ in range(args.repeat):
            rnd[0] = round_
            for name, fn in (("tpurun download", tpurun_download), ("rsync -a pull xN", rsync_all)):
                first = common.seconds(fn)
                noop = common.seconds(fn)
                bench.tpurun("exec", *tpu, "--", "python3", "-c", _CHANGE)
                one = common.seconds(fn)
                for k, v in (("first", first), ("no-op", noop), ("one file", one)):
                    results[name][k] = min(results[name].get(k, 1e9), v)
        n = len(node.workers)
        print(
            f"\n{args.files} files, {args.mb} MB on each of {n} workers ({common.V4_FOR_WORKERS[n]}), "
            f"best of {args.repeat}, {os.cpu_count()} CPUs"
        )
        print(f"{'':18}{'first':>10}{'no-op':>10}{'one file':>10}")
        for name, row in results.items():
            print(f"{name:18}" + "".join(f"{row[k]:>9.2f}s" for k in ("first", "no-op", "one file")))
        t, rs = results["tpurun download"], results["rsync -a pull xN"]
        ratios = {k: round(t[k] / rs[k], 2) for k in ("first", "no-op", "one file")}
        print(f"{'ratio':18}" + "".join(f"{ratios[k]:>9.2f}x" for k in ("first", "no-op", "one file")))
        print(f"\ntpurun: tpurun download --tpu {node.name} --json ckpt DEST   (every worker: DEST/wN/ckpt)")
        print(f"rsync : rsync -a -e '{ssh_e}' root@ADDR:/root/ckpt DEST/wN/   (x{n}, at once)")
        if args.json:
            doc = {"files": args.files, "mb": args.mb, "workers": n, "repeat": args.repeat, "seconds": results}
            common.write_json(args.json.resolve(), {**doc, "ratio": ratios, "machine": common.machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
