"""Workers over SSH (paramiko): one connection per worker, its host key checked against tpurun's pinned
known_hosts only, under the worker's identity (its node's unique id and its index), never under its
address; unknown or changed keys are refused. A keepalive that wants an answer notices a worker that
stopped answering.

The three modes of a `Runner`: `run` puts the command on a leash on the worker (a small POSIX-sh wrapper),
which kills the command's process group (TERM, then KILL after a grace) when the channel's stdin closes, i.e.
when tpurun stops it on purpose *or* when tpurun dies and the connection drops, so such a process never
outlives the tpurun that started it; `stream` and `pipe` run the program as it is (the job agent and
sync's helper end, or stop their job, when their stdin closes).
"""

from __future__ import annotations

import re
import select
import shlex
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tpurun import config
from tpurun.cloud import keys
from tpurun.errors import UnreachableError, UsageError
from tpurun.transport._paramiko import paramiko
from tpurun.transport.runner import (
    BEHIND_TIMEOUTS,
    RUN_GRACE,
    LineSink,
    LineSplitter,
    Pipe,
    Run,
    Runner,
    Stream,
    Worker,
    refuse_nul,
)
from tpurun.worker import relay_wire

# Opens the byte stream to a worker's sshd within its seconds, where that is not a TCP connection from here to the
# worker's address: IAP's tunnel (iap.py), a user's ProxyCommand (proxy_command.py). A socket, or what paramiko
# takes for one.
Dial = Callable[[float], Any]

# Answers a worker's keyboard-interactive questions (OS Login's 2-step verification asks a person after the key):
# ask(the worker's name, [(prompt, echo)]) -> an answer per prompt.
Ask = Callable[[str, list[tuple[str, bool]]], list[str]]

# A worker that stops answering (network partition, hung VM) leaves TCP silent rather than closed.
# Every connection sends an SSH keepalive that asks for a reply every KEEPALIVE_INTERVAL seconds;
# no reply within KEEPALIVE_TIMEOUT seconds closes the connection, so every command on that worker
# ends with "stopped answering" (exit 4) within INTERVAL + TIMEOUT seconds (20 s by default).
KEEPALIVE_INTERVAL = 5.0
KEEPALIVE_TIMEOUT = 15.0
DRAIN = 1.0  # seconds a command's output is still read after its exit status where it has not ended (a relay's too)


def keepalive_settings() -> tuple[float, float]:
    """(interval, timeout) in seconds; TPURUN_KEEPALIVE_INTERVAL / TPURUN_KEEPALIVE_TIMEOUT override."""
    try:
        interval = config.KEEPALIVE_INTERVAL.number()
        timeout = config.KEEPALIVE_TIMEOUT.number()
    except ValueError:
        raise UsageError("TPURUN_KEEPALIVE_INTERVAL and TPURUN_KEEPALIVE_TIMEOUT must be seconds") from None
    return max(0.1, interval), max(0.5, timeout)


class Liveness:
    """Pings one SSH transport (keepalive@openssh.com, reply wanted) and closes it when no reply comes.

    sshd answers unknown global requests with REQUEST_FAILURE, which is all we need: an answer.
    """

    def __init__(self, transport: paramiko.Transport, worker: Worker) -> None:
        self.transport = transport
        self.worker = worker
        self.interval, self.timeout = keepalive_settings()
        self.dead: str = ""  # why the connection was given up, once it was
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name=f"keepalive-w{worker.index}")
        self._thread.start()

    def _watch(self) -> None:
        t = self.transport
        while not self._stop.wait(self.interval):
            if not t.is_active():
                return
            answered = threading.Event()

            def ping(answered: threading.Event = answered) -> None:
                try:
                    t.global_request("keepalive@openssh.com", wait=True)  # returns on any reply or close
                except Exception:
                    pass
                answered.set()

            threading.Thread(target=ping, daemon=True, name=f"ping-w{self.worker.index}").start()
            waited = answered.wait(self.timeout)
            # the reply may wait behind bytes this process has not read yet: the worker spoke, we are behind
            for _ in range(int(self.timeout * (BEHIND_TIMEOUTS - 1))):
                if waited or self._stop.is_set() or not unread(t):
                    break
                waited = answered.wait(1.0)
            if not waited and not self._stop.is_set():
                self.dead = (
                    f"worker {self.worker.label()} stopped answering: no reply to an SSH keepalive "
                    f"for {self.timeout:.0f} s"
                )
                t.close()
                return

    def stop(self) -> None:
        self._stop.set()


