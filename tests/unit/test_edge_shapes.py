"""Shapes the core trusts, refused where requests are decoded (maasd.bounds at the edges).

The service keeps the rules (quota, ``max_ttl_s``, whether a node exists); a name
that is not a name, a negative quota or a lease that is not an integer never
reaches it: the REST bodies (maasd.api.schemas), the pool specs (maasd.models, REST
and the config file) and the bounds types refuse them when decoding.
"""

from __future__ import annotations

import msgspec
import pytest

from maasd import bounds
from maasd.api.schemas import LookupBody, RenewBody, ReserveBody, TenantBody, TenantPatchBody
from maasd.models import PoolSpec

BAD_NAMES = ["", "-leading-dash", ".dot", "a" * 65, "spa ce", "new\nline", "acme\n", "ü", "a/b"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_refused_for_tenants_and_pools(name: str) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode({"name": name, "quota_bytes": 1}), type=TenantBody)
    pool = {"name": name, "numa_node": 0, "capacity_bytes": 4096}
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(pool), type=PoolSpec)


@pytest.mark.parametrize("name", ["a", "A.b_c-1", "9" * 64])
def test_good_names_pass(name: str) -> None:
    body = msgspec.json.decode(
        msgspec.json.encode({"name": name, "quota_bytes": 0}), type=TenantBody
    )
    assert body.name == name


@pytest.mark.parametrize("quota", [-1, bounds.MAX_BYTES + 1, 1.5, "5", True, None])
def test_bad_quotas_are_refused(quota: object) -> None:
    for body in ({"name": "t", "quota_bytes": quota}, {"quota_bytes": quota}):
        kind = TenantBody if "name" in body else TenantPatchBody
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(msgspec.json.encode(body), type=kind)


@pytest.mark.parametrize(
    "field",
    [
        {"capacity_bytes": 0},
        {"capacity_bytes": -4096},
        {"capacity_bytes": bounds.MAX_BYTES + 1},
        {"latency_us": -1},
        {"numa_node": -1},
        {"numa_node": bounds.MAX_NODE + 1},
        {"spill_dir": ""},
        {"backing": "ramdisk"},
        {"scrub": "shred"},
        {"colour": "blue"},
    ],
)
def test_bad_pool_fields_are_refused(field: dict[str, object]) -> None:
    spec = {"name": "p", "numa_node": 0, "capacity_bytes": 4096, **field}
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(spec), type=PoolSpec)
    with pytest.raises(msgspec.ValidationError):  # the config file's path (lenient strings)
        msgspec.convert(spec, PoolSpec, strict=False)


@pytest.mark.parametrize("ttl", [True, False, 1.0, 600.5, "600", None, 0, -1, 2**31 + 1])
def test_leases_must_be_whole_positive_seconds(ttl: object) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode({"ttl_s": ttl}), type=RenewBody)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode({"size_bytes": 1, "ttl_s": ttl}), type=ReserveBody)


@pytest.mark.parametrize(
    "keys",
    [[], [""], ["k" * (bounds.MAX_KEY + 1)], ["k"] * (bounds.MAX_LOOKUP_KEYS + 1), [1], "k"],
)
def test_bad_lookups_are_refused(keys: object) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode({"keys": keys}), type=LookupBody)


def test_the_largest_lookup_passes() -> None:
    keys = [f"k{i}" for i in range(bounds.MAX_LOOKUP_KEYS)]
    assert msgspec.json.decode(msgspec.json.encode({"keys": keys}), type=LookupBody).keys == keys


@pytest.mark.parametrize("value", [0, -1, bounds.MAX_EVENTS + 1, True, "5"])
def test_event_pages_are_bounded(value: object) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(value), type=bounds.EventLimit)
