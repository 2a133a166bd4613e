"""The emulated Billing Catalog, read by google-cloud-billing's own client, and tpurun's prices read from it."""

from __future__ import annotations

import json
import socket
import time

import pytest
from google.api_core import exceptions as gx
from google.auth.credentials import AnonymousCredentials
from google.cloud import billing_v1

from tpurun import price_table
from tpurun.cloud import prices
from tpurun.emulator import billing_api
from tpurun.topology import GENERATIONS

pytestmark = pytest.mark.integration


@pytest.fixture
def catalog(emulator):
    return billing_v1.CloudCatalogClient(
        transport="rest",
        client_options={"api_endpoint": emulator.endpoint},
        credentials=AnonymousCredentials(),
    )


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A tpurun home of the test's own, and no answer remembered from another test."""
    monkeypatch.setenv("TPURUN_HOME", str(tmp_path))
    prices.forget()
    yield tmp_path
    prices.forget()


def _catalogue_calls(emulator, since: int) -> list[dict]:
    return [r for r in emulator.requests(since) if r["path"].startswith("/v1/services")]


def test_the_client_lists_services_and_skus_page_by_page(emulator, catalog):
    since = emulator.request_count()
    services = list(catalog.list_services(request={"page_size": 1}))
    assert {s.service_id: s.display_name for s in services} == {
        "E000-3F24-B8AA": "Cloud TPU",
        "6F81-5844-456A": "Compute Engine",
    }
    assert services[0].name == "services/E000-3F24-B8AA" and services[0].business_entity_name
    every = list(catalog.list_skus(parent="services/6F81-5844-456A"))
    paged = list(catalog.list_skus(request={"parent": "services/6F81-5844-456A", "page_size": 7}))
    assert [s.sku_id for s in paged] == [s.sku_id for s in every] and len(every) > 7
    calls = _catalogue_calls(emulator, since)
    assert sum("pageToken=" in r["detail"] for r in calls) >= len(every) // 7  # every page asked for
    v5e = next(s for s in every if s.description == "TpuV5e running in Iowa")
    assert v5e.category.resource_group == "TPU" and v5e.category.usage_type == "OnDemand"
    assert list(v5e.service_regions) == ["us-central1"] and list(v5e.geo_taxonomy.regions) == ["us-central1"]
    rate = v5e.pricing_info[0].pricing_expression
    assert rate.usage_unit == "h" and rate.base_unit_conversion_factor == 3600
    assert (rate.tiered_rates[0].unit_price.units, rate.tiered_rates[0].unit_price.nanos) == (1, 200_000_000)
    assert v5e.name == f"services/6F81-5844-456A/skus/{v5e.sku_id}"
    usages = {s.category.usage_type for s in every}
    assert {"OnDemand", "Preemptible", "Commit1Yr"} <= usages


def test_the_catalogue_refuses_what_google_refuses(emulator, catalog):
    with pytest.raises(gx.NotFound):
        list(catalog.list_skus(parent="services/0000-0000-0000"))
    with pytest.raises(gx.BadRequest):
        list(catalog.list_skus(request={"parent": "services/E000-3F24-B8AA", "page_token": "not-a-token"}))
    with pytest.raises(gx.BadRequest):
        list(catalog.list_skus(request={"parent": "services/E000-3F24-B8AA", "currency_code": "EUR"}))


def test_every_generation_has_its_naming_and_every_table_region_its_name():
    assert set(GENERATIONS) == set(price_table.NAMING)
    assert {row.region for row in price_table.TABLE} <= set(billing_api.LOCATIONS)
    served = {(row.generation, row.region) for row in price_table.TABLE}
    # the emulator's catalogue has a SKU for every row of the table in its regions, and none for TPU7x
    skus = [s for service in billing_api.catalogue().values() for s in service]
    assert not any("TPU7x" in s["description"] for s in skus)
    assert len({(s["description"], s["category"]["usageType"]) for s in skus}) == len(skus)
    assert len(served) <= len(skus)


