"""tpurun download's receiving side against a worker that lies: names leading out of the destination
(`..` as the tree's name, link chains, a symlink already in the destination, extra files in a file
download), an unexpected frame in the middle of a file. Nothing outside the destination is created,
changed or removed, no temp file or descriptor is left, and good files still arrive."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import pytest

from tpurun.sync import download
from tpurun.sync.stream import Counters, frame
from tpurun.worker import sync_helper


class LyingWorker:
    """A helper's side of the protocol, scripted: its listing, then every file it lists, sent whatever
    the client asks for (FILES: {name: content})."""

    def __init__(self, listing: dict, files: dict[str, bytes], tail: bytes = b"") -> None:
        out = frame(b"I", sync_helper.pack_json(listing))
        for i, (name, *_) in enumerate(listing["files"]):
            data = files[name]
            out += frame(b"F", struct.pack(">I", i)) + frame(b"D", data)
            out += frame(b"Z", hashlib.sha256(data).hexdigest().encode())
        self.out = out + (tail or frame(b"E"))

    def send(self, data: bytes) -> None:
        pass

    def recv(self, n: int) -> bytes:
        data, self.out = self.out[:n], self.out[n:]
        return data

    def ended(self) -> tuple[int | None, bytes]:
        return 0, b""

    def close(self) -> None:
        pass

    def close_write(self) -> None:
        pass


def _listing(root: str, files: dict[str, bytes], links=(), dirs=(), file=False) -> dict:
    return {
        "root": root,
        "file": file,
        "files": [[name, len(data), 1_000_000_000, 0o644] for name, data in files.items()],
        "links": [list(x) for x in links],
        "dirs": list(dirs),
    }


def _run(tmp_path: Path, worker: LyingWorker) -> download.Fetched:
    got = download.Fetched(0, "w0", "10.0.0.2")
    download.download_stream(worker, got, "run", tmp_path / "dest", outside_home=False, progress=Counters())
    return got


def _outside(tmp_path: Path) -> set[str]:
    return {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if "dest" not in p.relative_to(tmp_path).parts}


@pytest.fixture
def sentinel(tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "victim").write_text("keep")
    return tmp_path / "outside" / "victim"


def test_a_tree_named_dotdot_is_refused(tmp_path, sentinel):
    before = _outside(tmp_path)
    files = {"evil.txt": b"x"}
    with pytest.raises(download.Protocol):
        _run(tmp_path, LyingWorker(_listing("/x/..", files), files))
    assert _outside(tmp_path) == before and sentinel.read_text() == "keep"


def test_a_link_chain_out_of_the_tree_is_not_recreated(tmp_path, sentinel):
    before = _outside(tmp_path)
    files = {"ok.txt": b"fine"}
    links = [("a/b/c/l", "../../.."), ("esc", "a/b/c/l/../../outside"), ("up", "../../outside/victim")]
    got = _run(tmp_path, LyingWorker(_listing("/root/run", files, links, dirs=["a", "a/b", "a/b/c"]), files))
    tree = tmp_path / "dest" / "run"
    assert (tree / "ok.txt").read_bytes() == b"fine"
    assert sorted(rel for rel, _ in got.skipped) == ["esc", "up"]  # through another link; above the tree
    assert got.links == 1 and (tree / "a/b/c/l").resolve() == tree.resolve()  # the tree's own top: inside
    assert _outside(tmp_path) == before and sentinel.read_text() == "keep"


def test_a_symlink_already_in_the_destination_is_replaced_never_followed(tmp_path, sentinel):
    tree = tmp_path / "dest" / "run"
    tree.mkdir(parents=True)
    (tree / "link").symlink_to(tmp_path / "outside")
    (tree / "victim").symlink_to(sentinel)
    before = _outside(tmp_path)
    files = {"link/deeper/f": b"in", "victim": b"overwritten?"}
    got = _run(tmp_path, LyingWorker(_listing("/root/run", files), files))
    assert got.errors == [] and got.files_fetched == 2
    assert (tree / "link" / "deeper" / "f").read_bytes() == b"in" and not (tree / "link").is_symlink()
    assert (tree / "victim").read_bytes() == b"overwritten?" and not (tree / "victim").is_symlink()
    assert _outside(tmp_path) == before and sentinel.read_text() == "keep"


def test_a_file_download_that_lists_more_is_refused(tmp_path):
    files = {"model.pt": b"m", ".bashrc": b"evil"}
    with pytest.raises(download.Protocol):
        _run(tmp_path, LyingWorker(_listing("/root/model.pt", files, file=True), files))
    assert not (tmp_path / "dest" / ".bashrc").exists()


def test_an_unexpected_frame_inside_a_file_leaves_no_temp_and_no_descriptor(tmp_path):
    files = {"a.bin": b"a" * 10}
    listing = _listing("/root/run", files)
    worker = LyingWorker(listing, {"a.bin": b""})  # then the frames below instead of the file's
    worker.out = frame(b"I", sync_helper.pack_json(listing)) + frame(b"F", struct.pack(">I", 0)) + frame(b"D", b"aaaa")
    worker.out += frame(b"Q", b"nonsense")
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(download.Protocol):
        _run(tmp_path, worker)
    assert len(os.listdir("/proc/self/fd")) == fds
    assert [p.name for p in (tmp_path / "dest" / "run").iterdir()] == []
