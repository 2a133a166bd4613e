"""Shared pieces of tpurun's benchmarks: the emulator, nodes made with the real CLI, timing, statistics.

Every benchmark runs its contenders interleaved (A B C A B C ..., the order rotated each repetition)
on the same emulated workers, times each run as a child process (wall time, and user+sys CPU seconds
and peak RSS of that child and the children it waited for, from wait4), and reports the median and
min-max. Needs root (the emulator does).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BENCH_DOCS = DOCS / "bench"
PROJECT = "bench"
ZONE = "us-central2-b"
# accelerator type with that many workers (v4: 4 chips per host, 2 cores per chip)
TIME = Path("/usr/bin/time").exists()  # GNU time (Debian package `time`)
# The workers' Python for train benchmarks: the system's, the same on every emulator version (an emulated
# worker's plain `python3` is the runtime image's, i.e. whatever Python runs the emulator: a pyenv build
# here runs the agent's record encoding ~25 % slower than Debian's, which moved the numbers on its own).
WORKER_PYTHON = "/usr/bin/python3"
V4_FOR_WORKERS = {4: "v4-32", 8: "v4-64", 16: "v4-128", 32: "v4-256", 64: "v4-512", 128: "v4-1024"}


def tpurun_bin() -> list[str]:
    exe = Path(sys.executable).with_name("tpurun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "tpurun"]


def machine() -> dict[str, Any]:
    """CPU model, cores, RAM, kernel, date: what a reader needs to compare runs."""
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    return {
        "cpu": model or platform.processor(),
        "cores": os.cpu_count(),
        "ram_gib": round(mem_kib / 1024 / 1024, 1),
        "kernel": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def machine_line(m: dict[str, Any]) -> str:
    return f"{m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, {m['kernel']}, Python {m['python']}, {m['date']}"


def record(script: str, **fields: Any) -> dict[str, Any]:
    """What a benchmark's results start with: the machine, FIELDS, and the command that ran SCRIPT (its __file__)."""
    command = f"sudo .venv/bin/python scripts/bench/{Path(script).name} " + " ".join(sys.argv[1:])
    return {"machine": machine(), **fields, "command": command}


def measured(res: dict[str, Any], how: str) -> str:
    """The line above a benchmark's table: when, on what machine, HOW (its rounds), the command, how long."""
    m = res["machine"]
    return f"Measured {m['date']} on {machine_line(m)}; {how}; `{res['command']}` ({res['seconds']:.0f} s)."


@dataclass
class Sample:
    wall: float
    cpu: float  # user + sys seconds of the child and the children it waited for
    rss_mib: float  # peak resident set size of the child (or its largest waited-for child)
    code: int


def timed_to(argv: Sequence[str], stdout: Any, env: dict[str, str] | None = None, cwd: Path | None = None) -> Sample:
    """`timed`, with the command's standard output going to STDOUT (a file) instead of nowhere."""
    return timed(argv, env, cwd, stdout=stdout)


def timed(
    argv: Sequence[str], env: dict[str, str] | None = None, cwd: Path | None = None, stdout: Any = None
) -> Sample:
    """Run ARGV (output discarded) under GNU time: wall time here, CPU and peak RSS of that child alone.

    (wait4's ru_maxrss of a child forked from this big process would count this process's RSS at the
    fork; /usr/bin/time is small, so its child's peak RSS is the command's own.)
    """
    with tempfile.NamedTemporaryFile("r", prefix="bench-time-") as tf:
        wrapped = ["/usr/bin/time", "-q", "-f", "%U %S %M", "-o", tf.name, *argv] if TIME else list(argv)
        t0 = time.perf_counter()
        proc = subprocess.run(
            wrapped,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL if stdout is None else stdout,
            stderr=subprocess.PIPE,
        )
        wall = time.perf_counter() - t0
        fields = tf.read().split()
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace")[-500:]
        print(f"  ! {' '.join(argv[:3])}... exited {proc.returncode}: {tail}", file=sys.stderr)
    if len(fields) >= 3:
        return Sample(wall, float(fields[-3]) + float(fields[-2]), int(fields[-1]) / 1024, proc.returncode)
    return Sample(wall, float("nan"), float("nan"), proc.returncode)


def seconds(fn: Callable[[], object]) -> float:
    """Wall time of FN, called in this process (an in-process transfer, where `timed` runs a command)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def spread(xs: Sequence[float]) -> dict[str, float]:
    """Median, min, max and count of XS (empty when there are none)."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else {}


def ms_cell(d: dict[str, float]) -> str:
    """A `spread` of seconds as a table cell: median (min-max) in ms."""
    return f"{d['median'] * 1000:.0f} ({d['min'] * 1000:.0f}-{d['max'] * 1000:.0f})" if d else "-"