# The leash: `run`'s command on the worker, held by the channel's stdin (not the TPU's watchdog, which is
# worker/watchdog.py). $1 = grace seconds, the rest = the user's argv (never re-split: "$@").
# fd 3 keeps the channel's stdin for the leash (an asynchronous list's stdin is /dev/null
# otherwise); the command itself reads /dev/null. setsid gives the command its own process group
# (its pid = pgid), which is what we signal.
_LEASH = (
    # a missing program is named as the user typed it, not through setsid's own message
    """g=$1; shift; command -v "$1" >/dev/null 2>&1 || { printf 'cannot start %s: command not found\\n' "$1" >&2; """
    "exit 127; }; "
    'exec 3<&0; setsid "$@" </dev/null & p=$!; '
    "( while read -r _ <&3; do :; done; kill -TERM -$p 2>/dev/null; i=0; "
    "while kill -0 -$p 2>/dev/null && [ $i -lt $((g*10)) ]; do sleep 0.1; i=$((i+1)); done; "
    "kill -KILL -$p 2>/dev/null ) & w=$!; exec 3<&-; "
    "wait $p; rc=$?; kill $w 2>/dev/null; "
    # whatever the command left behind in its group goes too
    "if kill -0 -$p 2>/dev/null; then kill -TERM -$p 2>/dev/null; sleep 0.2; kill -KILL -$p 2>/dev/null; fi; "
    "exit $rc"
)


def leash_argv(argv: Sequence[str], grace: float = RUN_GRACE, env: Mapping[str, str] | None = None) -> list[str]:
    """ARGV on the leash (the argv a worker runs for `run`), once ARGV and ENV are checked: no NUL byte, and
    each of ENV's names a variable's."""
    refuse_nul([*argv, *(env or {}).values()])
    for name in env or {}:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UsageError(f"not a variable name: {name!r}")
    return ["sh", "-c", _LEASH, "tpurun", str(max(1, int(round(grace)))), *argv]


def wrap_command(argv: Sequence[str], grace: float = RUN_GRACE, env: Mapping[str, str] | None = None) -> str:
    """The one shell line sshd runs: the leash with ARGV quoted so it arrives exactly, ENV's variables
    assigned in front of it (each value quoted)."""
    leash = shlex.join(leash_argv(argv, grace, env))
    return " ".join([*(f"{name}={shlex.quote(value)}" for name, value in (env or {}).items()), leash])


class _Transport(paramiko.Transport):
    """A worker's keyboard-interactive step (after the key: OS Login's 2-step verification) answered by `answer`, the
    person asked through the runner's ASK, never by paramiko's own prompt on this process's stdin; refused where
    there is nobody to ask. `asked`: whether the worker asked."""

    answer: Callable[[str, str, list[tuple[str, bool]]], list[str]] | None = None
    asked = False

    def auth_interactive_dumb(self, username: str, handler: Any = None, submethods: str = "") -> list[str]:
        if self.answer is None:
            raise paramiko.AuthenticationException("a second step after the key, and nobody to answer it")
        self.asked = True
        return list(self.auth_interactive(username, self.answer, submethods))


