"""Ids derived from a request id (services/allocation/committer.py): the fast derivation is uuid5's."""

from __future__ import annotations

import uuid

from hypothesis import given, strategies as st

from services.allocation.committer import _WORKLOAD_NAMESPACE, _uuid5, workload_ids


@given(st.text(max_size=300))
def test_the_derivation_is_uuid5_of_the_workload_namespace(name):
    assert _uuid5(name) == str(uuid.uuid5(_WORKLOAD_NAMESPACE, name))


def test_each_run_of_a_request_derives_its_own_ids_and_the_same_ones_every_time():
    first, again, later = workload_ids(3, None, "r-1"), workload_ids(3, None, "r-1"), workload_ids(3, None, "r-1", 1)
    assert first == again and len(set(first)) == 3 and set(first).isdisjoint(later)
    assert first[0] == str(uuid.uuid5(_WORKLOAD_NAMESPACE, "r-1/0"))