def summary(samples: Sequence[Sample]) -> dict[str, Any]:
    walls = [s.wall for s in samples]
    return {
        "n": len(samples),
        "median": statistics.median(walls),
        "min": min(walls),
        "max": max(walls),
        "samples": [round(w, 4) for w in walls],
        "cpu_median": statistics.median(s.cpu for s in samples),
        "rss_mib_max": max(s.rss_mib for s in samples),
        "failures": sum(1 for s in samples if s.code != 0),
    }


def interleave(
    contenders: dict[str, Callable[[], Sample]], repetitions: int, warmup: int = 1, label: str = ""
) -> dict[str, dict[str, Any]]:
    """Run every contender REPETITIONS times, interleaved (order rotated each round) after WARMUP unmeasured rounds."""
    names = list(contenders)
    got: dict[str, list[Sample]] = {n: [] for n in names}
    for rnd in range(warmup + repetitions):
        k = rnd % len(names)
        for name in names[k:] + names[:k]:
            s = contenders[name]()
            if rnd >= warmup:
                got[name].append(s)
    out = {n: summary(v) for n, v in got.items()}
    for n in names:
        r = out[n]
        print(
            f"  {label}{n:>12}: median {r['median'] * 1000:7.1f} ms  [{r['min'] * 1000:.1f}-{r['max'] * 1000:.1f}]"
            f"  cpu {r['cpu_median'] * 1000:6.1f} ms  rss {r['rss_mib_max']:.0f} MiB"
            + (f"  FAILURES {r['failures']}" if r["failures"] else ""),
            flush=True,
        )
    return out


@dataclass
class Node:
    name: str
    workers: list[str]  # addresses, index order
    user: str = "root"


@dataclass
class Bench:
    """A running emulator with tpurun pointed at it (own TPURUN_HOME), and the nodes made so far."""

    endpoint: str
    home: Path
    env: dict[str, str]
    server: Any
    state_dir: Path
    nodes: dict[str, Node] = field(default_factory=dict)

    @property
    def key(self) -> Path:
        return Path(self.env["TPURUN_HOME"]) / "ssh" / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        """The peers' known_hosts: the workers' keys under their addresses, as OpenSSH and paramiko look them
        up (tpurun pins them under each worker's identity instead)."""
        return self.home / "peers_known_hosts"

    def ssh_options(self) -> list[str]:
        """OpenSSH options: tpurun's key and pinned known_hosts, strict checking, never a prompt."""
        return [
            "-i", str(self.key),
            "-o", "IdentitiesOnly=yes",
            "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={self.known_hosts}",
            "-o", "BatchMode=yes",
            "-o", "ConnectTimeout=10",
            "-o", "LogLevel=ERROR",
        ]  # fmt: skip

    def behind(self, group: Any, node: Node) -> tuple[dict[str, str], list[str]]:
        """NODE's workers reached through proxies of GROUP (a latency_proxy.ProxyGroup), their host keys pinned for
        the peers under the proxies' addresses: tpurun's environment for that, and the proxies' addresses."""
        from tpurun.testing.latency_proxy import address_map_env, pin_proxies, proxy_workers

        mapping = proxy_workers(group, [(a, 22) for a in node.workers])
        pin_proxies(self.known_hosts, mapping)
        return dict(self.env, TPURUN_ADDRESS_MAP=address_map_env(mapping)), [mapping[a] for a in node.workers]

    def job_dir(self, **scripts: str) -> Path:
        """A directory of job SCRIPTS (file name without ".py" -> source) to `tpurun train` from."""
        jobs = self.home / "jobs"
        jobs.mkdir()
        for name, source in scripts.items():
            (jobs / f"{name}.py").write_text(source)
        return jobs

    def tpurun(self, *args: str, env: dict[str, str] | None = None, check: bool = True) -> str:
        r = subprocess.run(
            [*tpurun_bin(), *args], env=env or self.env, cwd=self.home, capture_output=True, text=True, timeout=900
        )
        if check and r.returncode != 0:
            raise RuntimeError(f"tpurun {' '.join(args)} failed ({r.returncode}): {r.stderr[-2000:]}")
        return r.stdout

    def create(self, workers: int) -> Node:
        """A READY node of WORKERS workers made with `tpurun create` (which pins its host keys)."""
        name = f"bench{workers}"
        t0 = time.monotonic()
        self.tpurun("create", name, "-t", V4_FOR_WORKERS[workers])
        node = Node(name, self.pin_for_peers(name))
        print(f"created {name} ({workers} workers) in {time.monotonic() - t0:.1f}s", flush=True)
        self.nodes[name] = node
        return node

    def pin_for_peers(self, *nodes: str) -> list[str]:
        """The addresses of NODES' workers (index order, node after node), their host keys pinned in the peers'
        known_hosts (a deleted node's addresses are reused: its lines go; the peers cannot tell VMs apart)."""
        workers = [
            w
            for n in nodes
            for w in self.server.emu.node_info(f"projects/{PROJECT}/locations/{ZONE}/nodes/{n}")["workers"]
        ]
        fresh = {w["address"]: f"{w['address']} {w['hostKey']}" for w in workers}
        old = self.known_hosts.read_text().splitlines() if self.known_hosts.exists() else []
        kept = [line for line in old if line.split(" ", 1)[0] not in fresh]
        self.known_hosts.write_text("".join(line + "\n" for line in [*kept, *fresh.values()]))
        return [w["address"] for w in workers]

    def delete(self, node: Node) -> None:
        self.tpurun("delete", node.name, "--yes", check=False)
        self.nodes.pop(node.name, None)


