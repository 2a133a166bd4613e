"""tpurun's own SSH key: made once, whole and private, even when several commands start at once on a new home."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

from tpurun.cloud import keys

MAKE = (
    "import sys; from pathlib import Path; from tpurun.cloud import keys; print(keys.ensure_key(Path(sys.argv[1]))[1])"
)


def test_commands_started_at_once_share_one_key(tmp_path: Path) -> None:
    home = tmp_path / "home"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MAKE, str(home)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(8)
    ]
    answers = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, [err for _, err in answers]
    publics = {out.strip() for out, _ in answers}
    assert len(publics) == 1
    key = home / "ssh" / "id_ed25519"
    assert (key.with_suffix(".pub").read_text().strip(),) == tuple(publics)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert key.read_text().startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    assert sorted(p.name for p in key.parent.iterdir() if p.name.startswith(".id_ed25519")) == []


PIN = (
    "import sys; from pathlib import Path; from tpurun.cloud import keys\n"
    "for round in range(40):\n"
    "    keys.pin_host_keys(Path(sys.argv[1]), {f'tpu.{sys.argv[2]}-{round}': 'ssh-ed25519 AAAA' + sys.argv[2]})\n"
)


def test_pins_made_at_once_are_all_kept(tmp_path: Path) -> None:
    home = tmp_path / "home"
    procs = [
        subprocess.Popen([sys.executable, "-c", PIN, str(home), f"n{i}"], stderr=subprocess.PIPE) for i in range(6)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0] * 6, [p.stderr.read() for p in procs if p.stderr]
    pinned = keys.pinned_keys(home)
    assert pinned == {f"tpu.n{i}-{r}": f"ssh-ed25519 AAAAn{i}" for i in range(6) for r in range(40)}


def test_a_connection_gets_its_workers_pinned_key_only_and_survives_a_bad_line(tmp_path: Path) -> None:
    import paramiko

    from tpurun.transport import ssh
    from tpurun.transport.runner import Worker

    good = paramiko.Ed25519Key.from_private_key_file(str(keys.ensure_key(tmp_path)[0]))
    line = f"{good.get_name()} {good.get_base64()}"
    known = keys.known_hosts_path(tmp_path)
    known.write_text(
        f"tpu.n-0 {line}\n"
        "tpu.n-1 ssh-ed25519 AAAA\n"  # a worker published junk: refused, not a crash
        f"  tpu.n-2,tpu.n-3 {line}\n"
        f"@cert-authority tpu.n-4 {line}\n"
    )
    for index, pinned in ((0, True), (1, False), (2, True), (3, True), (4, False), (5, False)):
        client = paramiko.SSHClient()
        ssh._pin_host_keys(client, known, Worker(index, f"127.0.0.{index + 1}", host_key=f"tpu.n-{index}"))
        found = client.get_host_keys().lookup(f"127.0.0.{index + 1}")
        assert (found is not None and found["ssh-ed25519"] == good) == pinned, index
        assert len(client.get_host_keys().keys()) == int(pinned)  # never another worker's key
