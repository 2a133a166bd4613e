"""tpurun's relay: one runs on every worker of a relay tree, `python3 relay.py`, its link to its parent on
stdin and stdout (the frames of relay_wire.py).

It reads its `PLAN` (its subtree), reaches its children with OpenSSH's `ssh` at their addresses inside the
slice, each child's host key checked against the one tpurun pinned for that TPU and worker (StrictHostKeyChecking,
a known_hosts of the plan's keys only: never trust on first use), starts a relay there (installing the bundle
from its own copy where it is missing) and hands it its part of the plan. The first relay of a tree holds
tpurun's key in an ssh-agent of its own (the key never touches a disk, and the agent ends with the relay);
the relays below it use that agent, forwarded.

Then it routes: a channel opened on its own worker runs as its child process (stdin, stdout, stderr piped;
its own session, as sshd gives a command; the bundle's agent or sync helper forked by the relay's zygote, zygote.py:
where an agent claimed the worker and started an attached job, the relay streams the job itself once the agent ended), one
opened further down goes to the child whose subtree holds that worker. What comes up is batched into as few
writes as the parent's link takes. When its stdin ends (tpurun
went, or its parent relay did), every program it started gets the end of its stdin too and every child relay
its link's end: nothing it started outlives the command.
"""

from __future__ import annotations

import collections
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import relay_wire
from relay_wire import Node, Opening
from zygote import AGENT, PROGRAMS, Forked, Zygote, claimed_job, stream_claimed

REPLANS = 2  # how many times the workers below a child that cannot be reached are planned anew (Relay.start)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = "$HOME/.tpurun/bin"
QUEUE_BYTES = 16 << 20  # bytes waiting for one link or one program's stdin, at most (backpressure beyond)
DRAIN = 1.0  # seconds a program's pipes are read after it exited, where something else still holds them
BATCH_BYTES = 1 << 20  # what one write up the tree carries, at most
MISSING = 93  # protocol.AgentExit.MISSING: the bundle is not on the worker

# A child's command: this relay's bundle there (installed first from this relay's copy where missing: the
# bootstrap asks for it with a NEED frame and reads the BUNDLE frame that answers), then the relay (stdlib
# only: no site-packages, no PYTHON* variables, which saves each worker a few milliseconds of start).
_BOOT = (
    "import os,sys,struct,io,tarfile\n"
    "d=os.path.expanduser('~/.tpurun/bin/'+sys.argv[1])\n"
    "if not os.path.isfile(d+'/relay.py'):\n"
    " H=struct.Struct('>BII');os.write(1,H.pack(78,0,0))\n"
    " def r(n):\n"
    "  b=b''\n"
    "  while len(b)<n:\n"
    "   c=os.read(0,n-len(b))\n"
    "   if not c:sys.exit(1)\n"
    "   b+=c\n"
    "  return b\n"
    " k=0\n"
    " while k!=85:k,_,n=H.unpack(r(H.size));b=r(n)\n"  # the plan and heartbeats come first, then the BUNDLE (U)
    " t=d+'.tmp.%d'%os.getpid();os.makedirs(t)\n"
    " tarfile.open(fileobj=io.BytesIO(b)).extractall(t)\n"
    " import compileall;compileall.compile_dir(t,quiet=1)\n"  # here, not in every relay's own memory
    " try:os.rename(t,d)\n"
    " except OSError:pass\n"
)
# The relay runs as a module imported from its compiled file, not as a script compiled at every start: 5.1 MiB
# on each worker, not 6.4 (7.2 where the bundle had never been compiled). Its path stays in its command line. Its
# flags are the agent's (`python`, bundle.RUN), as the agents its zygote forks are started by that command.
_CHILD = (
    f'p=$1; n=$2; f="{BIN}/$n/relay.py"; [ -f "$f" ] || "$p" -S -E -c "$3" "$n" || exit {MISSING}; '
    'exec "$p" -c "import os, sys; sys.path[0] = os.path.dirname(sys.argv[1]); import relay; '
    'sys.exit(relay.main())" "$f"'
)


