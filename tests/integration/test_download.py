"""tpurun download on an emulated v4-16 (2 workers): a tree from every worker into one directory each,
only what changed on the next download, one worker straight into the destination, and paths outside the
worker's home (named, or reached through a symlink) refused unless asked."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.helpers import assert_clean_error, create_node

pytestmark = pytest.mark.integration

_MAKE = (
    "mkdir -p run/ckpt run/empty && hostname > run/host.txt && head -c 300000 /dev/urandom > run/ckpt/model.bin && "
    "ln -s ../host.txt run/ckpt/latest && ln -s /etc/hostname run/outside && ln -s /etc escape"
)


def _download(cli, *args: str, code: int = 0) -> dict:
    r = cli("download", "--json", *args)
    assert r.code == code, (r.out, r.err)
    return {w["name"]: w for w in json.loads(r.out)["workers"]}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _remote_sha(cli, worker: int, path: str) -> str:
    r = cli("exec", "--worker", str(worker), "--", "sha256sum", path)
    assert r.code == 0, r.err
    return r.out.split("] ", 1)[1].split()[0]


def test_download_from_every_worker_moves_only_what_changed(cli):
    create_node(cli, "dl", "v4-16")
    assert cli("exec", "--", "sh", "-c", _MAKE).code == 0
    out = cli.cwd / "out"

    first = _download(cli, "run", str(out))
    assert {n: (w["files_total"], w["files_fetched"], w["links"]) for n, w in first.items()} == {
        "w0": (2, 2, 1),
        "w1": (2, 2, 1),
    }
    for w in (0, 1):
        tree = out / f"w{w}" / "run"
        assert _sha(tree / "ckpt" / "model.bin") == _remote_sha(cli, w, "run/ckpt/model.bin")
        assert (tree / "ckpt" / "latest").read_text() == (tree / "host.txt").read_text()
        assert not (tree / "outside").exists() and not (tree / "outside").is_symlink()  # leads out: skipped
        assert (tree / "empty").is_dir()
        assert first[f"w{w}"]["skipped"] == [["outside", "a symlink to /etc/hostname, outside the tree: not recreated"]]
    assert (out / "w0" / "run" / "host.txt").read_text() != (out / "w1" / "run" / "host.txt").read_text()

    again = _download(cli, "run", str(out))
    assert [(w["files_fetched"], w["bytes_fetched"]) for w in again.values()] == [(0, 0), (0, 0)]

    assert cli("exec", "--worker", "1", "--", "sh", "-c", "echo more >> run/host.txt").code == 0
    third = _download(cli, "run", str(out))
    assert {n: w["files_fetched"] for n, w in third.items()} == {"w0": 0, "w1": 1}
    assert (out / "w1" / "run" / "host.txt").read_text().endswith("more\n")

    one = _download(cli, "--worker", "1", "run/ckpt/model.bin", str(cli.cwd / "single"))
    assert one["w1"]["files_fetched"] == 1
    assert _sha(cli.cwd / "single" / "model.bin") == _remote_sha(cli, 1, "run/ckpt/model.bin")

    for outside in ("/etc/hostname", "escape/hostname", "../../etc"):
        r = cli("download", outside, str(cli.cwd / "refused"))
        assert_clean_error(r, 2)
        assert "outside the home directory /root" in r.err and "--outside-home" in r.err, r.err
    assert not (cli.cwd / "refused").exists() or not any((cli.cwd / "refused").rglob("*"))
    asked = _download(cli, "--worker", "0", "--outside-home", "/etc/hostname", str(cli.cwd / "etc"))
    assert asked["w0"]["files_fetched"] == 1 and (cli.cwd / "etc" / "hostname").is_file()

    missing = cli("download", "no/such/dir", str(out))
    assert_clean_error(missing, 1)
    assert "/root/no/such/dir: No such file or directory" in missing.err, missing.err
