"""The one parser of msgspec's error paths (bus/codec.py `error_field`), used by the bus decoder and
by the plugins' decoder (plugins/kit.py decode): fields are whole paths, map values named by their key."""

from __future__ import annotations

from typing import Annotated, Any

import msgpack
import msgspec
import pytest

from bus.codec import convert, decode, decode_as, error_field, split_field
from schemas.errors import InvalidArgument
from services.allocation.plugins import kit
from services.allocation.plugins.interface import keyed_field


class Leaf(msgspec.Struct):
    size: int = 0


class Tree(msgspec.Struct, rename={"dash_name": "dash-name"}):
    m: dict[str, int] = {}
    l: list[dict[str, int]] = []  # noqa: E741
    n: dict[str, dict[str, int]] = {}
    leaves: dict[str, Leaf] = {}
    optional: dict[str, int] | None = None
    annotated: Annotated[dict[str, int], msgspec.Meta(max_length=5)] = {}
    anything: dict[str, Any] = {}
    pair: tuple[int, dict[str, int]] = (0, {})
    dash_name: dict[str, int] = {}
    x: int = 0


class Rooted(msgspec.Struct):
    tree: Tree
    required: int


def field_of(value: Any, type_: Any = Tree, prefix: str = "") -> tuple[str, str]:
    with pytest.raises(msgspec.ValidationError) as caught:
        msgspec.convert(value, type_)
    return error_field(str(caught.value), prefix, value=value, type_=type_)


@pytest.mark.parametrize(
    "value,field",
    [
        ({"x": "s"}, "x"),
        ({"m": {"a": 1, "b": "x", "c": "y"}}, "m.b"),
        ({"l": [{"a": 1}, {"b": 2, "c": "x"}]}, "l[1].c"),
        ({"n": {"k": {"z": 1}, "j": {"y": "q"}}}, "n.j.y"),
        ({"leaves": {"/a": {"size": 1}, "/b": {"size": "1G"}}}, "leaves./b.size"),
        ({"optional": {"a": "x"}}, "optional.a"),
        ({"annotated": {"a": 1, "b": "x"}}, "annotated.b"),
        ({"pair": [1, {"a": "x"}]}, "pair[1].a"),
        ({"dash-name": {"k": "x"}}, "dash-name.k"),
    ],
)
def test_a_bad_map_value_is_named_by_its_key(value, field):
    assert field_of(value)[0] == field
    assert field_of(value, prefix="capacity")[0] == f"capacity.{field}"


def test_nested_structs_and_required_fields_name_the_whole_path():
    assert field_of({"tree": {"m": {"k": "x"}}, "required": 1}, Rooted) == (
        "tree.m.k", "Expected `int`, got `str`")
    assert field_of({"tree": {}}, Rooted) == ("required", "required field is missing")
    assert field_of({"tree": {}}, Rooted, "usage") == ("usage.required", "required field is missing")
    assert field_of({"l": [{}, {"a": {}}]}, Tree, "p") == ("p.l[1].a", "Expected `int`, got `object`")


def test_a_bad_map_key_names_the_map_up_to_it():
    field, reason = field_of({"m": {1: 2}})
    assert (field, reason) == ("m", "map key: Expected `str`, got `int`")
    field, reason = field_of({"n": {"ok": {}, "bad": {3: 1}}}, Tree, "resource")
    assert field == "resource.n.bad" and reason.startswith("map key: ")


def test_a_top_level_map_and_a_top_level_list():
    assert field_of({"a": "x", "b": 1}, dict[str, str]) == ("b", "Expected `str`, got `int`")
    assert field_of([1, "a"], list[int]) == ("[1]", "Expected `int`, got `str`")
    assert field_of({"a": "x", "b": 1}, dict[str, str], "labels")[0] == "labels.b"


def test_without_the_value_the_field_stops_at_the_map():
    message = "Expected `int`, got `str` - at `$.n[...][...]`"
    assert error_field(message) == ("n", "Expected `int`, got `str`")
    assert error_field(message, "usage") == ("usage.n", "Expected `int`, got `str`")
    # A map whose values accept anything cannot say which key failed: the field is the map.
    assert error_field("Expected `int`, got `str` - at `$.anything[...]`", value={"anything": {"a": 1}},
                       type_=Tree) == ("anything", "Expected `int`, got `str`")


