"""Byte sizes and CPU quantities parse exactly, or are refused naming the field (DESIGN.md §8)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.errors import InvalidArgument
from schemas.sizes import MAX_INT, parse_size

SHIFTS = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40, "P": 50}


@given(st.integers(0, MAX_INT))
def test_every_integer_up_to_the_maximum_parses_exactly_as_a_string(n):
    assert parse_size(str(n), "memory") == n
    assert parse_size(n, "memory") == n


sized = st.sampled_from(sorted(SHIFTS)).flatmap(lambda s: st.tuples(st.integers(0, MAX_INT >> SHIFTS[s]), st.just(s)))


@given(sized, st.sampled_from(["", "B", "iB", "ib"]))
def test_suffixes_are_binary_and_exact(number_suffix, unit):
    n, suffix = number_suffix
    if not suffix:
        unit = ""  # the contract puts "B" or "iB" after a multiplier
    assert parse_size(f"{n}{suffix}{unit}", "memory") == n << SHIFTS[suffix]


@given(st.integers(1, MAX_INT), st.sampled_from(sorted(SHIFTS)))
def test_a_negative_size_is_accepted_only_in_deltas(n, suffix):
    text = f"-{n >> SHIFTS[suffix]}{suffix}"
    expected = -((n >> SHIFTS[suffix]) << SHIFTS[suffix])
    assert parse_size(text, "memory", allow_negative=True) == expected
    if expected:
        with pytest.raises(InvalidArgument) as refused:
            parse_size(text, "memory")
        assert refused.value.field == "memory"


def test_above_2_to_the_53_no_integer_is_rounded():
    assert parse_size("9007199254740993", "memory") == 9007199254740993
    assert parse_size("8191.999999999999999111821580299874767661094665527343750P", "m") == 8191 * 2**50 + 2**50 - 1


@pytest.mark.parametrize(
    "text",
    ["--1G", "-", "1e3", "lots", "", "1.1", "0.5", "1.5B", str(MAX_INT + 1), "8192P", "9" * 5000, "1 G B", "1GG"],
)
def test_anything_else_is_invalid_argument_naming_the_field(text):
    with pytest.raises(InvalidArgument) as refused:
        parse_size(text, "memory-request", allow_negative=True)
    assert refused.value.code == "invalid_argument" and refused.value.field == "memory-request"


@pytest.mark.parametrize("value", [True, None, 1.5, float("nan"), float("inf"), [1], {"a": 1}])
def test_non_sizes_are_refused(value):
    with pytest.raises(InvalidArgument) as refused:
        parse_size(value, "memory")
    assert refused.value.field == "memory"
