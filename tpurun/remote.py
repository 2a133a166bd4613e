"""A user's command on a TPU's workers: on every selected one at once (`exec`), or through the system ssh on
one (`ssh`: its argv, with tpurun's key and the host key pinned for that worker of that TPU)."""

from __future__ import annotations

import shlex
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from tpurun.cloud import keys
from tpurun.errors import ExitCode, UnreachableError, UsageError
from tpurun.fleet import targets
from tpurun.fleet.interface import RunResult
from tpurun.settings import Settings
from tpurun.transport.runner import INTERNAL_PORT, RUN_GRACE, LineSink, refuse_nul


@dataclass
class ExecResult:
    results: list[RunResult]  # one per selected worker, in worker order; unreachable ones never ran
    names: Mapping[int, str] = field(default_factory=dict)  # worker index -> its name (w3, s1/w1)
    interrupted: bool = False  # Ctrl-C (or SIGTERM) stopped it

    @property
    def exit_code(self) -> ExitCode:
        """`exec`'s exit code (docs/contract.md): 130 interrupted, else 4 where a worker could not be reached, else
        1 where the command failed on a worker, else 0."""
        if self.interrupted:
            return ExitCode.INTERRUPTED
        if any(r.exit_code is None for r in self.results):
            return ExitCode.UNREACHABLE
        if any(r.exit_code != 0 for r in self.results):
            return ExitCode.PROGRAM_FAILED
        return ExitCode.OK


def exec_everywhere(
    s: Settings,
    command: list[str],
    sink: LineSink,
    *,
    local: bool,
    worker_spec: str,
    stop: threading.Event,
    fail_fast: bool,
    grace: float = RUN_GRACE,
    announce: Callable[[str], None] | None = None,
    name_workers: Callable[[Mapping[int, str]], None] | None = None,
    unreachable: Callable[[str], None] | None = None,
    interrupted: threading.Event | None = None,
) -> ExecResult:
    """COMMAND (argv, never through a shell) at once on every worker of the TPU S names (or this machine, LOCAL)
    that WORKER_SPEC selects, its lines to SINK. ANNOUNCE hears where it runs where that needs saying (this
    machine; one worker of a pod on its own), NAME_WORKERS the workers' names before any line, UNREACHABLE why a
    worker cannot be reached once every connection was tried. STOP stops every worker's command (fail-fast sets it
    too); INTERRUPTED, set by Ctrl-C alone, makes it an interrupted exec.

    Each worker's command starts the moment that worker has proved who it is, not once every worker has:
    waiting for the slowest handshake cost every command about half a round trip (docs/benchmarks.md)."""
    target = targets.resolve(s, local=local, worker_spec=worker_spec, announce=announce)
    one = target.alone
    if one is not None and announce is not None:
        name = target.workers[0].name
        announce(f"{name} alone: its runtime sees the {one.name} single-host slice it is on its own (docs/remote.md)")
    if name_workers is not None:
        name_workers(target.worker_names)

    with target:
        # not connected yet: each worker's command starts the moment it is reached; what each VM's metadata does not
        # tell the runtimes (or one worker of a pod, as its own slice) added
        results = target.fleet.run(
            command, sink, stop=stop, fail_fast=fail_fast, grace=grace, env=target.vm_env, unreached=unreachable
        )
    return ExecResult(results, target.worker_names, interrupted=interrupted is not None and interrupted.is_set())


def _ssh_options(home: Path, alias: str) -> list[str]:
    """The system ssh with tpurun's key, checking the host key pinned under ALIAS only."""
    return [
        "ssh",
        "-i", str(keys.key_path(home)),
        "-o", "IdentitiesOnly=yes",
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"UserKnownHostsFile={keys.known_hosts_path(home)}",
        "-o", f"HostKeyAlias={alias}",
        "-o", "LogLevel=ERROR",
    ]  # fmt: skip


def ssh_argv(s: Settings, command: list[str] | None, *, worker: str, forward: list[str], flags: list[str]) -> list[str]:
    """The system ssh's argv to the one worker of the TPU S names that the --worker spec WORKER selects (once it
    has proved it is that worker of that TPU): a shell, or COMMAND quoted to arrive exactly; FORWARD as -L specs,
    FLAGS as more ssh options."""
    if not s.tpu.value:
        raise UsageError("no TPU named: pass --tpu NAME (or `tpurun attach NAME` to set a default)")
    home = s.home_path
    target = targets.resolve(s, worker_spec=worker)
    with target:
        if len(target.workers) != 1:
            raise UsageError(f"--worker {worker}: name one worker")
        w = target.workers[0]
        proxy = target.proxy_command(w)  # IAP's tunnel (tpurun carries ssh's bytes), or the user's ProxyCommand
        # --relay: through the first worker of its slice, to its address inside the slice (a tunnel or the user's
        # ProxyCommand goes to the worker itself)
        relayed = s.relay_mode == "on" and proxy is None
        via = next(x for x in target.all_workers if x.slice == w.slice) if relayed else None
        via = via if via is not None and via.index != w.index else None
        checked = targets.resolve(s, worker_spec=via.name) if via is not None else target
        errors = checked.fleet.connect()  # a gone TPU is reported, and who answers proves who it is, before ssh
        if errors:
            raise UnreachableError(next(iter(errors.values())))
    argv = _ssh_options(home, w.host_key)  # the key pinned for this worker of this TPU, not for its address
    if proxy is not None:
        argv += ["-o", f"ProxyCommand={proxy}", "-p", str(w.port)]
    elif via is not None:
        hop = _ssh_options(home, via.host_key) + ["-p", str(via.port), "-W", "%h:%p", f"{via.user}@{via.address}"]
        argv += ["-o", f"ProxyCommand={shlex.join(hop)}", "-p", str(INTERNAL_PORT)]
        w = replace(w, address=w.internal or w.address)
    else:
        argv += ["-p", str(w.port)]
    # after tpurun's own options: ssh keeps the first value it gets of each, so these cannot loosen them
    for spec in forward:
        argv += ["-L", spec]
    for flag in flags:
        argv += shlex.split(flag)
    if not command:
        return [*argv, "-t", f"{w.user}@{w.address}"]
    refuse_nul(command)
    # ssh joins its arguments into one line for the remote shell: quote so they arrive exactly
    return [*argv, f"{w.user}@{w.address}", "--", shlex.join(command)]


def iap_tunnel(s: Settings, instance: str, port: int) -> None:
    """This process's stdin and stdout carried through IAP's tunnel to PORT of INSTANCE, in S's project and zone,
    until either side ends: the ProxyCommand `tpurun ssh` gives OpenSSH for a worker reached through IAP."""
    import os
    import selectors

    s.require_location()
    sock = targets.Ways(s).open_tunnel(instance, port, timeout=15.0)
    chooser = selectors.DefaultSelector()
    chooser.register(0, selectors.EVENT_READ)
    chooser.register(sock, selectors.EVENT_READ)
    try:
        while chooser.get_map():
            for key, _ in chooser.select():
                if key.fd == 0:
                    data = os.read(0, 1 << 16)
                    if data:
                        sock.sendall(data)
                        continue
                    chooser.unregister(0)
                    sock.shutdown(socket.SHUT_WR)  # ssh closed its side: the tunnel's end follows
                else:
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    view = memoryview(data)
                    while view:
                        view = view[os.write(1, view) :]
    except OSError:
        return
    finally:
        sock.close()