def _fast_transport(*args: Any, **kwargs: Any) -> _Transport:
    """A paramiko Transport that prefers AES-GCM: one AEAD call per packet instead of AES-CTR plus a
    separate HMAC, about 40% less CPU per byte on both ends (matters for `sync`'s bulk data)."""
    t = _Transport(*args, **kwargs)
    opts = t.get_security_options()
    gcm = [c for c in ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com") if c in opts.ciphers]
    opts.ciphers = tuple(gcm + [c for c in opts.ciphers if c not in gcm])
    return t


_host_keys_cache: dict[tuple[str, int, int, int], dict[str, str]] = {}
_host_keys_lock = threading.Lock()


def _pin_host_keys(client: paramiko.SSHClient, known_hosts: Path, worker: Worker) -> None:
    """Give CLIENT the pinned key of WORKER only. The file is read once per process (`keys.read_pinned`) and only
    the worker's own key is parsed: paramiko's HostKeys merges every line it loads with those before (O(N^2) in
    the TPUs' workers pinned: 1.8 s of CPU with 2,048 lines, before this command reached anything)."""
    try:
        st = known_hosts.stat()
    except FileNotFoundError:
        return
    cache_key = (str(known_hosts), st.st_ino, st.st_mtime_ns, st.st_size)
    with _host_keys_lock:
        pinned = _host_keys_cache.get(cache_key)
        if pinned is None:
            pinned = keys.read_pinned(known_hosts)
            _host_keys_cache.clear()
            _host_keys_cache[cache_key] = pinned
    line = pinned.get(worker.host_key) if worker.host_key else None
    if line is None:
        return
    try:
        entry = paramiko.hostkeys.HostKeyEntry.from_line(f"{worker.host_key} {line}")
    except (paramiko.SSHException, ValueError, TypeError):
        return  # a key a worker published that is no key: nothing pinned, so the worker is refused
    if entry is not None and entry.key is not None:
        # the name paramiko checks the server's key under; the key is the one pinned for the worker's identity
        host = worker.address if worker.port == 22 else f"[{worker.address}]:{worker.port}"
        client.get_host_keys().add(host, entry.key.get_name(), entry.key)


def readable(chan: paramiko.Channel, timeout: float) -> bool:
    """Wait until CHAN has something to read, TIMEOUT seconds at most. poll, not select: a command on a
    thousand workers holds descriptors numbered past select's limit of 1,024 (a channel's is a pipe)."""
    poller = select.poll()
    poller.register(chan.fileno(), select.POLLIN)
    return bool(poller.poll(max(0.0, timeout) * 1000))


def _drain(chan: paramiko.Channel, out: LineSplitter, err: LineSplitter) -> bool:
    """What CHAN holds of its command's stdout and stderr, fed to OUT and ERR; whether there was any."""
    got = False
    while chan.recv_ready():
        out.feed(chan.recv(65536))
        got = True
    while chan.recv_stderr_ready():
        err.feed(chan.recv_stderr(65536))
        got = True
    return got


def _why_unreachable(exc: BaseException) -> str:
    """What a failed TCP connection or SSH banner most likely means, in words (not `[Errno None] ...`)."""
    if isinstance(exc, socket.timeout | TimeoutError):
        return "no answer within the timeout (the VM is down or stopped, or a firewall rule drops port 22)"
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError | ConnectionRefusedError):
        return "the connection was refused (its sshd is not running yet or any more, or the VM is gone)"
    if isinstance(exc, EOFError | ConnectionResetError) or "protocol banner" in str(exc):
        return "the connection was closed during the SSH handshake (its sshd is starting or overloaded)"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


@contextmanager
def _converted(worker: Worker, liveness: Liveness | None) -> Iterator[None]:
    """paramiko's and the socket's errors on a connected worker as tpurun's own: it dropped us (why, where
    LIVENESS knows)."""
    try:
        yield
    except (paramiko.SSHException, OSError, EOFError) as exc:
        dead = liveness.dead if liveness is not None else ""
        raise UnreachableError(dead or f"worker {worker.label()}: {exc}") from None