@contextmanager
def bench_emulator() -> Iterator[Bench]:
    """The emulator (zero delays; its workers in TPURUN_EMULATOR_SLOTS where set) on a thread of this process, and
    a fresh TPURUN_HOME; torn down after."""
    sys.path.insert(0, str(ROOT))
    from tpurun.config import EMULATOR_SLOTS
    from tpurun.emulator.api import EmulatorServer
    from tpurun.emulator.cli import leftovers
    from tpurun.emulator.hosts import WorkerHosts
    from tpurun.emulator.model import Delays, EmulatorConfig, parse_slots
    from tpurun.emulator.pytest_plugin import host_problem
    from tpurun.emulator.state import Emulator

    problem = host_problem()
    if problem:
        raise SystemExit(f"error: {problem}")
    state_dir = Path(tempfile.mkdtemp(prefix="tpurun-bench-")).resolve()
    home = state_dir / "home"
    home.mkdir()
    hosts = WorkerHosts(state_dir / "emu", key_propagation_delay=0.1)
    # TPURUN_EMULATOR_SLOTS: the addresses its workers take, as for `tpurun emulator start` (apart from another's)
    slots = parse_slots(EMULATOR_SLOTS.raw())
    emu = Emulator(hosts, EmulatorConfig(state_dir=state_dir / "emu", delays=Delays(0, 0, 0, 0, 0, 0), slots=slots))
    server = EmulatorServer(emu)
    server.start_thread()
    bench = Bench(server.endpoint, home, client_env(home, TPURUN_API_ENDPOINT=server.endpoint), server, state_dir)
    try:
        yield bench
    finally:
        for node in list(bench.nodes.values()):
            bench.delete(node)
        server.stop()
        left = leftovers(state_dir / "emu")
        if left:
            print(f"warning: the emulator left things behind: {left}", file=sys.stderr)
        else:
            shutil.rmtree(state_dir, ignore_errors=True)


def client_env(home: Path, **more: str) -> dict[str, str]:
    """This process's environment for a tpurun whose HOME is HOME, in the bench project and zone, polling fast,
    with MORE; a TPU or an address map the caller's shell names left out."""
    env = {k: v for k, v in os.environ.items() if k not in ("TPURUN_TPU", "TPURUN_ADDRESS_MAP")}
    env.update(
        {
            "TPURUN_PROJECT": PROJECT,
            "TPURUN_ZONE": ZONE,
            "HOME": str(home),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "TPURUN_HOME": str(home / ".tpurun"),
            "TPURUN_POLL_INTERVAL": "0.1",
            "TPURUN_RETRY_DELAY": "0.05",
            "TPURUN_SSH_USER": "root",
            **more,
        }
    )
    return env


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    path = path.resolve()
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


def publish(res: dict[str, Any], text: str, name: str, heading: str, *, write: bool) -> None:
    """Print a benchmark's table TEXT; with WRITE, keep RES in docs/bench/NAME.json and TEXT in
    docs/benchmarks.md under HEADING (its section marked NAME)."""
    print(text)
    if write:
        write_json(BENCH_DOCS / f"{name}.json", res)
        replace_section(DOCS / "benchmarks.md", name, text, heading)


def replace_section(doc: Path, marker: str, text: str, heading: str) -> None:
    """Put TEXT between `<!-- MARKER:begin -->` and `<!-- MARKER:end -->` in DOC (appended under HEADING if absent)."""
    block = f"<!-- {marker}:begin (generated; do not edit by hand) -->\n{text.rstrip()}\n<!-- {marker}:end -->"
    current = doc.read_text() if doc.exists() else "# Benchmarks\n"
    begin, end = f"<!-- {marker}:begin", f"<!-- {marker}:end -->"
    if begin in current and end in current:
        i = current.index(begin)
        j = current.index(end) + len(end)
        new = current[:i] + block + current[j:]
    else:
        new = current.rstrip() + f"\n\n{heading}\n\n{block}\n"
    doc.write_text(new)
    print(f"wrote {doc.relative_to(ROOT)} ({marker})")