def test_a_message_without_a_path_names_the_prefix_or_the_payload():
    assert error_field("Expected `object`, got `array`") == ("$", "Expected `object`, got `array`")
    assert error_field("Expected `object`, got `array`", "info") == ("info", "Expected `object`, got `array`")


def test_an_unknown_field_names_the_key_under_its_map():
    """msgspec's "unknown field" of a Struct that forbids them: the key is the field (the bus finds the
    accepted keys from the value; without it, the key alone is named)."""
    assert error_field("Object contains unknown field `x`") == ("x", "unknown key 'x'")
    assert error_field("Object contains unknown field `x` - at `$.filter`", "spec") == ("spec.filter.x", "unknown key 'x'")


def test_the_bus_decoders_name_the_key_from_messagepack():
    with pytest.raises(InvalidArgument) as caught:
        decode(msgpack.packb({"m": {"a": 1, "b": "x"}}), Tree)
    assert caught.value.field == "m.b"
    with pytest.raises(InvalidArgument) as caught:
        decode_as(msgpack.packb({"k": ["a"]}), dict[str, list[int]], "param.ports")
    assert caught.value.field == "param.ports.k[0]"
    with pytest.raises(InvalidArgument) as caught:
        convert({"leaves": {"/v": {"size": None}}}, Tree, path="resource")
    assert caught.value.field == "resource.leaves./v.size"


def test_the_plugin_decoder_uses_the_same_parser():
    with pytest.raises(InvalidArgument) as caught:
        kit.decode({"m": {"0": 1.0, "1": 99.5}}, Tree, "capacity")
    assert caught.value.field == "capacity.m.1"  # 1.0 counts as an integer, 99.5 does not
    with pytest.raises(InvalidArgument) as caught:
        kit.decode({"m": {2: 1}}, Tree, "usage")
    assert (caught.value.field, caught.value.details) == ("usage.m", {"field": "usage.m"})
    assert "map key" in caught.value.message


@pytest.mark.parametrize(
    "field,head,steps",
    [
        ("nodename", "nodename", []),
        ("workloads_resource[0].cpu_map.3", "workloads_resource", ["[0]", ".cpu_map", ".3"]),
        ("usage.volumes./data", "usage", [".volumes", "./data"]),
        ("[1]", "", ["[1]"]),
    ],
)
def test_split_field_reads_the_paths_error_field_writes(field, head, steps):
    assert split_field(field) == (head, steps)
    assert head + "".join(steps) == field


@pytest.mark.parametrize(
    "field,keyed",
    [
        ("workload_resource_request.cpu-request", "workload_resource_request.cpumem.cpu-request"),
        ("workloads_resource[1].cpu_map.0", "workloads_resource[1].cpumem.cpu_map.0"),
        ("workloads_resource.w-1.cpu_map", "workloads_resource.w-1.cpumem.cpu_map"),
        ("workloads_resource", "workloads_resource.cpumem"),
        ("capacity.cpu_map.0", "capacity.cpumem.cpu_map.0"),
        ("usage", "usage.cpumem"),
        ("deploy_count", "deploy_count"),
    ],
)
def test_keyed_field_puts_the_plugin_after_the_keyed_key(field, keyed):
    assert keyed_field(field, "cpumem") == keyed


@pytest.mark.parametrize(
    "payload,field,reason",
    [
        ({"nodename": "n 1", "deploy_count": 1}, "nodename", "must be letters, digits, '_' and '-' only"),
        ({"nodename": "n1\n", "deploy_count": 1}, "nodename", "must be letters, digits, '_' and '-' only"),
        ({"nodenames": ["a", "b"], "strategy": "fill", "deploy_count": 1}, "strategy",
         "must be spread, pack or each"),
    ],
)
def test_a_pattern_is_said_in_words_not_as_its_regex(payload, field, reason):
    from schemas.allocation import Allocate

    with pytest.raises(InvalidArgument) as caught:
        decode(msgpack.packb(payload), Allocate)
    assert caught.value.field == field
    assert caught.value.message == f"{field}: {reason}"