def test_a_v5e_16_costs_its_chips_at_the_catalogues_price(emulator, home):
    on_demand = prices.quote("v5litepod-16", "us-central1-a", "on-demand", endpoint=emulator.endpoint, home=home)
    assert on_demand is not None and on_demand.source == "catalog"
    assert on_demand.chips == 16 and on_demand.per_hour == pytest.approx(19.20)
    assert on_demand.as_of == time.strftime("%Y-%m-%d", time.gmtime())
    spot = prices.quote("v5litepod-16", "us-central1-a", "spot", endpoint=emulator.endpoint, home=home)
    assert spot is not None and spot.source == "catalog" and spot.provisioning == "spot"
    assert spot.per_hour < on_demand.per_hour and spot.sku != on_demand.sku
    assert prices.quote("v5litepod-16", "us-central1-b", "preemptible", endpoint=emulator.endpoint, home=home) == spot
    europe = prices.quote("v6e-8", "europe-west4-a", "on-demand", endpoint=emulator.endpoint, home=home)
    assert europe is not None and europe.per_chip_hour == pytest.approx(2.97)
    # v5p-N counts TensorCores: a v5p-8 is 4 chips; two slices of it, 8
    v5p = prices.quote("v5p-8", "us-central1-a", "on-demand", endpoint=emulator.endpoint, home=home, slices=2)
    assert v5p is not None and v5p.chips == 8 and v5p.per_hour == pytest.approx(8 * 4.20)
    # v3 pods and v3 devices have SKUs of their own, priced per 8 TensorCores
    device = prices.quote("v3-8", "europe-west4-a", "on-demand", endpoint=emulator.endpoint, home=home)
    pod = prices.quote("v3-32", "europe-west4-a", "on-demand", endpoint=emulator.endpoint, home=home)
    assert device is not None and pod is not None
    assert (device.per_chip_hour, pod.per_chip_hour) == (pytest.approx(2.2), pytest.approx(2.0))
    # no published price: TPU7x anywhere, v6e in a region without its SKU
    assert prices.quote("tpu7x-8", "us-central1-a", "on-demand", endpoint=emulator.endpoint, home=home) is None
    assert prices.quote("v6e-8", "us-central2-b", "on-demand", endpoint=emulator.endpoint, home=home) is None
    # flex-start has no SKU of its own here: priced as on-demand, and said so
    flex = prices.quote("v5litepod-16", "us-central1-a", "flex-start", endpoint=emulator.endpoint, home=home)
    assert flex is not None and flex.provisioning == "on-demand" and flex.per_hour == on_demand.per_hour
    assert prices.Price.from_json(on_demand.to_json()) == on_demand


def test_a_catalogue_read_is_kept_and_not_read_again(emulator, home):
    since = emulator.request_count()
    first = prices.quote("v5litepod-16", "us-central1-a", "on-demand", endpoint=emulator.endpoint, home=home)
    calls = _catalogue_calls(emulator, since)
    assert [r["path"] for r in calls] == ["/v1/services/E000-3F24-B8AA/skus", "/v1/services/6F81-5844-456A/skus"]
    assert prices.cache_path(emulator.endpoint, home).is_file()
    prices.forget()  # as another command would: nothing remembered but the kept file
    since = emulator.request_count()
    again = prices.quote("v5litepod-16", "us-central1-a", "on-demand", endpoint=emulator.endpoint, home=home)
    assert again == first and _catalogue_calls(emulator, since) == []


def test_an_unreachable_catalogue_gives_the_table_at_once(home):
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    price = prices.quote("v5litepod-16", "us-central1-a", "on-demand", endpoint=f"http://127.0.0.1:{port}", home=home)
    assert time.monotonic() - start < 3
    assert price is not None and price.source == "table" and price.as_of == price_table.AS_OF
    assert price.per_hour == pytest.approx(19.20)
    assert not prices.cache_path(f"http://127.0.0.1:{port}", home).exists()  # nothing kept: read again next time


def test_a_read_past_its_week_is_read_again(emulator, home):
    kept = prices.cache_path(emulator.endpoint, home)
    kept.parent.mkdir(parents=True)
    kept.write_text(json.dumps({"endpoint": emulator.endpoint, "read": "2020-01-01", "offers": []}))
    since = emulator.request_count()
    price = prices.quote("v5litepod-16", "us-central1-a", "on-demand", endpoint=emulator.endpoint, home=home)
    assert price is not None and price.as_of != "2020-01-01" and len(_catalogue_calls(emulator, since)) == 2
    assert json.loads(kept.read_text())["read"] == price.as_of