class SshRunner(Runner):
    """One paramiko connection to one worker, host key checked against the pinned known_hosts."""

    def __init__(
        self,
        worker: Worker,
        *,
        key_path: Path,
        known_hosts: Path,
        connect_timeout: float = 15.0,
        auth_retries: int | None = None,
        auth_retry_delay: float | None = None,
        node_name: str = "",
        renew: Callable[[], object] | None = None,
        login_hint: str = "",
        dial: Dial | None = None,
        through: str = "",
        answered: str = "",
        reach_hint: str = "",
        ask: Ask | None = None,
    ) -> None:
        """RENEW: called before each new connection (OS Login renews tpurun's key where it is about to expire);
        LOGIN_HINT: what to do when the worker refuses tpurun's key (else: attach installs it in ssh-keys);
        DIAL: opens the byte stream to the worker's sshd (IAP's tunnel, a ProxyCommand) where it is not a TCP
        connection from here to its address, THROUGH naming that way for messages ("through IAP"), and ANSWERED what
        answers there when its host key is not the worker's (where it is not the VM at its address); REACH_HINT: what
        to do when it cannot be reached (else: `tpurun describe`); ASK: who answers a second step after the key (none:
        such a worker refuses tpurun)."""
        self.ask = ask
        self.worker = worker
        self.dial, self.through, self.reach_hint = dial, through, reach_hint
        self.answered = answered or (
            f"the VM that answers at {worker.address} does not hold the key the TPU published for that worker: "
            "another VM has the address now, or a man in the middle"
        )
        self.renew, self.login_hint = renew, login_hint
        self.key_path = key_path
        self.known_hosts = known_hosts
        self.connect_timeout = connect_timeout
        self.auth_retries = auth_retries if auth_retries is not None else config.SSH_RETRIES.integer()
        self.auth_retry_delay = auth_retry_delay if auth_retry_delay is not None else config.SSH_RETRY_DELAY.number()
        self.node_name = node_name
        self.client: paramiko.SSHClient | None = None
        self.liveness: Liveness | None = None

    @property
    def dead_reason(self) -> str:
        return self.liveness.dead if self.liveness is not None else ""

    def _attach_hint(self) -> str:
        return f"`tpurun attach {self.node_name}`" if self.node_name else "`tpurun attach NAME`"

    def _of_tpu(self) -> str:
        return f" of {self.node_name}" if self.node_name else ""

    def connect(self) -> None:
        if self.client is not None:
            transport = self.client.get_transport()
            if transport is not None and transport.is_active():
                return  # connected already (a relay's root, reached again for a conversation of its own)
            self.close()  # a connection that dropped: its client and its liveness go with it
        self.refused_key = False
        if self.renew is not None:
            self.renew()
        client = paramiko.SSHClient()
        # only tpurun's pinned keys; never the user's known_hosts, never trust on first use
        if self.known_hosts.exists():
            _pin_host_keys(client, self.known_hosts, self.worker)
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        pkey = paramiko.Ed25519Key.from_private_key_file(str(self.key_path)) if self.key_path.exists() else None
        w = self.worker
        made: list[_Transport] = []  # this connection's transports: whether the worker asked a second step
        attempt = 0
        while True:
            attempt += 1
            sock = self.dial(self.connect_timeout) if self.dial is not None else None  # UnreachableError: said
            try:
                client.connect(
                    w.address,
                    port=w.port,
                    username=w.user,
                    pkey=pkey,
                    allow_agent=pkey is None,
                    look_for_keys=pkey is None,
                    timeout=self.connect_timeout,
                    banner_timeout=self.connect_timeout,
                    auth_timeout=self.connect_timeout,
                    transport_factory=self._factory(made),
                    sock=sock,
                )
                break
            except paramiko.BadHostKeyException:
                client.close()
                self.refused_key = True
                raise UnreachableError(
                    f"HOST KEY CHANGED for worker {w.label()}{self._of_tpu()}: refusing to connect ({self.answered})",
                    hint=f"`tpurun describe {self.node_name or 'NAME'}` shows the TPU's workers",
                ) from None
            except paramiko.SSHException as exc:
                client.close()
                if "not found in known_hosts" in str(exc):
                    self.refused_key = True
                    raise UnreachableError(
                        f"no pinned host key for worker {w.label()}{self._of_tpu()}: refusing to trust an unknown host",
                        hint=f"{self._attach_hint()} pins the keys the TPU published",
                    ) from None
                auth = isinstance(exc, paramiko.AuthenticationException)
                if "protocol banner" in str(exc):  # the connection ended before SSH began: not a login refused
                    raise self._cut(client, sock, exc) from None
                if auth and made and made[-1].asked:  # its second step refused: asking again asks the person again
                    raise UnreachableError(
                        f"cannot log in to worker {w.label()} as {w.user}: its 2-step verification refused the answer",
                        hint="run the command again with a code that is still valid",
                    ) from None
                if attempt > self.auth_retries or not auth:
                    what = "authentication failed" if auth else f"ssh error: {exc}"
                    raise UnreachableError(
                        f"cannot log in to worker {w.label()} as {w.user}: {what}",
                        hint=self.login_hint or f"{self._attach_hint()} installs tpurun's key in the node's ssh-keys",
                    ) from None
                # a key freshly added to metadata takes a moment to reach the workers
                time.sleep(self.auth_retry_delay)
                client = paramiko.SSHClient()
                if self.known_hosts.exists():
                    _pin_host_keys(client, self.known_hosts, self.worker)
                client.set_missing_host_key_policy(paramiko.RejectPolicy())
            except (OSError, EOFError) as exc:
                raise self._cut(client, sock, exc) from None
        transport = client.get_transport()
        assert transport is not None
        transport.set_keepalive(15)
        self.liveness = Liveness(transport, w)
        self.client = client

    def _factory(self, made: list[_Transport]) -> Callable[..., paramiko.Transport]:
        """paramiko's transport factory for a connection: each transport made, added to MADE, answers a second step
        through ASK, naming the worker."""
        ask, name = self.ask, self.worker.name

        def transport(*args: Any, **kwargs: Any) -> paramiko.Transport:
            t = _fast_transport(*args, **kwargs)
            if ask is not None:
                t.answer = lambda title, instructions, prompts: ask(name, [(p, e) for p, e in prompts])
            made.append(t)
            return t

        return transport

    def _cut(self, client: paramiko.SSHClient, sock: Any, exc: BaseException) -> UnreachableError:
        """The connection to the worker (through DIAL's SOCK, where it has one) failed or ended before SSH began:
        said with what its way said of it (a ProxyCommand's last words)."""
        why = sock.why() if hasattr(sock, "why") else _why_unreachable(exc)
        client.close()
        if sock is not None:
            sock.close()
        way = self.through or f"on port {self.worker.port}"
        return UnreachableError(
            f"cannot reach worker {self.worker.label()}{self._of_tpu()} {way}: {why}", hint=self._reach_hint()
        )

    def _reach_hint(self) -> str | None:
        if self.reach_hint:
            return self.reach_hint
        return f"`tpurun describe {self.node_name}` shows its state" if self.node_name else None

    def run_to_end(self, run: Run) -> int:
        command = wrap_command(run.argv, run.grace, run.env)
        with _converted(self.worker, self.liveness):
            return self._run(command, run.sink, run.stop, run.grace)

    def _run(self, command: str, sink: LineSink, stop: threading.Event, grace: float) -> int:
        transport = self.transport()
        chan = transport.open_session()
        chan.exec_command(command)
        i = self.worker.index
        out = LineSplitter(lambda line: sink(i, "out", line))
        err = LineSplitter(lambda line: sink(i, "err", line))
        stop_sent = False
        last_alive = time.monotonic()
        exited = 0.0  # when its exit status came: sshd may send it before the last of its output
        while True:
            if stop.is_set() and not stop_sent:
                chan.shutdown_write()  # the leash sees EOF and stops the process group
                stop_sent = True
            if chan.eof_received:  # (its descriptor stays readable from then on)
                chan.status_event.wait(0.1)
            else:
                readable(chan, 0.1)
            got = _drain(chan, out, err)
            if got:
                last_alive = time.monotonic()
            if chan.exit_status_ready():
                exited = exited or time.monotonic()
                # its output ends with EOF; or DRAIN after its exit, where something it left behind holds it open
                if chan.eof_received or time.monotonic() - exited > DRAIN:
                    break
            if chan.closed or not transport.is_active():
                break
            if stop_sent and time.monotonic() - last_alive > grace + 30:
                break
        _drain(chan, out, err)
        out.flush()
        err.flush()
        if not transport.is_active() and not chan.exit_status_ready():
            raise UnreachableError(self.dead_reason or f"lost the connection to worker {self.worker.label()}")
        rc = chan.recv_exit_status()
        chan.close()
        return rc

    def transport(self) -> paramiko.Transport:
        """The connection's transport; UnreachableError where there is none (never connected, or closed after
        a drop and not reached again)."""
        transport = self.client.get_transport() if self.client is not None else None
        if transport is None:
            raise UnreachableError(self.dead_reason or f"not connected to worker {self.worker.label()}")
        return transport

    def stream(self, argv: Sequence[str]) -> Stream:
        transport = self.transport()
        with _converted(self.worker, self.liveness):
            chan = transport.open_session()
            exec_pipelined(chan, shlex.join(argv))  # its input (a relay's plan, a call's) goes with it
        return SshStream(chan, self.liveness, self.worker)

    def pipe(self, argv: Sequence[str]) -> Pipe:
        with _converted(self.worker, self.liveness):
            return SshPipe(self, argv)

    def close(self) -> None:
        if self.liveness is not None:
            self.liveness.stop()
        if self.client is not None:
            self.client.close()
            self.client = None

    def __repr__(self) -> str:
        return f"SshRunner({self.worker})"


