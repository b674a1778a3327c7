"""`schemas.subjects`: the one definition of a name that is a subject token (DESIGN.md §8), and escaping."""

from __future__ import annotations

import msgspec
import pytest

from schemas.subjects import NAME_PATTERN, NODE_SERVICES, NodeName, ShortName, escape_token, served_node


@pytest.mark.parametrize("name", ["n1", "node-1", "a_B-9", "-", "_"])
def test_a_name_is_letters_digits_underscore_and_dash(name):
    assert NAME_PATTERN.match(name)


@pytest.mark.parametrize("name", ["", "a.b", "a b", "a*", "a>", "é", "a/b", "a%2E"])
def test_anything_else_is_not_a_name(name):
    assert not NAME_PATTERN.match(name)


@pytest.mark.parametrize(("kind", "longest"), [(NodeName, 253), (ShortName, 128)])
def test_name_types_keep_their_length_limits(kind, longest):
    decode = msgspec.msgpack.Decoder(kind).decode
    assert decode(msgspec.msgpack.encode("n" * longest)) == "n" * longest
    for bad in ("n" * (longest + 1), "", "a.b"):
        with pytest.raises(msgspec.ValidationError):
            decode(msgspec.msgpack.encode(bad))


def test_every_service_uses_the_one_definition():
    from bus import settings
    from schemas import allocation, asyncapi, broker
    from services.broker import model

    assert allocation.NodeName is NodeName
    assert broker.Token is ShortName
    assert model.TOKEN is NAME_PATTERN and settings.NAME_PATTERN is NAME_PATTERN
    assert asyncapi.KEY is NAME_PATTERN


def test_metric_names_are_names_joined_by_dots():
    from schemas.metrics import Metric

    decode = msgspec.msgpack.Decoder(Metric).decode
    assert decode(msgspec.msgpack.encode("cpu.usage.ratio.cpu")) == "cpu.usage.ratio.cpu"
    for bad in ("", "cpu..usage", ".cpu", "cpu.", "cpu.*", "cpu usage"):
        with pytest.raises(msgspec.ValidationError):
            decode(msgspec.msgpack.encode(bad))


def test_escaped_ids_are_one_token():
    assert escape_token("/kubepods/pod1.slice") == "/kubepods/pod1%2Eslice"
    assert escape_token("a*b>c%d e\tf") == "a%2Ab%3Ec%25d%20e%09f"
    assert escape_token("plain-id_1") == "plain-id_1"


def test_the_subjects_a_nodes_agent_alone_answers_are_the_contracts_node_subjects():
    """`served_node` (which says "no agent serves node n9" when nobody answers) knows exactly the
    services whose commands the tables write `<service>.<node>.<command>`."""
    from berth.registry import contracts

    per_node = {command.subject.split(".")[0] for tables in contracts().values() for command in tables.COMMANDS
                if command.subject.split(".")[1:2] == ["<node>"]}
    assert per_node == set(NODE_SERVICES)
    assert served_node("metrics.n9.get") == served_node("agent.n9.drain") == "n9"
    assert served_node("resource.node.n9.node-heartbeat") is None and served_node("resource.plugins") is None
    assert served_node("metrics") is None
