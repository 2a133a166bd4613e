#!/usr/bin/env python3
"""`tpurun download` against parallel `rsync -a` pulls over ssh, on an emulated v4-32 (4 workers).

Starts the emulator (`tpurun emulator start`), creates a v4-32, writes on every worker a tree of
FILES files and MB megabytes (a checkpoint directory's shape: many shards), then times, best of REPEAT:

* tpurun: `tpurun download ckpt out` (one directory per worker): first download, no-op, and again
  after one file changed on every worker;
* rsync: the same three, one `rsync -a -e 'ssh -i KEY ... -o HostKeyAlias=...'` pull per worker, all
  at once, into a directory per worker.

Prints a table, the ratios and the exact commands; needs root (the emulator). Usage:

    sudo .venv/bin/python scripts/bench/download_bench.py [--files 2000] [--mb 100] [--repeat 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# run on every worker through `tpurun exec`: the tree, files older than a few seconds
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
_TOUCH = "import os; p = os.path.expanduser('~/ckpt/shard00/part00000.bin'); d = open(p, 'rb').read(); open(p, 'wb').write(d[::-1])"


def sh(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, check=False)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--accelerator-type", default="v4-32")
    ap.add_argument("--json", type=Path, help="Also write the results here.")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tpurun-dlbench-"))
    home, work, state = tmp / "home", tmp / "work", tmp / "emu"
    home.mkdir()
    work.mkdir()
    env = dict(os.environ)
    env.pop("TPURUN_TPU", None)
    env.update(
        {
            "HOME": str(home),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "TPURUN_HOME": str(home / ".tpurun"),
            "TPURUN_SSH_USER": "root",
            "TPURUN_POLL_INTERVAL": "0.1",
            "TPURUN_PROJECT": "bench-project",
            "TPURUN_ZONE": "us-central2-b",
        }
    )
    tpurun = [sys.executable, "-m", "tpurun"]
    r = sh([*tpurun, "emulator", "start", "--state-dir", str(state)], env)
    if r.returncode:
        print(r.stdout, r.stderr, file=sys.stderr)
        return 1
    env["TPURUN_API_ENDPOINT"] = r.stdout.strip().splitlines()[-1].split("=", 1)[1]
    try:
        r = sh([*tpurun, "create", "bench", "-t", args.accelerator_type, "--json"], env, cwd=work)
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return 1
        created = json.loads(r.stdout)
        addresses = [w["internalIp"] for w in created["workerEndpoints"]]
        size = args.mb * 1_000_000 // args.files
        r = sh([*tpurun, "exec", "--", "python3", "-c", _MAKE, str(args.files), str(size)], env, cwd=work)
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return 1
        key = home / ".tpurun" / "ssh" / "id_ed25519"
        known = home / ".tpurun" / "ssh" / "known_hosts"
        ssh_e = f"ssh -i {key} -o IdentitiesOnly=yes -o UserKnownHostsFile={known} -o StrictHostKeyChecking=yes"
        alias = {a: f" -o HostKeyAlias=tpu.{created['id']}-{i}" for i, a in enumerate(addresses)}
        rnd = [0]

        def tpurun_download() -> None:
            r = sh([*tpurun, "download", "--json", "ckpt", f"out-r{rnd[0]}"], env, cwd=work)
            if r.returncode:
                raise SystemExit(f"tpurun download failed: {r.stderr}")

        def rsync_all() -> None:
            procs = []
            for i, a in enumerate(addresses):
                dest = work / f"rsync-r{rnd[0]}" / f"w{i}"
                dest.mkdir(parents=True, exist_ok=True)
                procs.append(
                    subprocess.Popen(
                        ["rsync", "-a", "-e", ssh_e + alias[a], f"root@{a}:/root/ckpt", f"{dest}/"],
                        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                    )  # fmt: skip
                )
            for p in procs:
                _, err = p.communicate()
                if p.returncode:
                    raise SystemExit(f"rsync failed: {err.decode()}")

        def touch_one() -> None:
            r = sh([*tpurun, "exec", "--", "python3", "-c", _TOUCH], env, cwd=work)
            if r.returncode:
                raise SystemExit(f"could not change a file: {r.stderr}")

        results: dict[str, dict[str, float]] = {"tpurun download": {}, "rsync -a pull xN": {}}
        for round_ in range(args.repeat):
            rnd[0] = round_
            for name, fn in (("tpurun download", tpurun_download), ("rsync -a pull xN", rsync_all)):
                first = timed(fn)
                noop = timed(fn)
                touch_one()
                one = timed(fn)
                for k, v in (("first", first), ("no-op", noop), ("one file", one)):
                    results[name][k] = min(results[name].get(k, 1e9), v)
        n = len(addresses)
        print(
            f"\n{args.files} files, {args.mb} MB on each of {n} workers ({args.accelerator_type}), "
            f"best of {args.repeat}, {os.cpu_count()} CPUs"
        )
        print(f"{'':18}{'first':>10}{'no-op':>10}{'one file':>10}")
        for name, row in results.items():
            print(f"{name:18}" + "".join(f"{row[k]:>9.2f}s" for k in ("first", "no-op", "one file")))
        t, rs = results["tpurun download"], results["rsync -a pull xN"]
        ratios = {k: round(t[k] / rs[k], 2) for k in ("first", "no-op", "one file")}
        print(f"{'ratio':18}" + "".join(f"{ratios[k]:>9.2f}x" for k in ("first", "no-op", "one file")))
        print("\ntpurun: tpurun download --json ckpt out   (every worker: out/wN/ckpt)")
        print(f"rsync : rsync -a -e '{ssh_e} -o HostKeyAlias=tpu.ID-N' root@ADDR:/root/ckpt DEST/wN/   (x{n}, at once)")
        if args.json:
            doc = {"files": args.files, "mb": args.mb, "workers": n, "repeat": args.repeat, "seconds": results}
            args.json.write_text(json.dumps({**doc, "ratio": ratios}, indent=1) + "\n")
    finally:
        sh([*tpurun, "delete", "bench", "--yes"], env, cwd=work)
        sh([*tpurun, "emulator", "stop", "--state-dir", str(state)], env)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
