"""tpurun's hook in every Python process of a job (first on PYTHONPATH, as `sitecustomize`).

Every Python process of the job the agent did not start itself (a spawner's child, a helper the script
runs) gets channels of its own at its start, before anything of the script is imported: where its stdout
or stderr is a channel of the job it inherited (TPURUN_STDIO names them), the hook connects it to the
agent's log socket instead (see _own_stdio), so no two processes' bytes meet in one line.

A host launch starts the user's command once per worker and the script's own spawner (xmp.spawn,
torch_xla.launch, Lightning) makes one process per chip. The moment torch_xla gives a process its chip
(it sets PJRT_LOCAL_PROCESS_RANK or TPU_VISIBLE_CHIPS, seen here through Python's audit event for
os.putenv), this hook tells the agent, which files the process's channels, and what they held until
then, under that chip: its lines land in w<W>-c<chip>.log and reach tpurun as [wW/cM] (a process
without channels of its own, the host process itself, has its stdout and stderr connected to the
agent's log socket for that chip). It also tells the agent how the spawner's task in the process ended
(observed where the standard library's process pool sends the result back), so a failing chip stops
the job at once and is named.

A script whose launcher is torch.multiprocessing.spawn (TorchTPU's way) has its processes followed the
same way: each becomes the device its index names (see _follow_torch_spawn).

Where tpurun gives JAX its coordinator, process count and id (no TPU to detect them from), it adds a
cluster to jax.distributed's auto-detection (see _add_jax_cluster_to).

It reports each time a process of the job enters and leaves a runtime's rendezvous point
(jax.distributed.initialize, torch.distributed.init_process_group and the first torch.distributed
collective, torch_xla's xm.rendezvous), so tpurun can say who the others wait for (see _RENDEZVOUS).

It lets `tpurun stacks` ask any of the job's Python processes for the stacks of all its threads, even one
blocked in C: faulthandler writes them to the job's stacks/<pid>.txt on the signal the agent names
(TPURUN_STACKS_SIGNAL), registered only where the process has no handler of its own (see _register_stacks).

It starts the runtime's profiler server in each process that does the work, for `tpurun profile`, on the port
its slot is given (TPURUN_PROFILE_PORT; see _serve_profile): once jax or torch_xla is loaded in a process the
agent started, or when a spawner's process becomes its chip.

With `tpurun train --metrics` it also writes torch_xla's metrics report of each process that did the
work: a process the agent started, at its exit, and a chip process of a host launch, when its task ends
(a forked pool process never runs exit handlers).

Nothing of torch_xla, Lightning, the standard library or the user's script is replaced; any failure here
leaves the process as it was. Stdlib only, any Python 3.8+. Then the next `sitecustomize` on the path
(the interpreter's own, if any) runs as it would have.
"""

import os
import sys

_SOCKET = os.environ.get("TPURUN_LOG_SOCKET", "")
_CHIP_VARS = (b"PJRT_LOCAL_PROCESS_RANK", b"TPU_VISIBLE_CHIPS")
# "owner": the pid that became a chip; its forked children (a user's own fork pool, a DataLoader worker)
# inherit this module's state and patches, but report nothing on its behalf.
# "own": the pid whose stdout/stderr are channels of its own (a forked child shares them).
_state: dict = {
    "busy": False, "done": False, "ctl": None, "owner": None, "wait": None, "first": None, "stacks": None, "own": None,
    "profiler": None,
}  # fmt: skip


def _mine():
    return _state["owner"] == os.getpid()


def _as_bytes(value):
    return value.encode("utf-8", "surrogateescape") if isinstance(value, str) else bytes(value)


def _chip_of(key, value):
    """The chip a process was given: TPU_VISIBLE_CHIPS when it names one chip, else its local rank."""
    try:
        if key == b"TPU_VISIBLE_CHIPS":
            return int(value)
        visible = os.environ.get("TPU_VISIBLE_CHIPS", "")
        return int(visible) if visible.isdigit() else int(value)
    except ValueError:
        return None


