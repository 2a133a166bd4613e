"""Reading the Billing Catalog's SKUs as prices: which SKU prices which TPU, and the bundled table."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tpurun import price_table
from tpurun.cloud import prices
from tpurun.errors import UsageError


def sku(description, usage="OnDemand", regions=("us-central1",), units=1, nanos=200_000_000, **over):
    """A SKU as the catalogue's JSON spells it (the shapes of real TPU SKUs)."""
    body = {
        "skuId": over.pop("sku_id", "AAAA-BBBB-CCCC"),
        "description": description,
        "category": {"resourceFamily": "Compute", "resourceGroup": over.pop("group", "TPU"), "usageType": usage},
        "serviceRegions": list(regions),
        "pricingInfo": [
            {
                "pricingExpression": {
                    "usageUnit": over.pop("unit", "h"),
                    "tieredRates": [
                        {"startUsageAmount": 0, "unitPrice": {"currencyCode": "USD", "units": str(units), "nanos": nanos}}
                    ],
                }
            }
        ],
    }
    body.update(over)
    return body


@pytest.mark.parametrize(
    ("description", "key"),
    [
        ("TpuV5e running in Iowa", "v5e"),
        ("TpuV5p running in Sao Paulo", "v5p"),
        ("TpuV6e attached to Spot Preemptible VMs running in Dallas", "v6e"),
        ("TPU7x running in Americas", "7x"),
        ("Tpu-v3 Pod running in Netherlands", "v3"),
        ("Preemptible Tpu-v2 running in Iowa", "v2"),
        ("Nvidia Tesla T4 GPU running in Americas", ""),
    ],
)
def test_a_descriptions_generation(description, key):
    assert prices.sku_key(description) == key


def test_every_generation_is_spelt_as_its_skus_spell_it():
    assert prices.generation_key("v5litepod") == "v5e"
    assert prices.generation_key("tpu7x") == "7x"
    assert prices.generation_key("v4") == "v4"


def test_plain_hourly_tpu_skus_are_offers_and_the_rest_is_not():
    offer = prices.offer_of(sku("TpuV5e running in Iowa"))
    assert offer == prices.Offer("AAAA-BBBB-CCCC", "v5e", False, "on-demand", ("us-central1",), 1.2)
    spot = prices.offer_of(sku("TpuV5e attached to Spot Preemptible VMs running in Iowa", "Preemptible", nanos=0))
    assert spot is not None and spot.provisioning == "spot"
    # the older generations' preemptible SKUs say so only in their description
    old = prices.offer_of(sku("Preemptible Tpu-v3 Pod running in Netherlands", units=2))
    assert old is not None and (old.provisioning, old.pod, old.key) == ("spot", True, "v3")
    for other in (
        sku("Commitment v1: TpuV5p running in Netherlands for 3 Years", "Commit3Yr"),
        sku("Reserved TpuV5p in Delhi in Calendar Mode"),
        sku("Nvidia Tesla T4 GPU running in Americas", group="GPU"),
        sku("TpuV5e running in Iowa", unit="s"),
        sku("TpuV6e running in Iowa", pricingInfo=[]),
    ):
        assert prices.offer_of(other) is None, other["description"]


def test_the_offer_for_a_tpu_is_its_generations_in_its_region():
    offers = [
        prices.offer_of(sku("TpuV5e running in Iowa", sku_id="1")),
        prices.offer_of(sku("TpuV5e running in Netherlands", regions=("europe-west4",), sku_id="2")),
        prices.offer_of(sku("TpuV5p running in Iowa", sku_id="3")),
        prices.offer_of(sku("Tpu-v3 running in Iowa", sku_id="4")),
        prices.offer_of(sku("Tpu-v3 Pod running in Iowa", sku_id="5")),
        prices.offer_of(sku("TPU7x running in Americas", regions=("us-central1", "us-east1"), sku_id="6")),
    ]
    found = [o for o in offers if o is not None]

    def chosen(generation, region, pod=False, provisioning="on-demand"):
        o = prices.pick(found, generation, region, provisioning, pod)
        return o.sku if o else None

    assert chosen("v5litepod", "us-central1") == "1"
    assert chosen("v5litepod", "europe-west4") == "2"
    assert chosen("v5p", "us-central1") == "3"
    assert chosen("v3", "us-central1") == "4" and chosen("v3", "us-central1", pod=True) == "5"
    assert chosen("tpu7x", "us-east1") == "6"
    assert chosen("v6e", "us-central1") is None
    assert chosen("v5litepod", "us-central1", provisioning="spot") is None


def test_v2_and_v3_pods_are_their_types_above_one_device():
    assert not price_table.is_pod("v3", 4) and price_table.is_pod("v3", 16)
    assert not price_table.is_pod("v5litepod", 256)


def test_the_table_answers_when_the_catalogue_cannot(monkeypatch, tmp_path):
    monkeypatch.setenv("TPURUN_HOME", str(tmp_path))
    with socket.socket() as s:  # a loopback port nothing listens on: the catalogue cannot be read
        s.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{s.getsockname()[1]}"
    prices.forget()
    try:
        price = prices.quote("v6e-8", "europe-west4-a", "spot", endpoint=nowhere, home=tmp_path)
        assert price is not None and (price.source, price.as_of) == ("table", price_table.AS_OF)
        assert price.per_chip_hour == pytest.approx(1.03748) and price.chips == 8
        assert prices.quote("v3-8", "us-east1-d", "spot", endpoint=nowhere, home=tmp_path) is None  # none published
        assert prices.quote("tpu7x-8", "us-central1-a", "on-demand", endpoint=nowhere, home=tmp_path) is None
        with pytest.raises(UsageError):
            prices.quote("v6e-8", "europe-west4-a", "cheap", endpoint=nowhere, home=tmp_path)
    finally:
        prices.forget()


def test_the_prices_module_loads_no_billing_client():
    code = "import sys, tpurun.cloud.prices; assert 'google.cloud.billing_v1' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_a_kept_read_past_its_week_still_answers_when_the_catalogue_cannot_be_read(monkeypatch, tmp_path):
    monkeypatch.setenv("TPURUN_HOME", str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{s.getsockname()[1]}"
    offer = prices.offer_of(sku("TpuV5e running in Iowa", units=1, nanos=100_000_000, sku_id="KEPT"))
    assert offer is not None
    kept = prices.cache_path(nowhere, tmp_path)
    kept.parent.mkdir(parents=True)
    kept.write_text(json.dumps({"endpoint": nowhere, "read": "2020-01-01", "offers": [offer.to_json()]}))
    prices.forget()
    try:
        price = prices.quote("v5litepod-4", "us-central1-a", "on-demand", endpoint=nowhere, home=tmp_path)
        assert price == prices.Price(1.1, 4, "on-demand", "catalog", "2020-01-01", "KEPT")
    finally:
        prices.forget()
