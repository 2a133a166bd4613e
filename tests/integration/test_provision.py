"""Provisioning through the real CLI against the emulator: create, attach, list, describe, delete, stop/start."""

from __future__ import annotations

import hashlib
import http.server
import json
import subprocess
import threading
from pathlib import Path

import pytest

from tests.helpers import assert_clean_error, calls_since, create_node

pytestmark = pytest.mark.integration


def _addresses(describe_json: dict) -> list[str]:
    return [w["internalIp"] for w in describe_json["workerEndpoints"]]


def test_create_pod_runs_startup_everywhere_and_pins_keys(cli, emulator, tmp_path):
    script = cli.cwd / "setup.sh"
    script.write_text('#!/bin/bash\necho "setup on $(hostname)" > /root/setup-done\n')
    r = cli("create", "demo", "--accelerator-type", "v4-16", "--startup-script", str(script), "--json")
    assert r.code == 0, r.err
    d = json.loads(r.out)
    assert d["state"] == "READY" and len(d["workerEndpoints"]) == 2
    assert [w["startup"] for w in d["workerEndpoints"]] == ["done", "done"]
    # the key is 0600 and the system ssh client logs in with strict host key checking
    assert (cli.key.stat().st_mode & 0o777) == 0o600
    hostnames = set()
    for address in _addresses(d):
        out = subprocess.run(cli.ssh(address, "cat /root/setup-done"), capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        hostnames.add(out.stdout.strip())
    assert len(hostnames) == 2
    # create made it the default TPU of this project directory
    assert 'tpu = "demo"' in (cli.cwd / "tpurun.toml").read_text()
    lst = json.loads(cli("list", "--json").out)
    assert [(n["name"], n["acceleratorType"], n["workers"]) for n in lst] == [("demo", "v4-16", 2)]


def test_failing_startup_on_one_worker_shows_its_tail(cli):
    script = cli.cwd / "setup.sh"
    script.write_text(
        "#!/bin/bash\n"
        "n=$(curl -sf -H 'Metadata-Flavor: Google' http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number)\n"
        'if [ "$n" = 1 ]; then echo "disk quota boom on worker $n"; exit 7; fi\n'
        "echo fine\n"
    )
    r = cli("create", "broken", "-t", "v4-16", "--startup-script", str(script))
    assert r.code == 1, (r.out, r.err)
    assert "worker 1" in r.err and "exit code 7" in r.err
    assert "\n    disk quota boom on worker 1\n" in r.err  # the tail on lines of its own
    assert "broken is still running, and billing: `tpurun delete broken --yes`" in r.err.splitlines()[-1]
    assert "Traceback" not in r.err
    assert any(n.name.endswith("/broken") for n in cli.emulator.client().list_nodes(parent=cli.emulator.parent))
    r = cli("create", "broken2", "-t", "v4-16", "--startup-script", str(script), "--delete-on-failure")
    assert r.code == 1 and "disk quota boom on worker 1" in r.err and "broken2 was deleted" in r.err, r.err
    assert not any(n.name.endswith("/broken2") for n in cli.emulator.client().list_nodes(parent=cli.emulator.parent))
    cli.emulator.fail_api(100, 403, match="DELETE /v2/")  # --delete-on-failure cannot delete: both are said
    r = cli("create", "broken3", "-t", "v4-16", "--startup-script", str(script), "--delete-on-failure")
    assert r.code == 1 and "disk quota boom on worker 1" in r.err and "Traceback" not in r.err, r.err
    assert "--delete-on-failure could not delete broken3" in r.err.splitlines()[-1], r.err
    assert "`tpurun delete broken3 --yes` deletes what is left of it" in r.err.splitlines()[-1], r.err
    assert any(n.name.endswith("/broken3") for n in cli.emulator.client().list_nodes(parent=cli.emulator.parent))


def test_spot_node_preempted_shows_in_list(cli, emulator):
    assert cli("create", "cheap", "-t", "v4-8", "--spot").code == 0
    emulator.preempt(emulator.node_name("cheap"))
    rows = json.loads(cli("list", "--json").out)
    assert rows[0]["state"] == "PREEMPTED" and rows[0]["spot"] is True
    plain = cli("--plain", "list").out
    assert "PREEMPTED" in plain and "spot" in plain


def test_attach_keeps_other_users_keys(cli, emulator, tpu_node):
    node = tpu_node("v4-16", user="alice")  # alice's key is already in ssh-keys
    r = cli("attach", node.node_id, "--json")
    assert r.code == 0, r.err
    client = emulator.client()
    ssh_keys = client.get_node(name=node.name).metadata["ssh-keys"]
    assert "alice:" in ssh_keys and "root:ssh-ed25519" in ssh_keys
    assert f'tpu = "{node.node_id}"' in (cli.cwd / "tpurun.toml").read_text()
    for w in node.workers:
        # tpurun's key and pinned known_hosts
        ok = subprocess.run(cli.ssh(w.address, "true"), capture_output=True, text=True, timeout=30)
        assert ok.returncode == 0, ok.stderr
        # alice still gets in with her own key
        alice = subprocess.run(node.ssh(w.index, "true"), capture_output=True, text=True, timeout=30)
        assert alice.returncode == 0, alice.stderr
    # attaching twice adds nothing
    before = client.get_node(name=node.name).metadata["ssh-keys"]
    assert cli("attach", node.node_id).code == 0
    assert client.get_node(name=node.name).metadata["ssh-keys"] == before


@pytest.mark.parametrize(
    "code,needle",
    [
        (403, "roles/tpu.admin"),
        (400, "refused the request"),
        (409, "already exists"),
    ],
)
def test_api_errors_are_explained(cli, emulator, code, needle):
    emulator.fail_api(1, code, match="POST /v2/")  # the create call itself
    r = cli("create", "errs", "-t", "v4-8")
    assert_clean_error(r, 3)
    assert needle in r.err


def test_not_found_suggests_similar_names(cli, tpu_node):
    node = tpu_node("v4-8", node_id="trainer-one")
    r = cli("describe", "trainer-on")
    assert_clean_error(r, 3)
    assert "no TPU named 'trainer-on'" in r.err and node.node_id in r.err


def test_resource_exhausted_suggests_spot_queued_zone(cli, emulator):
    emulator.set_capacity("v4=4")  # chips: one v4-8 at most
    r = cli("create", "big", "-t", "v4-32")
    assert_clean_error(r, 3)
    assert "--spot" in r.err and "--queued" in r.err and "zone" in r.err
    assert emulator.client().list_nodes(parent=emulator.parent).nodes == []


def test_transient_503s_are_retried(cli, emulator):
    emulator.fail_api(3, 503, "/v2/")  # the Cloud TPU API's calls (google-cloud-compute retries its own quietly)
    r = cli("create", "flaky", "-t", "v4-8")
    assert r.code == 0, r.err
    assert "503" in r.err and "retrying" in r.err


def test_retry_budget_exhausted_is_api_error(cli, emulator):
    emulator.fail_api(50, 429)
    r = cli("list")
    assert_clean_error(r, 3)
    assert "429" in r.err


class _Files(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep test output clean
        pass


@pytest.fixture
def http_files(tmp_path):
    root = tmp_path / "served"
    root.mkdir()
    handler = lambda *a, **k: _Files(*a, directory=str(root), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_code_and_data_reach_every_worker(cli, http_files):
    root, base = http_files
    payload = b"weights " * 1000
    (root / "weights.bin").write_bytes(payload)
    digest = hashlib.sha256(payload).hexdigest()
    code = cli.cwd / "mycode"
    (code / "pkg").mkdir(parents=True)
    (code / "train.py").write_text("print('hi')\n")
    (code / "pkg" / "mod.py").write_text("X = 1\n")
    (code / "secret.log").write_text("ignored\n")
    (code / ".gitignore").write_text("*.log\n")
    r = cli(
        "create", "withcode", "-t", "v4-16", "--json",
        "--code", f"{code}:/root/code",
        "--data", f"{base}/weights.bin#sha256={digest}=/root/data/weights.bin",
    )  # fmt: skip
    assert r.code == 0, r.err
    for address in _addresses(json.loads(r.out)):
        out = subprocess.run(
            cli.ssh(address, "cat /root/code/train.py /root/code/pkg/mod.py; ls /root/code; sha256sum /root/data/weights.bin"),
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "print('hi')" in out.stdout and "X = 1" in out.stdout
        assert "secret.log" not in out.stdout
        assert digest in out.stdout


def test_failing_download_names_worker_and_url(cli, http_files):
    _, base = http_files
    r = cli("create", "nodata", "-t", "v4-8", "--data", f"{base}/missing.bin=/root/x.bin")
    assert r.code == 1
    assert "worker 0" in r.err and f"{base}/missing.bin" in r.err


def test_code_too_big_refused_with_sync_hint(cli, emulator):
    import os

    big = cli.cwd / "big"
    big.mkdir()
    (big / "blob").write_bytes(os.urandom(400 * 1024))
    before = emulator.request_count()
    r = cli("create", "toobig", "-t", "v4-8", "--code", str(big))
    assert_clean_error(r, 2)
    assert "tpurun sync" in r.err
    # no API call at all (the log's EVENT lines are the emulator's own background work, e.g. an earlier
    # test's operation finishing, and do not count)
    assert calls_since(emulator, before) == []


@pytest.mark.parametrize(
    "args,needle",
    [
        (["create", "Bad_Name", "-t", "v4-8"], "invalid TPU name"),
        (["create", "ok", "-t", "v3-33"], "8, 32, 64"),
        (["create", "ok", "-t", "v9-8"], "unknown TPU generation"),
        (["create", "ok", "-t", "v4-8", "--startup-script", "/nonexistent.sh"], "no such file"),
        (["create", "ok", "-t", "v4-8", "--label", "Bad=x"], "invalid --label"),
        (["create", "ok", "-t", "v4-8", "--spot", "--preemptible"], "one of --spot"),
        (["create", "ok", "-t", "v4-8", "--data", "ftp://x=/y"], "bad --data"),
        (["create", "-bad", "-t", "v4-8"], ""),
        (["create", "ok", "-t", "v4-8", "--valid-until", "3h"], "--queued"),
        (["create", "z", "-t", "v4-16", "--slices", "0"], "'--slices': 0 is not in the range x>=1"),
        (["create", "z", "-t", "v3-32", "--slices", "2"], "v4 and newer"),
        (["create", "z", "-t", "v2-8", "--slices", "3"], "v4 and newer"),
    ],
)
def test_bad_input_creates_nothing(cli, emulator, args, needle):
    before = emulator.request_count()
    r = cli(*args)
    assert_clean_error(r, 2)
    assert needle in r.err
    assert calls_since(emulator, before) == [], "bad input must not reach the API"


def test_stop_start_single_host_and_refuse_pod(cli, emulator):
    assert cli("create", "single", "-t", "v4-8").code == 0
    r = cli("stop", "single")
    assert r.code == 0, r.err
    assert json.loads(cli("describe", "single", "--json").out)["state"] == "STOPPED"
    r = cli("start", "single", "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["workerEndpoints"][0]["startup"] == "done"
    assert cli("create", "pod", "-t", "v4-16").code == 0
    r = cli("stop", "pod")
    assert_clean_error(r, 2)
    assert "pod slice" in r.err and "delete" in r.err


def test_delete_needs_yes_and_removes_queued_resource(cli, emulator):
    r = cli("create", "inline", "-t", "v4-8", "--queued")
    assert r.code == 0, r.err
    client = emulator.client()
    assert client.get_node(name=emulator.node_name("inline")).queued_resource
    r = cli("delete", "inline")  # stdin is not a terminal: refuses without --yes
    assert_clean_error(r, 2)
    assert cli("delete", "inline", "--yes").code == 0
    assert client.list_nodes(parent=emulator.parent).nodes == []
    assert list(client.list_queued_resources(parent=emulator.parent)) == []


def test_describe_shortens_ssh_keys(cli):
    assert cli("create", "desc", "-t", "v4-8", "--label", "team=research").code == 0
    d = json.loads(cli("describe", "desc", "--json").out)
    assert d["labels"] == {"team": "research"}
    keyline = d["metadata"]["ssh-keys"]
    pub = (Path(cli.env["TPURUN_HOME"]) / "ssh" / "id_ed25519.pub").read_text().split()[1]
    assert pub not in keyline and keyline.startswith("root:ssh-ed25519")
    # the table: the fields its renderer picks from the TPU's view, the same shortened keys, none of the JSON's
    out = cli("describe", "desc").out
    rows = {line.split("  ")[0]: line.split("  ", 1)[1].strip() for line in out.splitlines() if "  " in line}
    assert rows["accelerator"] == "v4-8" and rows["state"] == "READY" and rows["workers"] == "1"
    assert rows["spot/preemptible"] == "-" and rows["labels"] == "team=research"
    assert rows["metadata ssh-keys"].startswith("root:ssh-ed25519") and pub not in out
    assert not {"acceleratorType", "workerEndpoints", "idleSeconds", "reportedSecondsAgo", "metadata"} & set(rows)


def test_delete_clears_the_default_that_names_the_node(cli):
    create_node(cli, "dflt", "v4-8")
    toml = cli.cwd / "tpurun.toml"
    assert 'tpu = "dflt"' in toml.read_text()
    r = cli("delete", "dflt", "--yes")
    assert r.code == 0, r.err
    # tpurun wrote that file for the default alone: it goes with it
    assert not toml.exists() and "no longer the default TPU" in r.err, r.err


def test_list_and_create_judge_a_zone_the_same_way(cli):
    for args in (["list", "--zone", "uscentral"], ["create", "zz", "-t", "v4-8", "--zone", "uscentral"]):
        r = cli(*args)
        assert_clean_error(r, 2)
        assert "'uscentral' is not a zone" in r.err, (args, r.err)
