"""Byte sizes and CPU quantities parse exactly, or are refused naming the field (DESIGN.md §8)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.errors import InvalidArgument
from schemas.sizes import MAX_INT, format_size, parse_size
from berth.commands.nodes import human_bytes

SHIFTS = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40, "P": 50}


@given(st.integers(0, MAX_INT))
def test_every_integer_up_to_the_maximum_parses_exactly_as_a_string(n):
    assert parse_size(str(n), "memory") == n
    assert parse_size(n, "memory") == n


sized = st.sampled_from(sorted(SHIFTS)).flatmap(lambda s: st.tuples(st.integers(0, MAX_INT >> SHIFTS[s]), st.just(s)))


@given(sized, st.sampled_from(["", "B", "iB", "ib", "i", "I"]))
def test_suffixes_are_binary_and_exact(number_suffix, unit):
    n, suffix = number_suffix
    if not suffix:
        unit = ""  # the contract puts "B", "iB" or "i" after a multiplier
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


# -- the IEC spelling berth prints (DESIGN.md §8: "Sizes also accept the IEC spelling berth itself prints")


@pytest.mark.parametrize("text,size", [
    ("16Gi", 16 << 30), ("512Mi", 512 << 20), ("1.5Ki", 1536), ("2Ti", 2 << 40), ("1Pi", 1 << 50),
    ("16gi", 16 << 30), (" 16 Gi ", 16 << 30), ("1.25Gi", (1 << 30) + (1 << 28)), ("16GiB", 16 << 30),
])
def test_the_iec_spelling_is_accepted(text, size):
    assert parse_size(text, "memory") == size


@pytest.mark.parametrize("text", ["16Gx", "Gi", "16i", "i", "16Gii", "16iG", "16GiBB", "1.5 Ki B", "16Gi-"])
def test_a_malformed_size_is_refused_saying_what_a_size_is(text):
    with pytest.raises(InvalidArgument) as refused:
        parse_size(text, "memory-request")
    assert refused.value.field == "memory-request"
    assert refused.value.message == (
        f"memory-request: {text!r} is not a byte size: use an integer, or a number with a suffix K, M, G, T "
        "or P, alone or followed by i, B or iB ('16Gi', '512MiB', '1.5K')"
    )


def test_a_decimal_that_is_no_whole_number_of_bytes_is_refused():
    with pytest.raises(InvalidArgument) as refused:
        parse_size("1.3Gi", "memory")
    assert refused.value.message == "memory: '1.3Gi' is not a whole number of bytes"


@given(st.integers(-MAX_INT, MAX_INT))
def test_every_size_berth_prints_parses_back_to_the_same_number(size):
    printed = format_size(size)
    assert parse_size(printed, "memory", allow_negative=True) == size
    assert human_bytes(size) == printed  # what `berth nodes` shows


@given(st.sampled_from(sorted(SHIFTS)[1:]), st.integers(1, 4095), st.sampled_from([0, 25, 50, 75]))
def test_a_size_in_whole_or_quarter_units_prints_in_a_unit(suffix, whole, hundredths):
    size = (whole * 100 + hundredths) * (1 << SHIFTS[suffix]) // 100
    printed = format_size(size)
    assert parse_size(printed, "memory") == size
    assert printed.endswith("i") and SHIFTS[printed[-2]] >= SHIFTS[suffix]  # that unit or a larger one


@pytest.mark.parametrize("size,printed", [
    (0, "0"), (1023, "1023"), (1024, "1Ki"), (1536, "1.5Ki"), (16 << 30, "16Gi"), (512 << 20, "512Mi"),
    ((1 << 30) + (1 << 28), "1.25Gi"), (16694730752, "16303448Ki"), (1395864371, "1395864371"),
    (1 << 62, "4096Pi"), (MAX_INT, str(MAX_INT)), (-1536, "-1.5Ki"),
])
def test_sizes_print_in_the_largest_unit_that_is_exact(size, printed):
    assert format_size(size) == printed == human_bytes(size)
    if abs(size) < 2**53:  # an integral float, as a JSON reply may carry it
        assert human_bytes(float(size)) == printed
