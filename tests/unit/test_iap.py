"""IAP's TCP forwarding, the client's own parts (tpurun/transport/iap.py, tpurun/cloud/services.py): the frames
as the relay v4 protocol lays them out (gcloud's own test bytes among them), the connect URL as gcloud builds
it, the tunnel's endpoint beside the API's, and how the `via` setting reads. The tunnel itself is tested
against the emulator's IAP endpoint (tests/integration/test_iap.py)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl, urlparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tpurun import settings
from tpurun.cloud import identity, services
from tpurun.errors import UsageError
from tpurun.transport import iap, proxy_command


def test_frames_are_laid_out_as_the_protocol_says():
    assert iap.data_frame(b"abcde") == b"\x00\x04\x00\x00\x00\x05abcde"
    assert iap.ack_frame(70000) == b"\x00\x07" + (70000).to_bytes(8, "big")
    assert iap.sid_frame(b"z") == b"\x00\x01\x00\x00\x00\x01z"
    # gcloud's own test data: a DATA frame with a byte after it, and a session id of one byte
    tag, value = iap.parse(b"\x00\x04\x00\x00\x00\x06\x99abcde")
    assert tag == iap.DATA and bytes(value) == b"\x99abcde"
    tag, value = iap.parse(b"\x00\x01\x00\x00\x00\x01z")
    assert tag == iap.CONNECT_SUCCESS_SID and bytes(value) == b"z"
    assert iap.parse(b"\x00\x02" + (12).to_bytes(8, "big")) == (iap.RECONNECT_SUCCESS_ACK, 12)


@given(st.binary(min_size=1, max_size=iap.MAX_DATA), st.binary(max_size=20))
def test_a_data_frame_keeps_its_bytes_whatever_follows(payload, after):
    tag, value = iap.parse(iap.data_frame(payload) + after)
    assert tag == iap.DATA and bytes(value) == payload


@given(st.integers(0, 2**64 - 1))
def test_an_ack_keeps_its_count(count):
    assert iap.parse(iap.ack_frame(count)) == (iap.ACK, count)


def test_unknown_tags_are_ignored_and_short_frames_refused():
    assert iap.parse(b"\x00\x0a\x00\x00\x0f\xa0\x00\x00\x00\x02hi") == (0x000A, None)  # LONG_CLOSE: not ours
    assert iap.parse(b"\x12\x34") == (0x1234, None)
    for cut in (b"\x00", b"\x00\x04\x00\x00", b"\x00\x04\x00\x00\x00\x05abc", b"\x00\x07\x00\x00"):
        with pytest.raises(ValueError):
            iap.parse(cut)


def test_data_frames_carry_one_to_16_kib():
    assert len(iap.data_frame(b"x" * iap.MAX_DATA)) == iap.MAX_DATA + 6
    for size in (0, iap.MAX_DATA + 1):
        with pytest.raises(ValueError):
            iap.data_frame(b"x" * size)


def test_the_connect_url_is_gclouds():
    url = iap.connect_url("wss://tunnel.cloudproxy.app/v4/connect", iap.Instance("my-proj", "us-central2-b", "t1v-n-1-w-0"))
    parts = urlparse(url)
    assert (parts.scheme, parts.netloc, parts.path) == ("wss", "tunnel.cloudproxy.app", "/v4/connect")
    assert parse_qsl(parts.query) == [
        ("project", "my-proj"),
        ("port", "22"),
        ("newWebsocket", "True"),
        ("zone", "us-central2-b"),
        ("instance", "t1v-n-1-w-0"),
        ("interface", "nic0"),
    ]
    odd = iap.connect_url("ws://h/v4/connect", iap.Instance("p", "z", "a b&c=d", 2222))
    assert dict(parse_qsl(urlparse(odd).query))["instance"] == "a b&c=d"


def test_the_tunnel_is_beside_the_api():
    assert services.tunnel_url("https://tpu.googleapis.com") == "wss://tunnel.cloudproxy.app/v4/connect"
    assert services.tunnel_url("tpu.googleapis.com") == "wss://tunnel.cloudproxy.app/v4/connect"
    assert services.tunnel_url("http://127.0.0.1:8470") == "ws://127.0.0.1:8470/v4/connect"
    assert services.tunnel_url("https://tpu.example.internal:443/") == "wss://tpu.example.internal:443/v4/connect"


def _via(value: str | None) -> str:
    return settings.resolve({"via": value}, env={}, cwd=Path("/")).via_way


def test_via_reads_a_way_or_a_proxy_command():
    assert _via(None) == "auto"
    assert _via("IAP") == "iap" and _via("direct") == "direct"
    assert _via("ssh -W %h:%p bastion") == "ssh -W %h:%p bastion"
    with pytest.raises(UsageError, match="%h"):
        _via("iapp")  # a typo is not a command: a command names the worker's host


def test_a_proxy_command_is_expanded_as_openssh_does():
    assert proxy_command.expand("ssh -W %h:%p -l %r jump # 100%%", "10.0.0.2", 22, "me") == (
        "ssh -W 10.0.0.2:22 -l me jump # 100%"
    )
    with pytest.raises(UsageError, match="%C"):
        proxy_command.expand("nc %h %p %C", "10.0.0.2", 22, "me")


def test_an_old_record_reads_without_instance_names():
    old = {"acceleratorType": "v4-16", "slices": [[["10.0.0.2", "", "tpu.1-0"]]], "nodes": ["n"], "ids": ["1"]}
    assert identity.Endpoints.from_json(old).slices == [[("10.0.0.2", "", "tpu.1-0", "")]]
    new = identity.Endpoints.from_json({**old, "slices": [[["10.0.0.2", "", "tpu.1-0", "t1v-n-1-w-0"]]]})
    assert identity.Endpoints.from_json(new.to_json()) == new