def child_command(python: str, bundle: str) -> str:
    """The one shell line a child's sshd runs."""
    return shlex.join(["sh", "-c", _CHILD, "tpurun", python, bundle, _BOOT])


def bundle_tar() -> bytes:
    """This relay's own bundle (every file beside it), as a tar."""
    import tarfile  # here: only a relay with children sends its bundle (0.8 MiB for each leaf)

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for root, _, files in os.walk(HERE):
            for name in sorted(files):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, HERE)
                if "__pycache__" not in rel:
                    tar.add(path, arcname=rel, recursive=False)
    return buf.getvalue()


class Outbox:
    """Bytes for one file descriptor, written by a thread of their own (a slow reader holds up only what
    goes to it), at most QUEUE_BYTES waiting (a putter waits beyond: backpressure). BEAT: what to send when
    nothing went for a second. Closing never waits; abandoning drops what waits and lets every putter go."""

    def __init__(self, fd: int, name: str, beat: bytes = b"") -> None:
        self.fd, self.beat = fd, beat
        self.cond = threading.Condition()
        self.pieces: collections.deque = collections.deque()
        self.size = 0
        self.closing = self.dead = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, data: bytes | None) -> None:
        """DATA queued (None: close the descriptor once what came before is written); nothing after that."""
        with self.cond:
            if data is None:
                self.closing = True
            else:
                while self.size > QUEUE_BYTES and not (self.dead or self.closing):
                    self.cond.wait(1.0)
                if self.dead or self.closing:
                    return
                self.pieces.append(data)
                self.size += len(data)
            self.cond.notify_all()

    def abandon(self) -> None:
        """Nobody will read it: drop what waits, close it, and let every putter go."""
        with self.cond:
            self.dead = True
            self.pieces.clear()
            self.size = 0
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                if not self.pieces and not (self.closing or self.dead):
                    self.cond.wait(relay_wire.BEAT_SECONDS if self.beat else None)
                if self.dead:
                    break
                batch, size = [], 0
                while self.pieces and size < BATCH_BYTES:
                    piece = self.pieces.popleft()
                    batch.append(piece)
                    size += len(piece)
                self.size -= size
                end = self.closing and not self.pieces
                self.cond.notify_all()
            data = b"".join(batch) if batch else self.beat
            if data and not self._write(data):
                break
            if end:
                break
        _close(self.fd)

    def _write(self, data: bytes) -> bool:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError:
            self.abandon()
            return False
        return True


def _own(pipe: Any) -> int:
    """PIPE's descriptor, this relay's alone (its file object closed): an Outbox closes it once, and nothing
    closes the number again after another pipe has taken it."""
    assert pipe is not None
    fd = os.dup(pipe.fileno())
    pipe.close()
    return fd


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _own_address(address: str) -> bool:
    """Whether ADDRESS is one of this worker's own (a connection can leave from it)."""
    import socket  # here: only a relay with children asks (most are leaves)

    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as sock:
            sock.bind((address, 0))
        return True
    except (OSError, ValueError):
        return False


def _pump(fd: int, each: Callable[[bytes], None]) -> None:
    """Every piece read from FD to EACH, until its end."""
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except OSError:
            data = b""
        if not data:
            return
        each(data)


