"""What flows through a relay tree, written once: the frames tpurun and its relays (relay.py) send each other.

Part of the worker bundle (stdlib only, Python >= 3.8). A relay is a worker that reaches other workers of its
slice for tpurun: the client reaches a few workers (the top relays), each reaches a few more over the slice's
internal addresses, and so on down the tree. Every worker in the tree runs one relay process, which starts the
programs of the channels opened on that worker as its own children; so a relay's link carries the channels of
its whole subtree, and the client's work grows with the number of top relays, not with the pod.

A link is a byte stream of frames in both directions. A frame is a header (`HEADER`: its kind, a number, the
payload's length) and a payload. The number is a channel for the frames of one channel, the count of channels
for the frames that address several at once (`SET_KINDS`: the payload starts with that many channel numbers,
then the data; a relay sends each child only the part of the set that lives in the child's subtree, so data
meant for many workers, such as a sync's stream, crosses each link once), and 0 for the others.

Down the tree (the client's side speaks first):

* `PLAN` (JSON, once): the relay's subtree (`Node`), how to reach the children, the first relay's key, and
  the fan-out by which the workers below a child it cannot reach are planned anew. It is written right behind
  the command that starts the relay, without waiting for a word from it (a worker without the bundle gets it
  again behind the `BUNDLE`);
* `OPEN` (JSON): start a program on some workers (`Opening`), one channel each, stdin open. It may come right
  behind the PLAN: a relay reads nothing after its plan until its subtree stands (or said READY with what it
  could not reach), so what comes meanwhile waits, in order, for the tree it needs;
* `INPUT`: bytes for the stdin of a set of channels; `CLOSE`: end their stdin; `DROP`: stop reading them
  and end their stdin, as closing an SSH channel does (what a program does then is its own affair).

Up the tree:

* `HELLO`: the relay started (the bundle was there), or `NEED`: the worker has no bundle, which its parent
  sends (`BUNDLE`, a tar) and the PLAN again behind it;
* `READY` (JSON, once): the relay and its subtree are reached, but for the workers it names (`{index: why}`);
* `OUT`, `ERR`: a channel's stdout and stderr bytes, in order, in the pieces the program wrote them;
* `EXIT` (JSON): how a channel's program ended (`{"rc": N}`), or why it never ran (`{"error": WHY}`);
* `LOST` (JSON): workers whose relay stopped answering or went away (`{"workers": [...], "why": WHY}`); their
  open channels ended with them;
* `BEAT`: a relay with nothing else to say says this every `BEAT_SECONDS`; a link silent for the plan's
  "silence" (`DEAD_SECONDS` by default) is given up, and the subtree behind it is LOST. The parent's side
  beats down too: a relay whose parent has been silent for `PARENT_TIMES` silences ends as if its link had
  (its programs and its subtree with it).

Only JSON and bytes ever cross a link: nothing a worker sends can make the client run code.
"""

from __future__ import annotations

import json
import struct

TYPE_CHECKING = False  # typing is not imported on a worker; type checkers read True
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence
    from typing import Any

HEADER = struct.Struct(">BII")  # kind, channel (or count of channels, or 0), payload length
CHANNEL = struct.Struct(">I")

# down
PLAN = ord("P")
OPEN = ord("O")
INPUT = ord("I")
CLOSE = ord("C")
DROP = ord("D")
BUNDLE = ord("U")
# up
HELLO = ord("H")  # a relay started (its bundle is there): what was sent to it before will be read
NEED = ord("N")  # (from a child's bootstrap) this worker has no bundle: send it as BUNDLE (down), the tar
READY = ord("R")
OUT = ord("o")
ERR = ord("e")
EXIT = ord("x")
LOST = ord("L")
BEAT = ord("B")

SET_KINDS = frozenset({INPUT, CLOSE, DROP})
BEAT_SECONDS = 1.0
DEAD_SECONDS = 15.0  # the default silence after which a link is given up (the plan's "silence")
PARENT_TIMES = 4  # a relay whose parent sent nothing, not even a heartbeat, for this many silences ends (60 s
# by default: as long as an attached job's agent waits for a client that went quiet)
MAX_PAYLOAD = 1 << 24  # a frame bigger than this is a broken link, not a frame


def unread(fd: int) -> int:
    """Bytes waiting unread on descriptor FD (a pipe or a socket): where there are, its sender spoke and the reader
    is behind (starved of CPU), not the sender silent; what a relay and this machine ask before giving one up."""
    import fcntl  # here: asked only of a link silent for long
    import sys
    import termios

    buf = bytearray(4)
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf)
    except (OSError, ValueError):
        return 0
    return int.from_bytes(buf, sys.byteorder)


def frame(kind: int, channel: int = 0, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, channel, len(payload)) + payload


def json_frame(kind: int, doc: Any, channel: int = 0) -> bytes:
    """KIND with DOC as its JSON payload (of CHANNEL: an EXIT)."""
    return frame(kind, channel, json.dumps(doc, separators=(",", ":")).encode())


