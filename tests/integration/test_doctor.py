"""tpurun doctor on an emulated v4-32 with one planted fault per worker: a version mismatch (a torch_xla
dist shadowing the real one on PYTHONPATH), a busy device (a real holder process), an XRT_TPU_CONFIG
exported in ~/.bashrc while torch_xla 2.9 is installed, and torch_xla missing (the system python3)."""

from __future__ import annotations

import json
import re
import shlex
import sys

import pytest

pytestmark = pytest.mark.integration

# Every worker gets /root/bin/py: this test's python (torch + torch_xla 2.9.0; workers see this machine's
# Python installation, docs/emulator.md) with /root/site first on
# its path, where a tiny real libtpu/libtpu.so lives. Then one fault per worker, chosen by hostname.
_PLANT = r"""
set -e
mkdir -p /root/bin /root/site/libtpu
printf 'int tpurun_test_symbol = 1;\n' > /root/site/x.c
gcc -shared -fPIC -o /root/site/libtpu/libtpu.so /root/site/x.c
cat > /root/bin/py <<'EOF'
#!/bin/sh
PYTHONPATH=/root/site${PYTHONPATH:+:$PYTHONPATH} exec @PYTHON@ "$@"
EOF
chmod +x /root/bin/py
case "$(hostname)" in
*-w-1)
  rm -f /tmp/ready
  setsid nohup python3 -c "import time; f = open('/dev/accel2', 'rb'); open('/tmp/ready', 'w').close(); time.sleep(999)" tag-busy >/dev/null 2>&1 </dev/null &
  for i in $(seq 100); do [ -e /tmp/ready ] && break; sleep 0.05; done ;;
*-w-2)
  # an older torch_xla installed where this python looks first: what `pip install --user` leaves behind
  mkdir -p /root/site/torch_xla-2.8.0.dist-info
  printf 'Metadata-Version: 2.1\nName: torch_xla\nVersion: 2.8.0\n' > /root/site/torch_xla-2.8.0.dist-info/METADATA ;;
*-w-3)
  printf '\n# from an old tutorial\nexport XRT_TPU_CONFIG="localservice;0;localhost:51011"\n' >> /root/.bashrc ;;
esac
"""


def _rows(doc: dict, worker: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for c in doc["checks"]:
        if c["worker"] == worker:
            out.setdefault(c["name"], []).append(c)
    return out


def _fails(doc: dict, worker: int) -> dict[str, dict]:
    return {c["name"]: c for c in doc["checks"] if c["worker"] == worker and c["status"] == "fail"}


def test_doctor_turns_each_fault_into_a_failing_row_with_its_fix(cli, emulator):
    assert cli("create", "doc4", "-t", "v4-32").code == 0
    r = cli("exec", "--", "sh", "-c", _PLANT.replace("@PYTHON@", shlex.quote(sys.executable)))
    assert r.code == 0, r.err

    r = cli("doctor", "--python", "/root/bin/py", "--json")
    assert r.code == 1, r.err
    doc = json.loads(r.out)
    assert doc["summary"]["fail"] >= 4 and doc["exit_code"] == 1

    # worker 0: healthy
    assert _fails(doc, 0) == {}
    rows0 = _rows(doc, 0)
    assert rows0["ssh"][0]["status"] == "pass" and "host key pinned" in rows0["ssh"][0]["detail"]
    assert rows0["startup script"][0]["status"] == "pass"
    assert "torch 2.9.0, torch_xla 2.9.0" in rows0["torch_xla"][0]["detail"]
    assert rows0["libtpu"][0]["status"] == "pass" and "/root/site/libtpu" in rows0["libtpu"][0]["detail"]
    assert rows0["devices"][0]["detail"] == (
        "4 device files present, none in use (plain files: an emulated TPU, no chip behind them)"
    )
    assert rows0["clock"][0]["status"] == "pass"

    # worker 1: busy device -> run kill-stale
    f1 = _fails(doc, 1)
    assert set(f1) == {"devices"}, f1
    assert "the TPU is in use" in f1["devices"]["detail"] and re.search(
        r"holds /dev/accel2 \(root: \S*python3? -c 'import time", f1["devices"]["detail"]
    )
    assert "tpurun kill-stale --tpu doc4" in f1["devices"]["fix"]

    # worker 2: torch 2.9.0 with torch_xla 2.8.0, and different from the other workers
    f2 = _fails(doc, 2)
    assert set(f2) == {"torch_xla", "same versions"}, f2
    assert "torch 2.9.0 and torch_xla 2.8.0 do not match" in f2["torch_xla"]["detail"]
    assert "pip install" in f2["torch_xla"]["fix"]
    assert "torch_xla 2.8.0 (others: 2.9.0)" in f2["same versions"]["detail"]

    # worker 3: XRT_TPU_CONFIG exported in ~/.bashrc with torch_xla 2.9 (no XRT)
    f3 = _fails(doc, 3)
    assert set(f3) == {"xla config"}, f3
    assert "XRT_TPU_CONFIG=localservice;0;localhost:51011" in f3["xla config"]["detail"]
    assert (
        "~/.bashrc:" in f3["xla config"]["detail"]
        and "delete the XRT_TPU_CONFIG line at ~/.bashrc:" in f3["xla config"]["fix"]
    )

    # the system python (no torch): missing torch_xla, as a table with the fix
    r = cli("doctor", "--worker", "0", "--python", "/usr/bin/python3")
    assert r.code == 1
    line = next(ln for ln in r.out.splitlines() if ln.startswith("w0") and " torch_xla " in ln)
    assert "FAIL" in line and "neither torch nor torch_xla is installed" in line and "pip install" in line
    assert "failed" in r.err.splitlines()[-1]


def test_doctor_on_a_fresh_emulated_node_says_what_fails_here_and_what_would_on_a_tpu(cli, emulator):
    """The emulated image's python3 has torch_xla but no libtpu and no chip: no FAIL row a newcomer cannot act
    on; the libtpu row says it is an emulated worker, what to do here and what a real TPU VM needs."""
    assert cli("create", "doc2", "-t", "v4-16").code == 0
    r = cli("doctor", "--json")
    assert r.code == 0, r.out + r.err
    doc = json.loads(r.out)
    assert doc["summary"]["fail"] == 0, [c for c in doc["checks"] if c["status"] == "fail"]
    for w in (0, 1):
        rows = _rows(doc, w)
        lib = rows["libtpu"][0]
        assert lib["status"] == "warn" and "an emulated worker" in lib["detail"] and "--runtime cpu" in lib["detail"]
        assert "on a real TPU VM" in lib["fix"] and "torch_xla[tpu]==2.9.0" in lib["fix"]
        assert rows["torch_xla"][0]["status"] == "pass"
    r = cli("doctor")
    assert r.code == 0 and "FAIL" not in r.out, r.out