def _protocol():
    """The agent's protocol module, beside the hook's directory in the bundle (loaded under a private name:
    nothing is added to the script's sys.path), the first time a process needs it."""
    name = "_tpurun_agent_protocol"
    module = sys.modules.get(name)
    if module is None:
        import importlib.util

        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "protocol.py")
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise OSError(f"no agent protocol at {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look themselves up there
        spec.loader.exec_module(module)
    return module


def _connect(slot, streams, pool):
    """Connections of this process to the agent's log socket, one per stream of STREAMS, filed under SLOT,
    all sent before any answer is awaited (one round trip for all)."""
    import socket

    protocol = _protocol()
    socks = []
    try:
        for stream in streams:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            socks.append(s)
            s.settimeout(10)
            s.connect("\0" + _SOCKET)
            s.sendall(protocol.hook_header(slot, stream, pool))
        for s in socks:
            if s.recv(len(protocol.HOOK_ACCEPTED)) != protocol.HOOK_ACCEPTED:  # the agent checked who we are
                raise OSError("the agent refused the log connection")
            s.settimeout(None)
    except OSError:
        for s in socks:
            s.close()
        raise
    return socks


def _report(ok, code=0):
    """Tell the agent how the spawner's task in this process ended."""
    ctl = _state["ctl"]
    if ctl is None or not _mine():
        return
    protocol = _protocol()
    try:
        ctl.sendall(protocol.task_end(protocol.TaskEnd.OK if ok else protocol.TaskEnd.FAILED, code))
    except OSError:
        pass


def _watch_pool_tasks():
    """Report how each task of a concurrent.futures process pool ends in this process (xmp.spawn and
    Lightning run the replica as such a task: an exception is sent back to the spawner, which would only
    raise it once every sibling has finished)."""
    pool = sys.modules.get("concurrent.futures.process")
    original = getattr(pool, "_sendback_result", None)
    if original is None:
        return

    def sendback(*args, **kwargs):
        if not _mine():
            return original(*args, **kwargs)
        exception = kwargs.get("exception", args[3] if len(args) > 3 else None)
        if os.environ.get("TPURUN_METRICS") == "1":
            _metrics_report()
        exc = getattr(exception, "exc", exception)  # the pool wraps it with its formatted traceback
        if exception is None or (isinstance(exc, SystemExit) and exc.code in (None, 0)):
            _report(True)
        else:
            text = str(getattr(exception, "tb", "") or exception).strip().strip('"').strip()
            try:
                sys.stderr.write(text + "\n")
                sys.stderr.flush()
            except Exception:
                pass
            _report(False, 1)
        return original(*args, **kwargs)

    setattr(pool, "_sendback_result", sendback)  # noqa: B010


def _metrics_report():
    """torch_xla's metrics of this process: the whole report into the job's directory, one summary line
    (compiles, executions, their times, ops that fell back to CPU) on stdout. Never raises: a report
    must not turn a replica that worked into one that failed."""
    try:
        _write_metrics()
    except Exception as e:
        print(f"tpurun metrics: no report: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def _write_metrics():
    import torch_xla.debug.metrics as met

    slot = os.environ.get("TPURUN_CORE")
    name = f"w{os.environ.get('TPURUN_WORKER_ID', '0')}" + (f"-c{slot}" if slot is not None else "")
    path = os.path.join(os.environ["TPURUN_JOB_DIR"], name + ".metrics.txt")
    with open(path, "w") as f:
        f.write(met.metrics_report())

    def metric(key):
        data = met.metric_data(key)
        return (data[0], data[1] / 1e9) if data else (0, 0.0)

    cc, ct = metric("CompileTime")
    ec, et = metric("ExecuteTime")
    fallbacks = ",".join(sorted(n for n in met.counter_names() if n.startswith("aten::"))) or "none"
    print(
        f"tpurun metrics: compiles={cc} compile_time={ct:.2f}s executes={ec} execute_time={et:.2f}s "
        f"cpu_fallback_ops={fallbacks} report={path}",
        flush=True,
    )


def _become_chip(chip, pool=None):
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    # "pool": the replica runs as a task whose end the hook reports (a concurrent.futures pool's, or the
    # function torch.multiprocessing.spawn runs); a chip process of another spawner that ends without a
    # report has simply ended
    if pool is None:
        pool = getattr(sys.modules.get("concurrent.futures.process"), "_sendback_result", None) is not None
    streams = _protocol().HookStream
    if _state["own"] == os.getpid():  # its channels are its own since its start: the agent files them anew
        (_state["ctl"],) = _connect(chip, (streams.CTL,), pool)
    else:
        out, err, _state["ctl"] = _connect(chip, (streams.OUT, streams.ERR, streams.CTL), pool)
        _replace_stdio({1: out, 2: err})
    _state["owner"] = os.getpid()
    os.environ["TPURUN_CORE"] = str(chip)  # for the script, and so descendants know they belong to a chip
    _watch_pool_tasks()
    if "jax" in sys.modules or "torch_xla" in sys.modules:
        _serve_profile()
    import faulthandler

    if not faulthandler.is_enabled():
        # a fatal signal (segfault, abort) prints the Python stacks to the agent, which files them in this
        # chip's log and so knows it crashed; the signal then ends the process as it would have
        faulthandler.enable(file=_state["ctl"], all_threads=True)
        # a forked child's crash is not the chip's
        os.register_at_fork(after_in_child=lambda: faulthandler.disable() if not _mine() else None)


def _fd_id(fd):
    """What TPURUN_STDIO names a channel by (the agent's agent_lines.stdio_id): dev:ino, or None."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return f"{st.st_dev}:{st.st_ino}"


def _replace_stdio(socks):
    """fd -> socket of SOCKS: the fd now writes to the socket; TPURUN_STDIO names it, so this process's
    Python descendants that inherit it get channels of their own in turn."""
    for fd, sock in socks.items():
        os.dup2(sock.fileno(), fd)
        sock.close()
    shared = os.environ.get("TPURUN_STDIO", "")
    os.environ["TPURUN_STDIO"] = ",".join([shared] + [_fd_id(fd) or "" for fd in socks])


def _own_stdio():
    """This process's stdout and stderr, where each is a channel of the job it inherited, connected to
    channels of its own (filed under the chip it inherited, else the host's until it names its chip). Not
    in a process the agent started itself: its pipes are its own already."""
    try:
        shared = os.environ.get("TPURUN_STDIO", "").split(",")
        fds = [fd for fd in (1, 2) if _fd_id(fd) in shared]
        if not fds or str(os.getppid()) == os.environ.get("TPURUN_SUPERVISOR_PID"):
            return
        protocol = _protocol()
        slot = int(os.environ.get("TPURUN_CORE", protocol.HOST))
        kinds = {1: protocol.HookStream.OWN_OUT, 2: protocol.HookStream.OWN_ERR}
        socks = _connect(slot, [kinds[fd] for fd in fds], False)
        _replace_stdio({fd: socks[i] for i, fd in enumerate(fds)})
        _state["own"] = os.getpid()
    except Exception:
        pass  # its lines go where they went: never break the user's process


def _claim(chip, pool=None):
    """Become CHIP's process once (the first sign of which chip wins)."""
    if _state["done"] or _state["busy"]:
        return False
    _state["busy"] = True
    try:
        _become_chip(chip, pool)
        return True
    except Exception:
        return False  # the lines stay on the host process's log: never break the user's process
    finally:
        _state["done"] = True
        _state["busy"] = False


def _audit(event, args):
    if event != "os.putenv" or _state["done"] or _state["busy"]:
        return
    key = _as_bytes(args[0])
    if key not in _CHIP_VARS:
        return
    chip = _chip_of(key, _as_bytes(args[1]).decode("ascii", "replace"))
    if chip is not None:
        _claim(chip)


class _AfterImport:
    """Runs CHANGES[name] on module NAME once it has loaded, before anyone uses it: a finder that steps aside
    for the import system, then wraps the loader it found; it leaves sys.meta_path once every change ran.
    Nothing of a module is replaced when its change fails."""

    def __init__(self, changes):
        self.changes, self.finding = dict(changes), set()

    def find_spec(self, name, path=None, target=None):
        if name not in self.changes or name in self.finding:
            return None
        self.finding.add(name)
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
            loader = spec.loader  # type: ignore[union-attr]
            run = loader.exec_module  # type: ignore[union-attr]
            change = self.changes.pop(name)

            def exec_module(module):
                run(module)
                try:
                    change(module)
                except Exception:
                    pass  # the library changed: it stays as it was

            loader.exec_module = exec_module  # type: ignore[union-attr, method-assign]
            return spec
        except Exception:
            return None  # the import system goes on as if we were not here
        finally:
            self.finding.discard(name)
            if not self.changes and self in sys.meta_path:
                sys.meta_path.remove(self)


def _follow_torch_spawn(module):
    """torch.multiprocessing.spawn (TorchTPU's launcher, and many a torch script's) starts each process with
    `_wrap(fn, i, args, error_queue)`: the process becomes chip (device) i, and says how fn ended, so a
    failing device stops the job at once and is named. The wrapper stands in for `_wrap` under its own name,
    so the parent pickles it for the child as it did the original (by reference)."""
    original = module._wrap

    def _wrap(fn, i, *rest, **kwargs):
        if "TPURUN_CORE" not in os.environ and _claim(i, pool=True):
            fn = _reporting(fn)
        return original(fn, i, *rest, **kwargs)

    _wrap.__module__, _wrap.__qualname__ = original.__module__, original.__qualname__
    module._wrap = _wrap


def _reporting(fn):
    def run(*args, **kwargs):
        try:
            result = fn(*args, **kwargs)
        except KeyboardInterrupt:
            raise  # stopped by its parent, as torch takes it: not a failure of this device
        except SystemExit as e:
            if e.code in (None, 0):
                _report(True)
            else:
                _report(False, e.code if isinstance(e.code, int) else 1)
            raise
        except BaseException:
            import traceback

            kind, error, tb = sys.exc_info()  # into this device's log (torch hands it to the parent too),
            traceback.print_exception(kind, error, tb.tb_next if tb else None)  # from the script's own frame
            sys.stderr.flush()
            _report(False, 1)
            raise
        if os.environ.get("TPURUN_METRICS") == "1":
            _metrics_report()
        _report(True)
        return result

    return run


def _add_jax_cluster_to(module):
    """Where tpurun gave the JAX coordinator, process count and id (no TPU to detect them from), adds a
    cluster to jax.distributed's auto-detection, so `jax.distributed.initialize()` needs no arguments.
    jax finds clusters by subclassing its ClusterEnv (each subclass registers itself). Nothing of jax is
    replaced; on a TPU VM tpurun sets none of the variables, and jax's own Cloud TPU cluster answers from
    the VM's metadata."""
    _add_jax_cluster(module.ClusterEnv)


def _add_jax_cluster(base):
    env = os.environ

    class TpurunCluster(base):  # type: ignore[misc, valid-type]
        name = "tpurun"

        @classmethod
        def is_env_present(cls):
            return "TPURUN_JOB_ID" in env and "JAX_PROCESS_ID" in env and "JAX_NUM_PROCESSES" in env

        @classmethod
        def get_coordinator_address(cls, timeout_secs=None, override_coordinator_port=None):
            address = env["JAX_COORDINATOR_ADDRESS"]
            if override_coordinator_port:
                address = address.rsplit(":", 1)[0] + ":" + override_coordinator_port
            return address

        @classmethod
        def get_process_count(cls):
            return int(env["JAX_NUM_PROCESSES"])

        @classmethod
        def get_process_id(cls):
            return int(env["JAX_PROCESS_ID"])

    # first: the values tpurun gave win over a cluster jax might also see (a Slurm allocation, say)
    base._cluster_types.remove(TpurunCluster)
    base._cluster_types.insert(0, TpurunCluster)
    return TpurunCluster


def _reporter():
    """Whether this process reports its passages: a process the agent started, or a chip's own process (not
    a child either forked), as the supervisor checks by pid."""
    return _mine() or str(os.getppid()) == os.environ.get("TPURUN_SUPERVISOR_PID")


def _send_passage(passage):
    """PASSAGE (as it stands) to the agent, on this process's wait connection, opened the first time."""
    conn = _state["wait"]
    if conn is None or (conn[0] is not None and conn[0] != os.getpid()):  # none yet, or its parent's (forked)
        if not _reporter():
            return
        import socket
        import threading

        protocol = _protocol()
        slot = int(os.environ.get("TPURUN_CORE", protocol.HOST))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        try:
            sock.connect("\0" + _SOCKET)
            sock.sendall(protocol.hook_header(slot, protocol.HookStream.WAIT, False))
            if sock.recv(len(protocol.HOOK_ACCEPTED)) != protocol.HOOK_ACCEPTED:
                raise OSError("refused")
        except OSError:
            sock.close()
            _state["wait"] = (None, None, None)  # no agent to tell: never try again
            return
        _state["wait"] = conn = (os.getpid(), sock, threading.Lock())
    pid, sock, lock = conn
    if pid != os.getpid():
        return  # no agent to tell
    with lock:
        try:
            sock.sendall(_protocol().passage_line(passage))
        except OSError:
            pass


def _passing(at, fn, first=False):
    """FN, each call reported as a passage through the rendezvous point AT (with FIRST: only the first call
    of any such FN in this process: the first collective)."""

    def passing(*args, **kwargs):
        if (first and _state["first"] == os.getpid()) or not _reporter():
            return fn(*args, **kwargs)  # (a later collective: one dict lookup and one getpid more)
        if first:
            _state["first"] = os.getpid()
        import time

        try:
            passage = _protocol().Passage(at(*args, **kwargs) if callable(at) else at, time.time())
            _send_passage(passage)
        except Exception:
            passage = None  # never break the user's process
        try:
            return fn(*args, **kwargs)
        finally:
            if passage is not None:
                passage.left = time.time()
                try:
                    _send_passage(passage)
                except Exception:
                    pass

    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(passing, attr, getattr(fn, attr, None))
    passing.__wrapped__ = fn  # type: ignore[attr-defined]  # inspect.signature sees the original's
    return passing


# The collectives whose first call in a process is reported (what a training loop's first step waits in).
_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "barrier", "broadcast", "broadcast_object_list", "gather", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "scatter",
)  # fmt: skip


def _watch_jax(module):
    module.initialize = _passing("jax.distributed.initialize", module.initialize)


def _watch_torch_distributed(module):
    module.init_process_group = _passing("torch.distributed.init_process_group", module.init_process_group)
    for name in _COLLECTIVES:
        fn = getattr(module, name, None)
        if callable(fn):
            setattr(module, name, _passing(f"first collective: torch.distributed.{name}", fn, first=True))


def _watch_torch_xla(module):
    rendezvous = module.rendezvous
    module.rendezvous = _passing(lambda tag, *a, **k: f"xm.rendezvous({tag!r})", rendezvous)


# where each runtime's processes wait for one another: module -> what wraps its rendezvous points (each
# wrapper only reports and calls the original)
_RENDEZVOUS = {
    "jax._src.distributed": _watch_jax,
    "torch.distributed.distributed_c10d": _watch_torch_distributed,
    "torch_xla.core.xla_model": _watch_torch_xla,
}


def _serve_profile(module=None):
    """The runtime's profiler server in this process, on its slot's port (protocol.profile_port), once: torch_xla's
    where it is loaded, else jax's. Only in a process that does the work (one the agent started, or a chip's own),
    never in a forked child. The server is the runtime's own, started without touching its backend (a TPU is
    initialised by the script, when it chooses; a capture's tracers are made then), and not the one
    `jax.profiler.start_server` keeps: a script that starts its own server still can. A port some other process
    holds is passed over for the slot's next (gRPC would share it, and a capture would reach either): the agent
    finds which one each process listens on."""
    try:
        first = int(os.environ.get("TPURUN_PROFILE_PORT") or 0)
        held = _state["profiler"]
        if not first or (held is not None and held[0] == os.getpid()) or not _reporter():
            return
        protocol = _protocol()
        slot, worker = int(os.environ.get("TPURUN_CORE", protocol.HOST)), int(os.environ.get("TPURUN_WORKER_ID") or 0)
        port = _free(protocol.profile_ports(first, slot, worker))
        if "torch_xla" in sys.modules:
            import torch_xla

            server = torch_xla._XLAC.profiler.start_server(port)
        else:
            from jax._src.lib import _profiler

            server = _profiler.start_server(port)
        _state["profiler"] = (os.getpid(), server)  # the server lives as long as this reference
    except Exception:
        pass  # no profile from this process: never break it


def _free(ports):
    """The first of PORTS nothing listens on (any address); OSError where none is free."""
    import socket

    for port in ports:
        family, anywhere = (socket.AF_INET6, "::") if socket.has_ipv6 else (socket.AF_INET, "")
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((anywhere, port))  # (dual-stack, as gRPC binds): taken on any address, refused
                return port
            except OSError:
                pass
    raise OSError("no free port for a profiler server")


def _register_stacks():
    """faulthandler dumps every thread's Python stack into <job dir>/stacks/<pid>.txt when this process gets
    TPURUN_STACKS_SIGNAL (from `tpurun stacks`; the agent sends it only to a process whose kernel record says
    it catches it). A process with a handler of its own for that signal keeps it (and gives no stacks). A
    forked child registers its own file."""
    try:
        sig = int(os.environ.get("TPURUN_STACKS_SIGNAL") or 0)
        where = os.environ.get("TPURUN_JOB_DIR")
        if not sig or not where:
            return
        import _signal  # signal's C half: `signal` itself would import enum into every process
        import faulthandler

        if _signal.getsignal(sig) not in (_signal.SIG_DFL, None):
            return
        dump = open(os.path.join(where, "stacks", f"{os.getpid()}.txt"), "w")
        faulthandler.register(sig, file=dump, all_threads=True, chain=False)
        old, _state["stacks"] = _state["stacks"], dump
        if old is None:
            os.register_at_fork(after_in_child=_register_stacks)
        else:
            old.close()  # the parent's file, inherited by this forked child
    except Exception:
        pass  # no stacks from this process: never break it


def _chain():
    """Run the next `sitecustomize` on the path, as the interpreter would have without us."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    ours = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours  # there is none after us: the import system expects us here


if _SOCKET and "TPURUN_STDIO" in os.environ:
    _own_stdio()
if _SOCKET and "TPURUN_CORE" not in os.environ and hasattr(sys, "addaudithook"):
    sys.addaudithook(_audit)
if os.environ.get("TPURUN_METRICS") == "1" and str(os.getppid()) == os.environ.get("TPURUN_SUPERVISOR_PID"):
    import atexit

    atexit.register(_metrics_report)  # a process the agent started (not its children)
if "TPURUN_STACKS_SIGNAL" in os.environ and "TPURUN_JOB_ID" in os.environ:
    _register_stacks()
_changes: dict = {}
if "JAX_PROCESS_ID" in os.environ and "TPURUN_JOB_ID" in os.environ and "jax" not in sys.modules:
    _changes["jax._src.clusters"] = _add_jax_cluster_to
if _SOCKET and "TPURUN_CORE" not in os.environ:
    _changes["torch.multiprocessing.spawn"] = _follow_torch_spawn
if _SOCKET and "TPURUN_JOB_ID" in os.environ:
    _changes.update((name, change) for name, change in _RENDEZVOUS.items() if name not in sys.modules)
if _SOCKET and os.environ.get("TPURUN_PROFILE_PORT"):
    _changes.update((name, _serve_profile) for name in ("jax", "torch_xla") if name not in sys.modules)
if _changes:
    sys.meta_path.insert(0, _AfterImport(_changes))
_chain()
