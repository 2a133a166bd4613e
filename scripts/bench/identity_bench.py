"""The identity check's cost (`tpurun exec -- true`) and `tpurun jobs` over every worker, on 8 and 32 workers,
before and after, in one run.

    sudo .venv/bin/python scripts/bench/identity_bench.py --before 12b9676   # writes docs/bench/identity.json
    sudo .venv/bin/python scripts/bench/identity_bench.py --before REF --reps 3 --no-write

One emulator in this process, one node per size made by this checkout's `tpurun create`; three contenders,
interleaved (order rotated each round), each as its own `python -m tpurun` process with its own
TPURUN_HOME holding the same ssh key:

- before: the checkout of REF (a git worktree), whose remembered endpoints are trusted by address: host
  keys pinned per address, no API call.
- after: this checkout. Remembered endpoints are used while every worker proves, in the SSH handshake,
  that it holds the key pinned for that worker of that TPU (`tpu.<node id>-<worker>`): no API call either.
- after, asking the API: this checkout with TPURUN_NODE_CACHE=0, i.e. the API asked on every command
  (the node, its guest attributes' host keys, pinned again): what checking through the API would cost.

The ratio is against before: what the check costs each command.

Then `tpurun jobs --json` with one finished job on the node, before (its state asked of worker 0 only) and
after (of every worker, one agent call each, at once): what combining every worker's state costs.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402

SIZES = (8, 32)


def worktree(ref: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(common.ROOT), "worktree", "add", "--detach", str(where), ref], check=True,
                   capture_output=True)  # fmt: skip
    return where


def home_like(bench: common.Bench, home: Path, *, by_address: bool) -> Path:
    """A TPURUN_HOME with the bench's ssh key; BY_ADDRESS: host keys pinned per address (REF's format)."""
    ssh = home / "ssh"
    ssh.mkdir(parents=True, mode=0o700)
    src = Path(bench.env["TPURUN_HOME"]) / "ssh"
    for name in ("id_ed25519", "id_ed25519.pub"):
        shutil.copy2(src / name, ssh / name)
    if by_address:
        shutil.copy2(bench.known_hosts, ssh / "known_hosts")
    return home


def timer(argv: list[str], env: dict[str, str], cwd: Path) -> Callable[[], common.Sample]:
    return lambda: common.timed(argv, env, cwd)


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"machine": common.machine(), "before": args.before, "reps": args.reps, "sizes": {}, "jobs": {}}
    with tempfile.TemporaryDirectory(prefix="tpurun-identity-") as tmp, common.bench_emulator() as bench:
        before_tree = worktree(args.before, Path(tmp) / "before")
        try:
            for n in SIZES:
                node = bench.create(n)
                py = [sys.executable, "-m", "tpurun", "--plain", "exec", "--tpu", node.name, "--", "true"]
                envs = {
                    "before": dict(bench.env, PYTHONPATH=str(before_tree),
                                   TPURUN_HOME=str(home_like(bench, Path(tmp) / f"b{n}", by_address=True))),
                    "after": dict(bench.env, PYTHONPATH=str(common.ROOT),
                                  TPURUN_HOME=str(home_like(bench, Path(tmp) / f"a{n}", by_address=False))),
                }  # fmt: skip
                envs["after, asking the API"] = dict(envs["after"], TPURUN_NODE_CACHE="0")
                for name, env in envs.items():  # first use: remember the node (and pin its keys, after)
                    sample = common.timed(py, env, bench.home)
                    if sample.code != 0:
                        raise SystemExit(f"{name}: tpurun exec failed on {n} workers")
                res["sizes"][str(n)] = common.interleave(
                    {name: timer(py, env, bench.home) for name, env in envs.items()},
                    args.reps,
                    label=f"{n:>3} workers ",
                )
                project = Path(tmp) / f"p{n}"
                project.mkdir()
                (project / "t.py").write_text("print('done')\n")
                jobs = [sys.executable, "-m", "tpurun", "jobs", "--json"]
                for name in ("before", "after"):  # one finished job of each version's own
                    train = [sys.executable, "-m", "tpurun", "train", "t.py", "--tpu", node.name, "--runtime", "cpu",
                             "--cores", "1", "--python", common.WORKER_PYTHON]  # fmt: skip
                    if common.timed(train, envs[name], project).code != 0:
                        raise SystemExit(f"{name}: tpurun train failed on {n} workers")
                res["jobs"][str(n)] = common.interleave(
                    {name: timer(jobs, envs[name], project) for name in ("before", "after")},
                    args.reps,
                    label=f"{n:>3} workers jobs ",
                )
                bench.delete(node)
        finally:
            subprocess.run(["git", "-C", str(common.ROOT), "worktree", "remove", "--force", str(before_tree)],
                           capture_output=True)  # fmt: skip
    return res


def render(res: dict[str, Any]) -> str:
    lines = [
        f"`scripts/bench/identity_bench.py --before {res['before']}`, {res['reps']} interleaved rounds per size, "
        f"median wall time of `tpurun exec -- true` (CPU seconds of the tpurun process):",
        "",
        "| workers | before (by address) | after (identity in the handshake) | after, asking the API every time |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for n, r in res["sizes"].items():
        base = r["before"]["median"]

        def cell(name: str, r: dict[str, Any] = r, base: float = base) -> str:
            x = r[name]
            return f"{x['median'] * 1000:.0f} ms ({x['cpu_median']:.2f} s CPU), {x['median'] / base:.2f}×"

        lines.append(f"| {n} | {cell('before')} | {cell('after')} | {cell('after, asking the API')} |")
    lines += [
        "",
        "`tpurun jobs --json` with one finished job on the node (before: its state from worker 0; after: from "
        "every worker at once):",
        "",
        "| workers | before (worker 0) | after (every worker) |",
        "| ---: | ---: | ---: |",
    ]
    for n, r in res["jobs"].items():
        b, a = r["before"], r["after"]
        lines.append(
            f"| {n} | {b['median'] * 1000:.0f} ms ({b['cpu_median']:.2f} s CPU) | {a['median'] * 1000:.0f} ms "
            f"({a['cpu_median']:.2f} s CPU), {a['median'] / b['median']:.2f}× |"
        )
    lines += ["", f"Machine: {common.machine_line(res['machine'])}."]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="git ref of tpurun before the identity check")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    res = run(args)
    common.publish(res, render(res), "identity", "### The identity check: exec before and after", write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
