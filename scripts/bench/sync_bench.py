#!/usr/bin/env python3
"""`tpurun sync` against 8 parallel `rsync -a` over ssh, on an emulated v4-64 (8 workers).

Starts the emulator (`tpurun emulator start`), creates a v4-64, builds a 5,000-file, 100 MB tree
(files older than tpurun's racy window), then times, each REPEAT times (best kept):

* tpurun: first sync (empty dest), no-op re-sync, re-sync after changing one file;
* rsync: the same three, 8 `rsync -a -e 'ssh -i KEY -o UserKnownHostsFile=... -o StrictHostKeyChecking=yes'`
  processes at once, one per worker, to a separate dest.

Prints a table and the exact commands; needs root (the emulator). Usage:

    sudo .venv/bin/python scripts/bench/sync_bench.py [--files 5000] [--mb 100] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def sh(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, check=False)


def make_tree(root: Path, files: int, total_mb: int) -> None:
    size = total_mb * 1_000_000 // files
    for i in range(files):
        d = root / f"d{i % 50:02d}" / f"s{i % 7}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:05d}.dat").write_bytes(os.urandom(size))
    old = time.time_ns() - 3600 * 10**9
    for p in root.rglob("*"):
        os.utime(p, ns=(old, old))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=5000)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--accelerator-type", default="v4-64")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tpurun-syncbench-"))
    home, project, state = tmp / "home", tmp / "tree", tmp / "emu"
    home.mkdir()
    project.mkdir()
    env = common.client_env(home)
    tpurun = [sys.executable, "-m", "tpurun"]
    r = sh([*tpurun, "emulator", "start", "--state-dir", str(state)], env)
    if r.returncode:
        print(r.stdout, r.stderr, file=sys.stderr)
        return 1
    env["TPURUN_API_ENDPOINT"] = r.stdout.strip().splitlines()[-1].split("=", 1)[1]
    try:
        r = sh([*tpurun, "create", "bench", "-t", args.accelerator_type, "--json"], env, cwd=project)
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return 1
        created = json.loads(r.stdout)
        addresses = [w["internalIp"] for w in created["workerEndpoints"]]
        make_tree(project, args.files, args.mb)
        key = home / ".tpurun" / "ssh" / "id_ed25519"
        known = home / ".tpurun" / "ssh" / "known_hosts"
        ssh_e = f"ssh -i {key} -o IdentitiesOnly=yes -o UserKnownHostsFile={known} -o StrictHostKeyChecking=yes"
        # tpurun pins each worker's key under its identity, tpu.<node id>-<worker>: OpenSSH's HostKeyAlias
        alias = {a: f" -o HostKeyAlias=tpu.{created['id']}-{i}" for i, a in enumerate(addresses)}

        rnd = [0]  # each round syncs to fresh destinations (see run_all.py: no wipe between rounds)

        def tpurun_sync() -> None:
            r = sh([*tpurun, "sync", "--json", "--dest", f"/root/tree-r{rnd[0]}"], env, cwd=project)
            if r.returncode:
                raise SystemExit(f"tpurun sync failed: {r.stderr}")

        def rsync_all() -> None:
            procs = [
                subprocess.Popen(
                    ["rsync", "-a", "-e", ssh_e + alias[a], f"{project}/", f"root@{a}:/root/rsync-tree-r{rnd[0]}/"],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )  # fmt: skip
                for a in addresses
            ]
            for p in procs:
                _, err = p.communicate()
                if p.returncode:
                    raise SystemExit(f"rsync failed: {err.decode()}")

        def wipe() -> None:
            for a in addresses:
                subprocess.run(
                    ["ssh", *shlex.split(ssh_e + alias[a])[1:], f"root@{a}", "rm -rf /root/tree-r* /root/rsync-tree-r*"],
                    env=env, check=True, capture_output=True,
                )  # fmt: skip
            shutil.rmtree(home / ".tpurun" / "sync-cache", ignore_errors=True)

        victim = next(project.rglob("*.dat"))
        results: dict[str, dict[str, float]] = {"tpurun sync": {}, "rsync -a x8": {}}
        wipe()
        for r_ in range(args.repeat):
            rnd[0] = r_
            shutil.rmtree(home / ".tpurun" / "sync-cache", ignore_errors=True)
            for name, fn in (("tpurun sync", tpurun_sync), ("rsync -a x8", rsync_all)):
                first = common.seconds(fn)
                noop = common.seconds(fn)
                data = victim.read_bytes()
                victim.write_bytes(data[::-1])  # same size, new content
                os.utime(victim, ns=(time.time_ns() - 10 * 10**9,) * 2)
                one = common.seconds(fn)
                victim.write_bytes(data)
                old = time.time_ns() - 3600 * 10**9
                os.utime(victim, ns=(old, old))
                fn()  # back in step for the next round
                for k, v in (("first", first), ("no-op", noop), ("one file", one)):
                    results[name][k] = min(results[name].get(k, 1e9), v)
        n = len(addresses)
        print(
            f"\n{args.files} files, {args.mb} MB, {n} workers ({args.accelerator_type}), best of {args.repeat}, {os.cpu_count()} CPUs"
        )
        print(f"{'':14}{'first':>10}{'no-op':>10}{'one file':>10}")
        for name, row in results.items():
            print(f"{name:14}" + "".join(f"{row[k]:>9.2f}s" for k in ("first", "no-op", "one file")))
        t, rs = results["tpurun sync"], results["rsync -a x8"]
        print(f"{'ratio':14}" + "".join(f"{t[k] / rs[k]:>9.2f}x" for k in ("first", "no-op", "one file")))
        print("\ntpurun: tpurun sync --json   (in the tree's directory; dest ~/tree)")
        print(f"rsync : rsync -a -e '{ssh_e}' TREE/ root@ADDR:/root/rsync-tree/   (x{n}, at once)")
    finally:
        sh([*tpurun, "delete", "bench", "--yes"], env, cwd=project)
        sh([*tpurun, "emulator", "stop", "--state-dir", str(state)], env)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