def send_all(chan: paramiko.Channel, data: bytes | bytearray | memoryview) -> None:
    """Send every byte of DATA on CHAN. paramiko's own Channel.sendall re-slices the rest of its input
    after each 32 KiB packet, copying O(n^2) bytes (half the client's CPU in a bulk sync with 1 MiB
    writes); sending successive views of one memoryview copies nothing."""
    view = memoryview(data)
    while view:
        sent = chan.send(view)
        if sent <= 0:
            raise OSError("the SSH channel no longer accepts data")
        view = view[sent:]


def unread(transport: paramiko.Transport) -> int:
    """Bytes TRANSPORT's worker sent that wait unread in this machine's socket (0 where it is not a socket)."""
    try:
        return relay_wire.unread(transport.sock.fileno())
    except (AttributeError, OSError, ValueError):  # a ProxyCommand's: no socket; a closed one
        return 0


class SshStream(Stream):
    def __init__(self, chan: paramiko.Channel, liveness: Liveness | None, worker: Worker) -> None:
        self.chan = chan
        self.err = b""
        self.liveness = liveness
        self.worker = worker

    def write(self, data: bytes) -> None:
        with _converted(self.worker, self.liveness):
            send_all(self.chan, data)

    def behind(self) -> bool:
        return unread(self.chan.get_transport()) > 0

    def close_stdin(self) -> None:
        try:
            self.chan.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass

    def read(self, timeout: float = 0.1) -> bytes | None:
        with _converted(self.worker, self.liveness):
            return self._read(timeout)

    def _read(self, timeout: float) -> bytes | None:
        while self.chan.recv_stderr_ready():
            self.err += self.chan.recv_stderr(65536)
        if self.chan.recv_ready():
            return self.chan.recv(1 << 20)
        if self.chan.eof_received or self.chan.closed:
            data = self.chan.recv(1 << 20) if self.chan.recv_ready() else b""
            return data or None
        transport = self.chan.get_transport()
        if transport is None or not transport.is_active():
            return None
        readable(self.chan, timeout)
        if self.chan.recv_ready():
            return self.chan.recv(1 << 20)
        return b""

    def stderr_text(self) -> str:
        while self.chan.recv_stderr_ready():
            self.err += self.chan.recv_stderr(65536)
        text = self.err.decode("utf-8", errors="replace")
        if self.liveness is not None and self.liveness.dead:
            text += ("\n" if text and not text.endswith("\n") else "") + self.liveness.dead
        return text

    def wait(self) -> int:
        transport = self.chan.get_transport()
        if transport is None or not transport.is_active():
            return -1 if not self.chan.exit_status_ready() else self.chan.recv_exit_status()
        return self.chan.recv_exit_status()

    def kill(self) -> None:
        self.chan.close()