class Local:
    """A channel's program on this worker: ARGV with ENV added, in its own session."""

    def __init__(self, relay: Relay, chan: int, argv: list[str], env: dict[str, str]) -> None:
        self.relay, self.chan = relay, chan
        self.dropped = self.ended = False
        full = dict(relay.env)
        full.update(env)
        program, args = relay.forkable(argv, env)
        self.job = claimed_job(args) if program == AGENT else ""  # a claim's job: streamed here once started
        self.lifeline = threading.Event()  # its stdin ended (the client's, while this relay streams the job)
        self.pace: Any = None
        try:
            forked = relay.zygote.spawn(program, args, full) if program and relay.zygote is not None else None
            self.proc: subprocess.Popen | Forked | None = forked or subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full,
                start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            self.proc = None
            relay.up(relay_wire.frame(relay_wire.ERR, chan, f"cannot start {argv[0]}: {exc.strerror}\n".encode()))
            relay.up(relay_wire.json_frame(relay_wire.EXIT, {"rc": 126 if exc.errno == 13 else 127}, chan))
            return
        self.stdin = Outbox(_own(self.proc.stdin), f"in-{chan}")
        threading.Thread(target=self._watch, name=f"local-{chan}", daemon=True).start()

    def _watch(self) -> None:
        """Its output up as it comes, then its end: once it exited and its pipes ended, or DRAIN seconds after
        it exited where something it left behind holds them open (as sshd reports a command's exit status)."""
        proc = self.proc
        assert proc is not None and proc.stdout is not None and proc.stderr is not None
        readers = [
            threading.Thread(target=self._read, args=(f.fileno(), kind), daemon=True)
            for f, kind in ((proc.stdout, relay_wire.OUT), (proc.stderr, relay_wire.ERR))
        ]
        for t in readers:
            t.start()
        rc = proc.wait()
        for t in readers:
            t.join(DRAIN)
        if isinstance(proc, Forked) and self.job:
            from protocol import AgentExit

            if rc == AgentExit.RELAY_STREAMS:
                rc = self._stream_here()
        self.ended = True
        if not self.dropped:
            self.relay.up(relay_wire.json_frame(relay_wire.EXIT, {"rc": rc if rc >= 0 else -1}, self.chan))
        self.relay.routes.pop(self.chan, None)

    def _read(self, fd: int, kind: int) -> None:
        _pump(fd, lambda data: self.send(kind, data))

    def _stream_here(self) -> int:
        """The claimed job, started by the agent that just ended, streamed by this relay as that agent would have
        gone on to: no process of tpurun's runs beside the job on this worker (zygote.stream_claimed)."""
        import agent  # (here, not before the zygote: a relay that streams no job, exec's, never loads it)

        self.pace = agent.Pace()
        send = lambda data, err: self.send(relay_wire.ERR if err else relay_wire.OUT, data)  # noqa: E731
        return stream_claimed(self.job, send, self.lifeline, self.pace)

    def send(self, kind: int, data: bytes) -> None:
        """DATA up as its KIND (OUT, ERR), unless nobody reads it any more or its end went up."""
        if not (self.dropped or self.ended):
            self.relay.up(relay_wire.frame(kind, self.chan, data))

    def act(self, kind: int, data: bytes) -> None:
        if self.proc is None:
            return
        if kind == relay_wire.INPUT:
            self.stdin.put(data)
        else:  # CLOSE, DROP: its stdin ends
            self.stdin.put(None)
            self.lifeline.set()  # a job streamed here: its supervisor stops it at its stdin's end; the stream goes on
            if self.pace is not None:
                self.pace.wake()
            if kind == relay_wire.DROP and not self.dropped:
                # nobody reads it any more: a hangup, as a program whose SSH channel closed gets a broken pipe (a job
                # streamed here has no program left to hang up on: its supervisor sees its stdin end)
                self.dropped = True
                try:
                    if self.pace is None:
                        os.killpg(self.proc.pid, signal.SIGHUP)
                except OSError:
                    pass