def set_frame(kind: int, channels: Sequence[int], data: bytes = b"") -> bytes:
    """KIND for every channel of CHANNELS at once, with DATA (INPUT's bytes)."""
    head = b"".join(CHANNEL.pack(c) for c in channels)
    return frame(kind, len(channels), head + data)


def split_set(count: int, payload: bytes) -> tuple[list[int], bytes]:
    """A set frame's (channels, data)."""
    end = count * CHANNEL.size
    return [CHANNEL.unpack_from(payload, i)[0] for i in range(0, end, CHANNEL.size)], payload[end:]


class Frames:
    """Frames out of a byte stream fed in pieces (`feed`), as (kind, number, payload)."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> Iterator[tuple[int, int, bytes]]:
        self.buf += data
        at = 0
        buf = self.buf
        while len(buf) - at >= HEADER.size:
            kind, number, size = HEADER.unpack_from(buf, at)
            if size > MAX_PAYLOAD:
                raise ValueError(f"a frame of {size} bytes: the link is broken")
            end = at + HEADER.size + size
            if len(buf) < end:
                break
            yield kind, number, bytes(buf[at + HEADER.size : end])
            at = end
        del buf[:at]


def read_frames(read: Callable[[int], bytes]) -> Iterator[tuple[int, int, bytes]]:
    """Every frame READ (os.read-like: b"" at the end) gives, until the end."""
    frames = Frames()
    while True:
        data = read(1 << 16)
        if not data:
            if frames.buf:
                raise ValueError("the link ended inside a frame")
            return
        yield from frames.feed(data)


class Node:
    """One worker of a relay tree and the subtree it reaches: where tpurun's relays find it (its address inside
    the slice), the name its host key is pinned under and that key, and its children."""

    def __init__(
        self,
        index: int,
        label: str,
        address: str,
        port: int,
        user: str,
        alias: str,
        key: str,
        children: Sequence[Node] = (),
    ) -> None:
        self.index, self.label, self.address, self.port, self.user = index, label, address, port, user
        self.alias, self.key = alias, key  # HostKeyAlias, and "ssh-ed25519 AAAA..."
        self.children = list(children)

    def to_wire(self) -> dict[str, Any]:
        return {
            "i": self.index,
            "n": self.label,
            "a": self.address,
            "p": self.port,
            "u": self.user,
            "h": self.alias,
            "k": self.key,
            "c": [c.to_wire() for c in self.children],
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Node:
        kids = [cls.from_wire(c) for c in d["c"]]
        return cls(d["i"], d["n"], d["a"], d["p"], d["u"], d["h"], d["k"], kids)

    def walk(self) -> Iterator[Node]:
        """This node and every node below it."""
        yield self
        for c in self.children:
            yield from c.walk()

    def indexes(self) -> list[int]:
        return [n.index for n in self.walk()]

    def below(self) -> list[Node]:
        """Every node below this one, childless, in order: what is planned anew when this one cannot be reached."""
        return [Node(n.index, n.label, n.address, n.port, n.user, n.alias, n.key) for n in self.walk()][1:]


def plan(nodes: Sequence[Node], fanout: int, roots: int = 0) -> list[Node]:
    """NODES (childless) as trees: ROOTS (else FANOUT) contiguous groups, each headed by its first node, whose
    rest is planned the same way below it in at most FANOUT groups. Balanced: the depth grows with
    log_FANOUT of the count."""
    out = []
    for g in chunks(nodes, roots or fanout):
        head = g[0]
        kids = plan(g[1:], fanout)
        out.append(Node(head.index, head.label, head.address, head.port, head.user, head.alias, head.key, kids))
    return out


def chunks(items: Sequence[Any], most: int) -> list[Sequence[Any]]:
    """ITEMS in at most MOST contiguous groups of sizes that differ by one at most."""
    n = min(most, len(items))
    if n <= 0:
        return []
    size, extra = divmod(len(items), n)
    out, at = [], 0
    for i in range(n):
        step = size + (1 if i < extra else 0)
        out.append(items[at : at + step])
        at += step
    return out


class Opening:
    """What `OPEN` starts: ARGV on each worker of WORKERS ({channel: (worker, variables added)})."""

    def __init__(self, argv: Sequence[str], workers: dict[int, tuple[int, dict[str, str]]]) -> None:
        self.argv = list(argv)
        self.workers = workers

    def to_wire(self) -> dict[str, Any]:
        return {"argv": self.argv, "w": [[c, w, env] for c, (w, env) in self.workers.items()]}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Opening:
        return cls(d["argv"], {c: (w, env) for c, w, env in d["w"]})

    def only(self, keep: Callable[[int], bool]) -> Opening:
        """The part of it on the workers KEEP says yes to."""
        return Opening(self.argv, {c: (w, env) for c, (w, env) in self.workers.items() if keep(w)})


def lost_doc(workers: Iterable[int], why: str) -> dict[str, Any]:
    return {"workers": sorted(workers), "why": why}