def exec_pipelined(chan: paramiko.Channel, command: str) -> None:
    """COMMAND's exec request on CHAN, not waiting for the server's reply: what the caller sends next leaves with it
    (sshd takes a channel's messages in order). A refused request closes the channel, which its reader sees as
    the end with no exit status."""
    try:
        from paramiko.common import cMSG_CHANNEL_REQUEST
        from paramiko.message import Message

        msg = Message()
        msg.add_byte(cMSG_CHANNEL_REQUEST)
        msg.add_int(chan.remote_chanid)
        msg.add_string("exec")
        msg.add_boolean(True)
        msg.add_string(command)
        chan._event_pending()
        chan.transport._send_user_message(msg)  # type: ignore[union-attr]
    except (ImportError, AttributeError):  # another paramiko: the plain, waiting request
        chan.exec_command(command)


class SshPipe:
    """ARGV on one new channel of a connected SshRunner, its exec request pipelined: the caller goes on
    sending without waiting for the server's reply (a refused request closes the channel, which the
    reader then sees)."""

    def __init__(self, runner: SshRunner, argv: Sequence[str]) -> None:
        self.worker, self.liveness = runner.worker, runner.liveness
        self.chan = runner.transport().open_session()
        exec_pipelined(self.chan, shlex.join(argv))

    def send(self, data: bytes) -> None:
        with _converted(self.worker, self.liveness):
            send_all(self.chan, data)

    def recv(self, n: int) -> bytes:
        with _converted(self.worker, self.liveness):
            return self.chan.recv(n)

    def close_write(self) -> None:
        with _converted(self.worker, self.liveness):
            self.chan.shutdown_write()

    def close(self) -> None:
        self.chan.close()

    def ended(self) -> tuple[int | None, bytes]:
        err = b""
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and not self.chan.exit_status_ready():
            time.sleep(0.05)
        while self.chan.recv_stderr_ready():
            err += self.chan.recv_stderr(65536)
        rc = self.chan.exit_status if self.chan.exit_status_ready() else None
        transport = self.chan.get_transport()
        if rc in (None, -1) and not err.strip() and (transport is None or not transport.is_active()):
            return None, b""  # paramiko reports -1 when the connection, not the program, ended
        return rc, err
