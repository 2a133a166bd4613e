"""The worker's end of `tpurun sync` (it receives) and of `tpurun download` (it sends): a stdlib-only
program run on each worker (or locally).

tpurun ships this file's source with the command line (``python3 -c ...``), so workers need no
install; it must therefore stay stdlib-only and run on Python 3.8 or newer (no ``match``, no
``X | Y`` outside annotations, no ``str.removeprefix``).

Protocol, on the process's stdin/stdout, every message a frame: 1 type byte, a 4-byte big-endian
payload length, the payload. JSON payloads are zlib-compressed.

    client -> helper   M  manifest {v, dest, delete, files: [[path, size, mtime_ns, mode, sha256]...],
                                    links: [[path, target]...]}
    helper -> client   N  {dest, need: [file indexes], extra: [paths in dest not in the manifest] (with delete)}
                          (or Q {error} when it cannot start, e.g. dest is not writable)
    client -> helper   for each needed file: F <index u32>, D <bytes>..., Z <sha256 hex of what was sent>
                          (or A <reason> instead of Z when the client could not read it)
                       X [paths to delete] (optional, a subset of `extra`), then E (end)
    helper -> client   R {written, bytes, deleted, errors: [[path, kind, message]...]}

So a sync is one exchange for the manifest and one stream for the data, whatever the file count.

A download is the same in the other direction (the client writes, see tpurun.sync.download):

    client -> helper   L  {v, path, outside_home}
    helper -> client   I  {root, file: bool, files: [[path, size, mtime_ns, mode]...], links: [[path, target]...],
                           dirs: [path...], unreadable: [[path, message]...]}
                          (or Q {error, outside_home}: PATH is missing or unreadable, or outside_home is
                          true: it is outside the home and the request did not allow that)
    client -> helper   W  [indexes of the files it lacks or has with another size or mtime]
    helper -> client   for each: F <index u32>, D <bytes>..., Z <sha256 hex of what was sent> (or A <reason>), then E

PATH is resolved on the worker (~ and a relative path are under the login user's home, symlinks followed)
before it is checked against the home, so a link cannot lead a download outside it.

Every file is written to ``.tpurun-tmp-<name>-<random>`` in its target directory and renamed over
the real name only after its size and sha256 matched: a killed sync never leaves a half file under a
real name. Temp files are removed on any error or EOF, and stale ones at the start of the next sync.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import struct
import sys
import zlib

CACHE_NAME = ".tpurun-sync-manifest"
TMP_PREFIX = ".tpurun-tmp-"
BUSY_NAME = TMP_PREFIX + "busy"  # in dest while a sync may leave temp files: only then does the next one look for them
HEADER = struct.Struct(">cI")
PROTOCOL = 1


class Frame:
    """A frame's kind, its type byte (the protocol above, both directions; tpurun.sync's sender and download
    import these)."""

    MANIFEST = b"M"  # sync, client -> helper: every file to be there (JSON)
    NEED = b"N"  # sync, helper -> client: the files it lacks, what is there besides (JSON)
    REFUSED = b"Q"  # helper -> client: it cannot start, and why (JSON)
    FILE = b"F"  # a file follows: its index (u32)
    DATA = b"D"  # the file's next bytes
    SUM = b"Z"  # the file's end: the sha256 (hex) of what was sent
    ABORTED = b"A"  # the file's end: the sender could not read it, and why
    DELETE = b"X"  # sync, client -> helper: the paths to delete (JSON)
    END = b"E"  # no more files
    RESULT = b"R"  # sync, helper -> client: what it wrote and deleted, and each file's error (JSON)
    LIST = b"L"  # download, client -> helper: the path asked for (JSON)
    INDEX = b"I"  # download, helper -> client: what is there (JSON)
    WANT = b"W"  # download, client -> helper: the indexes of the files it wants (JSON)


class ErrorKind:
    """What went wrong with one file of a sync (the KIND of each [path, kind, message] in the result's errors)."""

    PATH = "path"  # an unsafe path, refused
    READ = "read"  # the helper could not read what it needed, or the client could not send the file
    WRITE = "write"  # it could not be written
    CHANGED = "changed"  # it changed on the sending machine during the sync
    VERIFY = "verify"  # its sha256 did not match after the transfer
    DELETE = "delete"  # it could not be deleted


class Eof(Exception):
    """The client went away (killed, connection dropped) in the middle of the protocol."""


# ------------------------------------------------------------------ framing (mirrored in tpurun.sync.stream)


def read_exact(stream, n: int) -> bytes:
    data = stream.read(n)
    if data is None or len(data) != n:
        raise Eof()
    return data


def read_frame(stream):
    kind, length = HEADER.unpack(read_exact(stream, HEADER.size))
    return kind, read_exact(stream, length) if length else b""


def write_frame(stream, kind: bytes, payload: bytes = b"") -> None:
    stream.write(HEADER.pack(kind, len(payload)))
    stream.write(payload)


def pack_json(obj) -> bytes:
    return zlib.compress(json.dumps(obj, separators=(",", ":")).encode("utf-8"), 1)


def unpack_json(payload: bytes):
    return json.loads(zlib.decompress(payload).decode("utf-8"))


# ------------------------------------------------------------------ paths


def safe_relpath(path: str) -> bool:
    """A manifest path must stay inside dest: relative, normalized (no empty, '.' or '..' part), no NUL.
    Substring tests on '/' + path + '/' (a part is empty, '.' or '..' exactly when '//', '/./' or
    '/../' occurs): three times faster than splitting, and it runs for every file of every sync."""
    if not path or "\0" in path:
        return False
    p = "/" + path + "/"
    return "//" not in p and "/./" not in p and "/../" not in p


def sha256_file(path: str) -> str:
    import hashlib  # here and below, not at the top: a no-op sync never hashes (start-up counts x workers)

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()


class Receiver:
    """Applies one manifest and one data stream to DEST."""

    def __init__(self, manifest: dict) -> None:
        dest = os.path.expanduser(manifest["dest"])
        if not os.path.isabs(dest):
            dest = os.path.join(os.path.expanduser("~"), dest)
        self.dest = os.path.normpath(dest)
        self.delete = bool(manifest.get("delete"))
        self.files = manifest.get("files", [])
        self.links = manifest.get("links", [])
        self.errors: list[list[str]] = []  # [path, kind, message]
        self.written = 0
        self.bytes = 0
        self.deleted = 0
        self.cache: dict[str, list] = {}  # path -> [size, mtime_ns, sha256]
        self.new_cache: dict[str, list] = {}
        self.ok_dirs: set[str] = set()  # directories known to be real directories inside dest
        self.extra: list[str] = []
        self.tmp_path: str | None = None  # the file being received, removed on any failure
        self.busy = False  # BUSY_NAME exists in dest (made before the first temp file)

    # -------------------------------------------------------------- setup and compare

    def start(self) -> dict:
        os.makedirs(self.dest, exist_ok=True)
        if not os.path.isdir(self.dest):
            raise OSError(f"{self.dest} is not a directory")
        self.ok_dirs.add("")
        self.load_cache()
        if os.path.lexists(os.path.join(self.dest, BUSY_NAME)):
            self.remove_stale_temps()  # the last sync here was killed: its temp file may be left
        need = []
        # the common case inline (it runs for every file of every sync, on every worker): the file is
        # there with the size, mtime and mode the manifest gives, and the cache says it has that content
        prefix = os.path.join(self.dest, "")
        cache, new_cache, lstat, is_reg = self.cache, self.new_cache, os.lstat, stat.S_ISREG
        for i, entry in enumerate(self.files):
            path, size, mtime_ns, mode, sha = entry[:5]
            if not safe_relpath(path):
                self.errors.append([path, ErrorKind.PATH, "unsafe path refused"])
                continue
            try:
                st = lstat(prefix + path)
            except FileNotFoundError:
                need.append(i)
                continue
            except OSError as exc:
                self.errors.append([path, ErrorKind.READ, exc.strerror or str(exc)])
                continue
            c = cache.get(path)
            if (
                c is not None
                and st.st_size == size
                and st.st_mtime_ns == mtime_ns
                and c[0] == size
                and c[1] == mtime_ns
                and c[2] == sha
                and st.st_mode & 0o7777 == mode
                and is_reg(st.st_mode)
            ):
                new_cache[path] = c
                continue
            try:
                if self.needs(entry):
                    need.append(i)
            except OSError as exc:
                self.errors.append([path, ErrorKind.READ, exc.strerror or str(exc)])
        for path, target in self.links:
            if not safe_relpath(path):
                self.errors.append([path, ErrorKind.PATH, "unsafe path refused"])
                continue
            try:
                self.apply_link(path, target)
            except OSError as exc:
                self.errors.append([path, ErrorKind.WRITE, exc.strerror or str(exc)])
        reply = {"dest": self.dest, "need": need}
        if self.delete:
            self.extra = self.list_extra()
            reply["extra"] = self.extra
        return reply

    def load_cache(self) -> None:
        try:
            with open(os.path.join(self.dest, CACHE_NAME), "rb") as f:
                data = json.loads(f.read().decode("utf-8"))
            if isinstance(data, dict) and data.get("v") == PROTOCOL:
                self.cache = data.get("files", {})
        except (OSError, ValueError):
            self.cache = {}

    def remove_stale_temps(self) -> None:
        # temp files live next to their targets, so the manifest's directories are where to look
        dirs = {""}
        for entry in self.files:
            dirs.add(os.path.dirname(entry[0]))
        for d in dirs:
            full = os.path.join(self.dest, d)
            try:
                with os.scandir(full) as it:
                    for e in it:
                        if e.name.startswith(TMP_PREFIX) and not e.is_dir(follow_symlinks=False):
                            try:
                                os.unlink(e.path)
                            except OSError:
                                pass
            except OSError:
                pass

    def needs(self, entry) -> bool:
        path, size, mtime_ns, mode, sha = entry[:5]
        full = os.path.join(self.dest, path)
        try:
            st = os.lstat(full)
        except OSError:
            return True
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return True
        cached = self.cache.get(path)
        if cached and cached[0] == st.st_size and cached[1] == st.st_mtime_ns:
            have = cached[2]
        else:
            have = sha256_file(full)
        if have != sha:
            return True
        # same content: fix metadata in place, no transfer
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(full, mode)
        if st.st_mtime_ns != mtime_ns:
            os.utime(full, ns=(mtime_ns, mtime_ns))
        self.new_cache[path] = [size, mtime_ns, sha]
        return False

    def ensure_parent(self, path: str) -> str:
        """Make PATH's parent a real directory inside dest (a symlink or file in the way is replaced,
        as rsync does), so nothing is ever written outside dest."""
        parent = os.path.dirname(path)
        if parent in self.ok_dirs:
            return os.path.join(self.dest, parent)
        sofar = ""
        for part in parent.split("/"):
            sofar = part if not sofar else sofar + "/" + part
            if sofar in self.ok_dirs:
                continue
            full = os.path.join(self.dest, sofar)
            try:
                st = os.lstat(full)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(full)
                    os.mkdir(full)
            except FileNotFoundError:
                os.mkdir(full)
            self.ok_dirs.add(sofar)
        return os.path.join(self.dest, parent)

    def replace_into(self, tmp: str, full: str) -> None:
        try:
            st = os.lstat(full)
            if stat.S_ISDIR(st.st_mode):
                if not self.delete:
                    raise OSError("a directory is in the way on the worker (use --delete to replace it)")
                import shutil

                shutil.rmtree(full)
        except FileNotFoundError:
            pass
        os.replace(tmp, full)

    def tmp_name(self, parent: str, name: str) -> str:
        if not self.busy:
            with open(os.path.join(self.dest, BUSY_NAME), "wb"):
                pass
            self.busy = True
        return os.path.join(parent, f"{TMP_PREFIX}{name[:100]}-{os.urandom(6).hex()}")

    def apply_link(self, path: str, target: str) -> None:
        full = os.path.join(self.dest, path)
        try:
            if os.path.islink(full) and os.readlink(full) == target:
                return
        except OSError:
            pass
        parent = self.ensure_parent(path)
        tmp = self.tmp_name(parent, os.path.basename(path))
        os.symlink(target, tmp)
        try:
            self.replace_into(tmp, full)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self.written += 1

    def list_extra(self) -> list:
        """Files and symlinks in dest that the manifest does not name (the client decides which to delete)."""
        known = set(e[0] for e in self.files) | set(p for p, _ in self.links)
        extra = []
        for dirpath, dirnames, filenames in os.walk(self.dest):
            rel_dir = os.path.relpath(dirpath, self.dest)
            rel_dir = "" if rel_dir == "." else rel_dir + "/"
            for d in list(dirnames):
                if os.path.islink(os.path.join(dirpath, d)):
                    filenames.append(d)  # a symlink to a directory is a file here: never followed
                    dirnames.remove(d)
            for name in filenames:
                rel = rel_dir + name
                if rel == CACHE_NAME or name.startswith(TMP_PREFIX):
                    continue
                if rel not in known:
                    extra.append(rel)
        extra.sort()
        return extra

    # -------------------------------------------------------------- data stream

    def receive(self, stream) -> None:
        while True:
            kind, payload = read_frame(stream)
            if kind == Frame.FILE:
                (index,) = struct.unpack(">I", payload)
                self.receive_file(stream, self.files[index])
            elif kind == Frame.DELETE:
                self.delete_paths(unpack_json(payload))
            elif kind == Frame.END:
                return
            else:
                raise ValueError(f"unexpected frame {kind!r}")

    def receive_file(self, stream, entry) -> None:
        path, size, mtime_ns, mode, sha = entry[:5]
        full = os.path.join(self.dest, path)
        import hashlib

        h = hashlib.sha256()
        got = 0
        fd = -1
        tmp = ""
        failed = None
        try:
            parent = self.ensure_parent(path)
            tmp = self.tmp_path = self.tmp_name(parent, os.path.basename(path))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            failed = [ErrorKind.WRITE, exc.strerror or str(exc)]
        while True:
            kind, payload = read_frame(stream)
            if kind == Frame.DATA:
                h.update(payload)
                got += len(payload)
                if failed is None:
                    try:
                        view = memoryview(payload)
                        while view:
                            view = view[os.write(fd, view) :]
                    except OSError as exc:
                        failed = [ErrorKind.WRITE, exc.strerror or str(exc)]
                continue
            if kind == Frame.ABORTED:
                failed = failed or [ErrorKind.READ, "not sent: " + payload.decode("utf-8", "replace")]
                break
            if kind == Frame.SUM:
                sent_sha = payload.decode("ascii", "replace")
                if failed is None and (got != size or sent_sha != sha):
                    failed = [ErrorKind.CHANGED, "changed on the sending machine during the sync; sync again"]
                elif failed is None and h.hexdigest() != sent_sha:
                    failed = [ErrorKind.VERIFY, "sha256 mismatch after transfer"]
                break
            raise ValueError(f"unexpected frame {kind!r} inside a file")
        if failed is None:
            try:
                os.fchmod(fd, mode)
                os.utime(fd, ns=(mtime_ns, mtime_ns))
                os.close(fd)  # (unwritten data cannot fail here: writes are unbuffered)
                fd = -1
                self.replace_into(tmp, full)
                self.tmp_path = None
                self.written += 1
                self.bytes += got
                self.new_cache[path] = [size, mtime_ns, sha]
            except OSError as exc:
                failed = [ErrorKind.WRITE, exc.strerror or str(exc)]
        if fd >= 0:
            os.close(fd)
        if failed is not None:
            self.drop_tmp()
            self.errors.append([path, failed[0], failed[1]])

    def drop_tmp(self) -> None:
        if self.tmp_path:
            try:
                os.unlink(self.tmp_path)
            except OSError:
                pass
            self.tmp_path = None

    def delete_paths(self, paths) -> None:
        allowed = set(self.extra)  # only what we listed: inside dest, never the cache file
        keep_dirs = set()
        for entry in self.files:
            d = os.path.dirname(entry[0])
            while d and d not in keep_dirs:
                keep_dirs.add(d)
                d = os.path.dirname(d)
        for path in paths:
            if path not in allowed:
                continue
            try:
                os.unlink(os.path.join(self.dest, path))
                self.deleted += 1
            except OSError as exc:
                self.errors.append([path, ErrorKind.DELETE, exc.strerror or str(exc)])
                continue
            d = os.path.dirname(path)
            while d and d not in keep_dirs:
                try:
                    os.rmdir(os.path.join(self.dest, d))
                except OSError:
                    break
                d = os.path.dirname(d)

    def save_cache(self) -> None:
        if self.new_cache == self.cache:
            return  # nothing changed (a no-op sync writes nothing at all)
        data = json.dumps({"v": PROTOCOL, "files": self.new_cache}, separators=(",", ":")).encode("utf-8")
        tmp = self.tmp_name(self.dest, CACHE_NAME)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, os.path.join(self.dest, CACHE_NAME))
        except OSError:
            # only a cache: the next sync rehashes instead
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def done(self) -> None:
        """Every temp file is gone (renamed or removed): the next sync need not look for any."""
        if self.busy:
            try:
                os.unlink(os.path.join(self.dest, BUSY_NAME))
            except OSError:
                pass
            self.busy = False

    def result(self) -> dict:
        return {"written": self.written, "bytes": self.bytes, "deleted": self.deleted, "errors": self.errors}