class Child:
    """A child relay, reached with `ssh`, and the subtree below it."""

    def __init__(self, relay: Relay, node: Node, replans: int = 0) -> None:
        self.relay, self.node = relay, node
        self.indexes = set(node.indexes())
        self.ready = threading.Event()
        self.unreached: dict[str, str] = {}
        self.heard = time.monotonic()
        self.err = b""
        self.gone = ""  # why it is lost, once it is
        self.unstarted = False  # lost before it said READY: never reached, or its relay never stood
        self.replans = replans  # how many lost heads it stands in for, one after the other (Relay.start)
        argv = relay.ssh_argv(node) + [child_command(relay.python, relay.bundle)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # its link carries a heartbeat down too: a relay whose parent went silent stops its subtree
        self.link = Outbox(_own(self.proc.stdin), f"down-{node.index}", beat=relay_wire.frame(relay_wire.BEAT))
        self.link.put(self.plan())  # behind ssh's command, not after the relay's HELLO: one round trip less
        self.passing = False  # handing a frame up (a slow link above is not this child's silence)
        self.err_reader = threading.Thread(target=self._read_err, daemon=True)
        self.err_reader.start()
        threading.Thread(target=self._read, name=f"up-{node.index}", daemon=True).start()

    def _read_err(self) -> None:
        def each(data: bytes) -> None:
            self.err = (self.err + data)[-4096:]

        assert self.proc.stderr is not None
        _pump(self.proc.stderr.fileno(), each)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        frames = relay_wire.Frames()
        fd = self.proc.stdout.fileno()
        try:
            while True:
                data = os.read(fd, 1 << 16)
                if not data:
                    break
                self.heard = time.monotonic()
                for kind, number, payload in frames.feed(data):
                    self.passing = True
                    self._take(kind, number, payload)
                    self.passing = False
                    self.heard = time.monotonic()
        except (OSError, ValueError):
            pass
        self.proc.wait()
        self.err_reader.join(timeout=5)  # what ssh said last (a host key refused) may still be on its way
        self.lose(self._why_ended())

    def _take(self, kind: int, number: int, payload: bytes) -> None:
        if kind == relay_wire.BEAT:
            return
        if kind == relay_wire.NEED:  # its bootstrap passed the plan by: the plan again, behind the bundle
            self.link.put(relay_wire.frame(relay_wire.BUNDLE, 0, self.relay.tar()))
            self.link.put(self.plan())
        elif kind == relay_wire.HELLO:
            return  # its plan went with its command
        elif kind == relay_wire.READY:
            self.unreached = json.loads(payload)["unreached"]
            self.ready.set()
        else:
            if kind == relay_wire.EXIT:
                self.relay.routes.pop(number, None)
            self.relay.up(relay_wire.frame(kind, number, payload))

    def plan(self) -> bytes:
        """The PLAN frame for this child: its subtree, and what every relay of the tree is told alike."""
        relay = self.relay
        sub = {"node": self.node.to_wire(), "python": relay.python, "bundle": relay.bundle, "timeout": relay.timeout,
               "silence": relay.dead, "fanout": relay.fanout, "run": relay.run}  # fmt: skip
        return relay_wire.json_frame(relay_wire.PLAN, sub)

    def _why_ended(self) -> str:
        text = self.err.decode("utf-8", "replace")
        last = (text.strip().splitlines() or [""])[-1].strip()
        node, via = self.node, self.relay.node.label
        where = f"worker {node.label} ({node.address})"
        if "Host key verification failed" in text or "IDENTIFICATION HAS CHANGED" in text:
            return (
                f"HOST KEY CHANGED for {where}: relay {via} refused it (the VM that answers there does not hold "
                "the key the TPU published for that worker)"
            )
        if self.proc.returncode == MISSING:
            return f"cannot install tpurun's relay on {where} from relay {via}"
        if self.ready.is_set():
            return f"relay {node.label} went away ({last or f'exit {self.proc.returncode}'}), seen from {via}"
        return f"cannot reach {where} from relay {via}: {last or f'exit {self.proc.returncode}'}"

    def lose(self, why: str) -> None:
        """The child and its subtree are gone: said once (LOST up, or as unreached while connecting)."""
        if self.gone:
            return
        self.gone = why
        self.link.abandon()  # what waits for it will never go: its putters go on
        try:
            self.proc.kill()  # its link ends: below it, every relay and program loses its input
        except OSError:
            pass
        if self.ready.is_set():
            self.relay.up(relay_wire.json_frame(relay_wire.LOST, relay_wire.lost_doc(self.indexes, why)))
        else:
            self.unstarted = True
            self.unreached = {str(i): why for i in self.indexes}
            self.ready.set()

    def watch(self) -> None:
        """Give it up when it has been silent too long once started (a hung VM leaves TCP silent, not closed;
        until it is ready, the start's own deadline holds; while its reader waits to hand a frame up, the
        silence is the link above's)."""
        if self.passing or not self.ready.is_set() or self.gone:
            return
        if time.monotonic() - self.heard > self.relay.dead and not self._unread():
            self.lose(f"relay {self.node.label} stopped answering for {self.relay.dead:.0f} s")

    def _unread(self) -> int:
        """Bytes the child sent that this relay has not read yet: where there are, the child spoke and this
        relay's reader is behind (starved of CPU, as 256 emulated workers on 2 cores make it), not the child silent."""
        assert self.proc.stdout is not None
        try:
            return relay_wire.unread(self.proc.stdout.fileno())
        except ValueError:  # closed
            return 0


class Relay:
    """This worker's relay: its node, children, channels and link up."""

    def __init__(self, plan: dict[str, Any], zygote: Zygote | None = None) -> None:
        self.node = Node.from_wire(plan["node"])
        self.python, self.bundle = plan["python"], plan["bundle"]
        self.run = str(plan.get("run", ""))  # bundle.RUN: how tpurun starts a program of the bundle
        self.zygote = zygote
        self.timeout = float(plan.get("timeout", 15))
        self.dead = float(plan.get("silence", relay_wire.DEAD_SECONDS))  # a child silent this long is lost
        self.fanout = int(plan["fanout"])  # of the subtrees planned anew (start)
        self.env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}  # what a channel's program sees
        self.routes: dict[int, Any] = {}  # channel -> its Local, or the Child it went to
        self.upbox = Outbox(1, "up", beat=relay_wire.frame(relay_wire.BEAT))
        self.private = ""  # 0700: the agent's socket and the children's keys, for a relay with children only
        self.agent: subprocess.Popen | None = None
        self.agent_pid = 0
        self.heard_up = time.monotonic()
        if self.node.children:
            import tempfile  # here: most relays are leaves (0.7 MiB each)

            self.private = tempfile.mkdtemp(prefix="tpurun-relay-")
            if plan.get("key"):  # a root with no child needs no key
                self._hold_key(plan["key"])
            with open(os.path.join(self.private, "known_hosts"), "w") as f:
                for c in self.node.children:
                    f.write(f"{c.alias} {c.key}\n")
        self.children: list[Child] = []
        self._tar: bytes | None = None
        self.source = self.node.address if self.node.children and _own_address(self.node.address) else ""

    def up(self, data: bytes) -> None:
        self.upbox.put(data)

    def forkable(self, argv: list[str], env: dict[str, str]) -> tuple[str, list[str]]:
        """(The program, its arguments) where ARGV runs one of this relay's bundle's PROGRAMS with this relay's
        Python (bundle.RUN) and ENV sets nothing the interpreter reads at its start (the zygote forks it); else
        ("", [])."""
        if len(argv) < 7 or not self.run or argv[:4] != ["sh", "-c", self.run, "tpurun"]:
            return "", []
        if argv[4:6] != [self.python, self.bundle] or argv[6] not in PROGRAMS or any(k.startswith("PYTHON") for k in env):
            return "", []
        return argv[6], argv[7:]

    def tar(self) -> bytes:
        if self._tar is None:
            self._tar = bundle_tar()
        return self._tar

    def _hold_key(self, pem: str) -> None:
        """tpurun's key in an ssh-agent of this relay's, forwarded to the relays below while they connect to
        theirs (`forget` ends it once the tree stands): it never touches a disk. The agent also watches the
        shell that started it, whose stdin is this relay's: if this relay dies before `forget`, the shell and
        then the agent end with it."""
        sock = os.path.join(self.private, "agent")
        self.agent = subprocess.Popen(
            ["ssh-agent", "-a", sock, "sh", "-c", 'echo "$SSH_AGENT_PID"; exec cat >/dev/null'],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        assert self.agent.stdout is not None
        line = self.agent.stdout.readline().strip()
        self.agent_pid = int(line) if line.isdigit() else 0
        deadline = time.monotonic() + 10
        while not os.path.exists(sock):
            if time.monotonic() > deadline or self.agent.poll() is not None:
                raise RuntimeError("ssh-agent did not start")
            time.sleep(0.01)
        env = dict(os.environ, SSH_AUTH_SOCK=sock)
        added = subprocess.run(["ssh-add", "-q", "-"], input=pem.encode(), env=env, capture_output=True)
        if added.returncode != 0:
            raise RuntimeError(f"ssh-add: {added.stderr.decode().strip()}")
        os.environ["SSH_AUTH_SOCK"] = sock

    def ssh_argv(self, node: Node) -> list[str]:
        known = os.path.join(self.private, "known_hosts")
        options = {
            "BatchMode": "yes",
            "StrictHostKeyChecking": "yes",
            "UserKnownHostsFile": known,
            "GlobalKnownHostsFile": "/dev/null",
            "HostKeyAlias": node.alias,
            "CheckHostIP": "no",
            "ConnectTimeout": str(int(self.timeout)),
            "ServerAliveInterval": "5",
            "ServerAliveCountMax": "3",
            "LogLevel": "ERROR",
            "ForwardAgent": "yes" if node.children else "no",  # only a relay that connects needs it
            "ControlMaster": "no",
            "ControlPath": "none",
            # a key exchange and a cipher that cost little CPU (the post-quantum hybrid OpenSSH 9 picks first
            # costs each hop several times more; the slice's own network carries these links)
            "KexAlgorithms": "curve25519-sha256,curve25519-sha256@libssh.org",
            "Ciphers": "aes128-gcm@openssh.com,chacha20-poly1305@openssh.com",
        }
        if self.source:
            # from this worker's own address inside the VPC: a VM without an external address may take SSH only from
            # its network (and IAP's range), which a connection the kernel gives another source address is not from
            options["BindAddress"] = self.source
        argv = ["ssh", "-T", "-F", "/dev/null", "-p", str(node.port), "-l", node.user]
        for k, v in options.items():
            argv += ["-o", f"{k}={v}"]
        return argv + [node.address]

    def start(self) -> None:
        """Reach the children (at once), wait until each answered or failed, and say READY. A child that cannot be
        reached (or start its relay) takes none of the workers below it along: they are planned anew below this
        relay as soon as it failed, headed by the first of them, and so on (REPLANS times at most), all within
        the one deadline the parent waits for this relay."""
        self.children = [Child(self, c) for c in self.node.children]
        unreached: dict[str, str] = {}
        pending = list(self.children)
        limit = self.timeout * 4 + 30
        deadline = time.monotonic() + limit
        while pending:
            for c in list(pending):
                c.watch()
                if not c.ready.is_set() and time.monotonic() > deadline:
                    c.lose(f"relay {c.node.label} did not start within {limit:.0f} s")
                if not c.ready.is_set():
                    continue
                pending.remove(c)
                below = c.node.below()
                if c.unstarted and below and c.replans < REPLANS:
                    unreached[str(c.node.index)] = c.gone
                    c.indexes = {c.node.index}  # its channels from now on: the workers below have a new way
                    pending.append(self._replan(below, c.replans + 1))
                    self.children.append(pending[-1])
                else:
                    unreached.update(c.unreached)
            if pending:
                time.sleep(0.2)
        self.forget()  # every relay below has connected to its children: nobody needs the key any more
        self.heard_up = time.monotonic()
        self.up(relay_wire.json_frame(relay_wire.READY, {"unreached": unreached}))
        threading.Thread(target=self._watch, daemon=True).start()

    def _replan(self, nodes: list[Node], replans: int) -> Child:
        """NODES (a lost child's subtree, without it) as one new child of this relay, its host key pinned here too."""
        (tree,) = relay_wire.plan(nodes, self.fanout, roots=1)
        with open(os.path.join(self.private, "known_hosts"), "a") as f:
            f.write(f"{tree.alias} {tree.key}\n")
        return Child(self, tree, replans)

    def _watch(self) -> None:
        """Children silent too long are given up; a parent silent too long (its heartbeat stopped: it hung,
        or its VM did) ends this relay as the end of its link would."""
        while True:
            time.sleep(relay_wire.BEAT_SECONDS)
            for c in self.children:
                c.watch()
            if time.monotonic() - self.heard_up > self.dead * relay_wire.PARENT_TIMES:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def open(self, opening: Opening) -> None:
        for chan, (worker, env) in opening.workers.items():
            if worker == self.node.index:
                self.routes[chan] = Local(self, chan, opening.argv, env)
        for c in self.children:
            part = opening.only(lambda w, c=c: w in c.indexes)
            if not part.workers:
                continue
            if c.gone:
                for chan in part.workers:
                    self.up(relay_wire.json_frame(relay_wire.EXIT, {"error": c.gone}, chan))
                continue
            for chan in part.workers:
                self.routes[chan] = c
            c.link.put(relay_wire.json_frame(relay_wire.OPEN, part.to_wire()))

    def act(self, kind: int, count: int, payload: bytes) -> None:
        chans, data = relay_wire.split_set(count, payload)
        down: dict[int, list[int]] = {}
        for chan in chans:
            route = self.routes.get(chan)
            if isinstance(route, Local):
                route.act(kind, data)
            elif isinstance(route, Child):
                down.setdefault(id(route), []).append(chan)
        for c in self.children:
            if id(c) in down and not c.gone:
                c.link.put(relay_wire.set_frame(kind, down[id(c)], data))

    def serve(self, frames: Any) -> None:
        for kind, number, payload in frames:
            self.heard_up = time.monotonic()
            if kind == relay_wire.OPEN:
                self.open(Opening.from_wire(json.loads(payload)))
            elif kind in relay_wire.SET_KINDS:
                self.act(kind, number, payload)

    def end(self) -> None:
        """The link up ended: the key and the files go first, then every program and child relay started here is
        given the end of its stdin."""
        self.forget()
        if self.zygote is not None:
            self.zygote.close()
        for route in list(self.routes.values()):
            if isinstance(route, Local):
                route.act(relay_wire.CLOSE, b"")
        for c in self.children:
            c.link.put(None)  # never waits
        deadline = time.monotonic() + 5
        for c in self.children:
            while c.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)

    def forget(self) -> None:
        """The agent holding tpurun's key told to end, and this relay's files removed (its socket with them)."""
        if self.agent is not None:
            if self.agent_pid:
                try:
                    os.kill(self.agent_pid, signal.SIGTERM)  # the agent itself (a child of the shell's)
                except OSError:
                    pass
            self.agent.kill()
            self.agent.wait()
            self.agent = None
        if not self.private or not os.path.isdir(self.private):
            return
        for name in os.listdir(self.private):
            try:
                os.unlink(os.path.join(self.private, name))
            except OSError:
                pass
        try:
            os.rmdir(self.private)
        except OSError:
            pass


def _ended(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    for sig in (signal.SIGHUP, signal.SIGTERM):  # ended from outside: clean up as at the link's end
        signal.signal(sig, _ended)
    os.write(1, relay_wire.frame(relay_wire.HELLO))
    frames = relay_wire.read_frames(lambda n: os.read(0, n))
    try:
        kind, _, payload = next(frames)
        while kind in (relay_wire.BEAT, relay_wire.BUNDLE):  # its parent's heartbeat can come before the plan
            kind, _, payload = next(frames)
    except (StopIteration, ValueError):
        return 2
    if kind != relay_wire.PLAN:
        print("relay: the first frame was not a plan", file=sys.stderr)
        return 2
    plan = json.loads(payload)
    relay = Relay(plan, Zygote() if plan.get("run") else None)  # the zygote first: no thread runs yet
    try:
        relay.start()
        try:
            relay.serve(frames)
        except ValueError:
            pass
    finally:
        relay.end()
        relay.upbox.put(None)
        relay.upbox.thread.join(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