# ------------------------------------------------------------------ download: this end sends


class Sender:
    """Lists PATH (a file or a tree) and sends the files the client asks for."""

    def __init__(self, request: dict) -> None:
        home = os.path.realpath(os.path.expanduser("~"))
        path = os.path.expanduser(request["path"])
        self.root = os.path.realpath(os.path.join(home, path))  # an absolute PATH stays as it is
        self.outside_home = bool(request.get("outside_home"))
        self.home = home
        self.files: list = []
        self.links: list = []
        self.single = False  # PATH is one file

    def outside(self) -> bool:
        """Whether PATH is refused for being outside the home (and no one asked for that)."""
        return not self.outside_home and self.root != self.home and not self.root.startswith(self.home + "/")

    def listing(self) -> dict:
        """The I reply; raises OSError (with the path) for a PATH that cannot be sent."""
        if self.outside():
            raise PermissionError(f"{self.root} is outside the home directory {self.home}")
        st = os.stat(self.root)  # FileNotFoundError, PermissionError: the client shows the message
        if stat.S_ISREG(st.st_mode):
            self.single = True
            self.files.append([os.path.basename(self.root), st.st_size, st.st_mtime_ns, st.st_mode & 0o7777])
            return {"root": self.root, "file": True, "files": self.files, "links": []}
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(f"{self.root} is neither a file nor a directory")
        dirs: list = []
        unreadable: list = []

        def note(exc: OSError) -> None:
            unreadable.append([os.path.relpath(exc.filename or self.root, self.root), exc.strerror or str(exc)])

        for dirpath, dirnames, filenames in os.walk(self.root, onerror=note):
            rel_dir = os.path.relpath(dirpath, self.root)
            rel_dir = "" if rel_dir == "." else rel_dir + "/"
            if rel_dir:
                dirs.append(rel_dir[:-1])  # empty ones too
            dirnames.sort()
            for name in sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                full = os.path.join(dirpath, name)
                try:
                    lst = os.lstat(full)
                    if stat.S_ISLNK(lst.st_mode):
                        self.links.append([rel_dir + name, os.readlink(full)])
                    elif stat.S_ISREG(lst.st_mode) and not name.startswith(TMP_PREFIX):
                        self.files.append([rel_dir + name, lst.st_size, lst.st_mtime_ns, lst.st_mode & 0o7777])
                except OSError:
                    continue  # gone since it was listed: not part of this download
            dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        return {
            "root": self.root,
            "file": False,
            "files": self.files,
            "links": self.links,
            "dirs": dirs,
            "unreadable": unreadable,
        }

    def send(self, stdout, wanted) -> None:
        import hashlib

        for index in wanted:
            path = self.files[index][0]
            full = self.root if self.single else os.path.join(self.root, path)
            write_frame(stdout, Frame.FILE, struct.pack(">I", index))
            h = hashlib.sha256()
            try:
                # never through a link put there since the listing: a regular file, as listed, or nothing
                fd = os.open(full, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    os.close(fd)
                    raise OSError(f"{path} is no longer a regular file")
                with os.fdopen(fd, "rb") as f:
                    while True:
                        chunk = f.read(1 << 20)
                        if not chunk:
                            break
                        h.update(chunk)
                        write_frame(stdout, Frame.DATA, chunk)
            except OSError as exc:
                write_frame(stdout, Frame.ABORTED, (exc.strerror or str(exc)).encode("utf-8", "replace"))
                continue
            write_frame(stdout, Frame.SUM, h.hexdigest().encode("ascii"))
        write_frame(stdout, Frame.END)
        stdout.flush()


def serve_download(request: dict, stdin, stdout) -> int:
    sender = Sender(request)
    try:
        reply = sender.listing()
    except OSError as exc:
        where = exc.filename or sender.root
        text = f"{where}: {exc.strerror}" if exc.strerror else str(exc)
        write_frame(stdout, Frame.REFUSED, pack_json({"error": text, "outside_home": sender.outside()}))
        stdout.flush()
        return 1
    write_frame(stdout, Frame.INDEX, pack_json(reply))
    stdout.flush()
    kind, payload = read_frame(stdin)
    if kind != Frame.WANT:
        raise ValueError("expected the wanted files")
    sender.send(stdout, unpack_json(payload))
    return 0


def _stop(signum, frame):
    raise Eof()


def main() -> int:
    # a hang-up or termination mid-stream must still remove the temp file (the finally below)
    for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    stdin = sys.stdin.buffer
    stdout = sys.stdout.buffer
    receiver = None
    try:
        kind, payload = read_frame(stdin)
        if kind not in (Frame.MANIFEST, Frame.LIST):
            raise ValueError("expected a manifest or a download request")
        manifest = unpack_json(payload)
        if manifest.get("v") != PROTOCOL:
            write_frame(stdout, Frame.REFUSED, pack_json({"error": "protocol version mismatch"}))
            stdout.flush()
            return 2
        if kind == Frame.LIST:
            return serve_download(manifest, stdin, stdout)
        receiver = Receiver(manifest)
        try:
            reply = receiver.start()
        except OSError as exc:
            write_frame(stdout, Frame.REFUSED, pack_json({"error": f"{receiver.dest}: {exc.strerror or exc}"}))
            stdout.flush()
            return 1
        write_frame(stdout, Frame.NEED, pack_json(reply))
        stdout.flush()
        receiver.receive(stdin)
        receiver.save_cache()
        receiver.done()
        write_frame(stdout, Frame.RESULT, pack_json(receiver.result()))
        stdout.flush()
        return 0
    except (Eof, BrokenPipeError):
        return 3  # the client is gone; the finally below removes the half-written temp file
    except Exception as exc:  # a bug or a protocol error: one line for the client to show
        sys.stderr.write(f"tpurun sync helper: {type(exc).__name__}: {exc}\n")
        return 1
    finally:
        if receiver is not None:
            receiver.drop_tmp()


if __name__ == "__main__":
    sys.exit(main())
