"""Unit tests of the storage plugin's pure core (eru resource-storage, DESIGN.md §3 and §8)."""

from __future__ import annotations

import math

import pytest

from schemas.errors import BerthError
from schemas.sizes import MAX_INT
from services.allocation.plugins.interface import EngineInfo
from services.allocation.plugins.storage import StoragePlugin
from services.allocation.plugins.storage.plans import disk_for_path
from services.allocation.plugins.storage.requests import parse_disk
from services.allocation.plugins.storage.types import IO, Disk
from services.allocation.plugins.storage.volumes import VolumeBinding, merge_bindings, parse_binding

G = 2**30
M = 2**20


def code_of(call, *args, **kwargs) -> str:
    with pytest.raises(BerthError) as caught:
        call(*args, **kwargs)
    return caught.value.code


def field_of(call, *args, **kwargs) -> str | None:
    with pytest.raises(BerthError) as caught:
        call(*args, **kwargs)
    return caught.value.field


def node(plugin: StoragePlugin, **request) -> tuple[dict, dict]:
    return plugin.add_node(request, None)


def deploy(plugin, capacity, usage, count, request):
    """Deploy and commit: (engines, workloads, usage after)."""
    engines, workloads = plugin.calculate_deploy(capacity, usage, count, request)
    return engines, workloads, plugin.apply_workloads(usage, workloads, True)


# --- volume binding strings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/src:/dst", VolumeBinding("/src", "/dst", "rw")),
        ("AUTO:/data:rwm", VolumeBinding("AUTO", "/data", "mrw")),
        ("AUTO:/data:", VolumeBinding("AUTO", "/data", "rw")),
        ("AUTO:/data:rw:1G", VolumeBinding("AUTO", "/data", "rw", G)),
        ("AUTO:/data:rw:1.5GiB", VolumeBinding("AUTO", "/data", "rw", 3 * G // 2)),
        ("AUTO:/data:rw:1024:100", VolumeBinding("AUTO", "/data", "rw", 1024, IO(100))),
        ("AUTO:/data:rw:0:100:200", VolumeBinding("AUTO", "/data", "rw", 0, IO(100, 200))),
        ("AUTO:/data:rw:0:1:2:3M", VolumeBinding("AUTO", "/data", "rw", 0, IO(1, 2, 3 * M))),
        (
            "AUTO:/data:rw:10G:1:2:3M:4MB",
            VolumeBinding("AUTO", "/data", "rw", 10 * G, IO(1, 2, 3 * M, 4 * M)),
        ),
        (":/data:rw:1", VolumeBinding("", "/data", "rw", 1)),
    ],
)
def test_binding_forms_parse(text, expected):
    assert parse_binding(text, "v") == expected


def test_binding_flags_are_sorted_so_spellings_agree():
    assert parse_binding("AUTO:/d:rwm:1", "v") == parse_binding("AUTO:/d:mrw:1", "v")
    assert parse_binding("AUTO:/d:rwm:1", "v").flags == "mrw"


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("/only-one-part", "invalid_volume"),
        ("a:b:c:1:2:3:4:5:6", "invalid_volume"),  # 9 parts
        ("AUTO::rw:1G", "invalid_volume"),  # no destination
        ("AUTO:/d:rw:lots", "invalid_volume"),  # size does not parse
        ("AUTO:/d:rw:", "invalid_volume"),  # an empty size is not a silent 0
        ("AUTO:/d:rw:-1G", "invalid_volume"),  # negative outside a delta
        ("AUTO:/d:rw:1G:x", "invalid_argument"),  # IO values are IO parameters
        ("AUTO:/d:rw:1G:-1", "invalid_argument"),
        ("AUTO:/d:rw:1G:0:0:0:1.5", "invalid_argument"),
        (42, "invalid_volume"),
    ],
)
def test_binding_errors(text, code):
    assert code_of(parse_binding, text, "volumes[0]") == code
    assert field_of(parse_binding, text, "volumes[0]") == "volumes[0]"


def test_delta_bindings_may_be_negative():
    binding = parse_binding("AUTO:/d:rw:-1G:-10", "v", delta=True)
    assert (binding.size, binding.io) == (-G, IO(-10))


@pytest.mark.parametrize(
    ("text", "schedule", "monopoly", "unlimited", "io"),
    [
        ("/src:/dst", False, False, False, False),
        ("/src:/dst:rw:0:10", False, False, False, True),
        ("AUTO:/d", True, False, True, False),
        ("AUTO:/d:rw:1G", True, False, False, False),
        ("AUTO:/d:rwm:1G", True, True, False, False),
        ("AUTO:/d:rw:0:0:0:1", True, False, False, True),
        ("/dev/AUTO:/d:rw:1", True, False, False, False),  # a source *ending* in AUTO
        (":/d", True, False, True, False),  # an empty source
        ("AUTO:/d:m", True, True, True, False),  # parses; requests reject it
    ],
)
def test_binding_predicates(text, schedule, monopoly, unlimited, io):
    binding = parse_binding(text, "v")
    assert binding.requires_schedule is schedule
    assert binding.monopoly is monopoly
    assert binding.unlimited is unlimited
    assert binding.requires_io is io
    assert binding.needs_planning is (schedule or io)


@pytest.mark.parametrize(
    "text", ["/a:/b", "AUTO:/d:mrw:10G", "AUTO:/d:or:1:2:3:4:5", ":/x:w:0", "AUTO:/d:orw:1G"]
)
def test_full_form_parses_back_to_the_same_binding(text):
    binding = parse_binding(text, "v")
    assert parse_binding(binding.full(), "v") == binding


@pytest.mark.parametrize(
    ("text", "engine"),
    [
        ("/src:/dst", "/src:/dst:rw:0"),
        ("AUTO:/d:rwm:1024", "AUTO:/d:rw:1024"),  # the monopoly flag is for the scheduler only
        ("/a:/b:ro", "/a:/b:ro:0"),
        ("/a:/b:orw:5", "/a:/b:rowo:5"),  # `o` spells out r and w as ro and wo
        ("/a:/b:m", "/a:/b"),  # no flags left and no size
        ("/a:/b:rw:1:2:3:4:5", "/a:/b:rw:1:2:3:4:5"),  # any IO value: the full form
    ],
)
def test_engine_form(text, engine):
    assert parse_binding(text, "v").engine_form() == engine


def test_merge_adds_by_key_and_drops_what_falls_below_zero():
    current = [parse_binding(t, "v") for t in ["AUTO:/a:rw:10", "AUTO:/b:rw:10", "/x:/c:rw:0:5"]]
    delta = [parse_binding(t, "v", delta=True) for t in ["AUTO:/a:rw:5:1", "AUTO:/b:rw:-11", "AUTO:/n:rw:3"]]
    merged = merge_bindings(delta, current)
    assert [b.full() for b in merged] == [
        "/x:/c:rw:0:5:0:0:0",
        "AUTO:/a:rw:15:1:0:0:0",
        "AUTO:/n:rw:3:0:0:0:0",
    ]


# --- disks ---------------------------------------------------------------------------------------------


def test_disk_string():
    disk = parse_disk("/dev/sda:/,/data0:100:200:1M:2M", "disks[0]")
    assert disk == Disk("/dev/sda", ["/", "/data0"], 100, 200, M, 2 * M)
    assert disk.render() == f"/dev/sda:/,/data0:100:200:{M}:{2 * M}"
    assert parse_disk("/dev/sda::1:1:1:1", "d").mounts == []


@pytest.mark.parametrize(
    "text",
    [
        "/dev/sda:/:1:1:1",
        ":/:1:1:1:1",
        "/dev/sda:/:1K:1:1:1",
        "/dev/sda:/:-1:1:1:1",
        "/dev/sda:/,,/x:1:1:1:1",
        7,
    ],
)
def test_disk_string_errors_are_invalid_argument(text):
    assert code_of(parse_disk, text, "disks[0]") == "invalid_argument"


def test_disk_for_path_prefers_the_deepest_mount():
    disks = [Disk("/dev/sda", ["/"]), Disk("/dev/sdb", ["/data1"]), Disk("/dev/sdc", ["/data1/deep/"])]
    assert disk_for_path(disks, "/data1").device == "/dev/sdb"  # the reference's example
    assert disk_for_path(disks, "/data0").device == "/dev/sda"  # falls back to /
    assert disk_for_path(disks, "/data1/deep/x").device == "/dev/sdc"
    assert disk_for_path(disks, "/data10").device == "/dev/sda"  # /data1 is no prefix of /data10/
    assert disk_for_path([Disk("/dev/sdb", ["/data1"])], "/data0") is None


# --- workload requests ---------------------------------------------------------------------------------


@pytest.fixture
def plugin() -> StoragePlugin:
    return StoragePlugin(max_deploy_count=100)


@pytest.fixture
def big(plugin):
    """Two idle volumes of 100G and 200G; / and /data0 on sda, /data1 on sdb; 50G of plain storage."""
    return node(
        plugin,
        volumes=["/data0:100G", "/data1:200G"],
        storage="50G",
        disks=["/dev/sda:/,/data0:1000:1000:100M:100M", "/dev/sdb:/data1:500:500:50M:50M"],
    )


def only_workload(plugin, capacity, usage, request):
    return plugin.calculate_deploy(capacity, usage, 1, request)[1][0]


@pytest.mark.parametrize("request_", [None, {}, {"volumes": []}])
def test_empty_request_deploys_anything_and_reports_max_deploy_count(plugin, big, request_):
    engines, workloads = plugin.calculate_deploy(*big, 3, request_)
    assert engines == [{"volumes": [], "volume_changed": False, "storage": 0, "iops_options": {}}] * 3
    assert workloads[0]["volume_plan_request"] == {} and workloads[0]["storage_request"] == 0
    assert plugin.deploy_capacity(*big, request_).capacity == 100


def test_limit_only_volumes_are_the_request_too(plugin, big):
    workload = only_workload(plugin, *big, {"volumes": ["AUTO:/d:rw:1G"]})
    assert workload["volumes_request"] == workload["volumes_limit"] == [f"AUTO:/d:rw:{G}:0:0:0:0"]


def test_request_without_limit_is_invalid(plugin, big):
    assert (
        code_of(plugin.calculate_deploy, *big, 1, {"volumes-request": ["AUTO:/d:rw:1G"]}) == "invalid_volume"
    )


def test_first_non_empty_key_wins(plugin, big):
    request = {
        "volumes-request": [],
        "volume-request": ["AUTO:/d:rw:1G"],
        "volumes": [],
        "volume": ["AUTO:/d:rw:2G"],
        "volume-limit": ["AUTO:/d:rw:3G"],
    }
    workload = only_workload(plugin, *big, request)
    assert workload["volumes_request"] == [f"AUTO:/d:rw:{G}:0:0:0:0"]
    assert workload["volumes_limit"] == [f"AUTO:/d:rw:{2 * G}:0:0:0:0"]


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [
        ({"volumes": ["AUTO:/d:m"]}, "invalid_volume", "workload_resource_request.volumes"),
        ({"volumes": ["AUTO:/d:rw:1G:-1"]}, "invalid_argument", "workload_resource_request.volumes[0]"),
        (
            {"volumes-request": ["AUTO:/a:rw:1G"], "volumes": ["AUTO:/b:rw:1G"]},
            "invalid_volume",
            "workload_resource_request.volumes",
        ),
        ({"volumes": ["AUTO:/d:rw:1G", "/x:/d"]}, "invalid_volume", "workload_resource_request.volumes"),
        (
            {"volume-request": ["AUTO:/d:m"], "volume": ["AUTO:/d:m"]},
            "invalid_volume",
            "workload_resource_request.volumes-request",
        ),
        ({"volumes": "AUTO:/d:rw:1G"}, "invalid_volume", "workload_resource_request.volumes"),
        # A quantity that does not parse, or is negative outside a delta: invalid_argument (DESIGN.md §2).
        ({"storage": "-1G"}, "invalid_argument", "workload_resource_request.storage"),
        ({"storage-request": "lots"}, "invalid_argument", "workload_resource_request.storage-request"),
        ({"storage-limit": True}, "invalid_argument", "workload_resource_request.storage-limit"),
        ({"storage": math.nan}, "invalid_argument", "workload_resource_request.storage"),
        ([], "invalid_argument", "workload_resource_request"),
    ],
)
def test_request_errors_name_the_field(plugin, big, request_, code, field):
    with pytest.raises(BerthError) as caught:
        plugin.calculate_deploy(*big, 1, request_)
    assert (caught.value.code, caught.value.field) == (code, field)


def test_limit_below_request_is_raised_to_it(plugin, big):
    request = {"volumes-request": ["AUTO:/d:rw:2G:10:20"], "volumes": ["AUTO:/d:rw:1G:5:30"]}
    workload = only_workload(plugin, *big, request)
    assert workload["volumes_limit"] == [f"AUTO:/d:rw:{2 * G}:10:30:0:0"]


def test_zero_size_limit_stays_zero(plugin, big):
    """eru raises a limit size only when both sizes are set: a 0 limit is left alone."""
    request = {"volumes-request": ["AUTO:/d:rw:2G"], "volumes": ["AUTO:/d:rw"]}
    workload = only_workload(plugin, *big, request)
    assert workload["volumes_limit"] == ["AUTO:/d:rw:0:0:0:0:0"]
    assert workload["volume_plan_limit"] == {"AUTO:/d:rw:0:0:0:0:0": {"/data0": 0}}


@pytest.mark.parametrize(
    ("request_", "storage_request", "storage_limit"),
    [
        ({"storage": "1G"}, G, G),
        ({"storage": G}, G, G),  # eru's CLI sends numbers; eru read them as 0, berth does not
        ({"storage-limit": "2G"}, 2 * G, 2 * G),  # only a limit: the request follows
        ({"storage-request": "3G", "storage-limit": "2G"}, 3 * G, 3 * G),  # request above limit
        ({"storage-request": "3G"}, 3 * G, 0),  # no limit: unlimited
        ({"storage": "1G", "storage-request": "5G"}, G, G),  # `storage` sets both
    ],
)
def test_storage_request_rules(plugin, big, request_, storage_request, storage_limit):
    workload = only_workload(plugin, *big, request_)
    assert (workload["storage_request"], workload["storage_limit"]) == (storage_request, storage_limit)


def test_volume_sizes_are_added_to_storage_once(plugin):
    """Issue #575: a 200G volume, --storage-limit 150G --volume-limit 100G asks for 250G of storage."""
    capacity, usage = node(plugin, volumes=["/data0:200G"], storage="300G")
    workload = only_workload(
        plugin, capacity, usage, {"storage-limit": "150G", "volumes": ["AUTO:/d:rw:100G"]}
    )
    assert (workload["storage_request"], workload["storage_limit"]) == (250 * G, 250 * G)


# --- node records --------------------------------------------------------------------------------------


def test_add_node_from_request(plugin, big):
    capacity, usage = big
    assert capacity["volumes"] == {"/data0": 100 * G, "/data1": 200 * G}
    assert capacity["storage"] == 350 * G  # the volume total is part of the storage budget (eru)
    assert [d["device"] for d in capacity["disks"]] == ["/dev/sda", "/dev/sdb"]
    assert usage["volumes"] == {"/data0": 0, "/data1": 0} and usage["storage"] == 0
    assert usage["disks"][0] == {
        "device": "/dev/sda",
        "mounts": ["/", "/data0"],
        "read_IOPS": 0,
        "write_IOPS": 0,
        "read_bps": 0,
        "write_bps": 0,
    }


def test_add_node_with_volumes_only_budgets_their_total(plugin):
    capacity, _ = node(plugin, volumes=["/data0:1G", "/data1:2G"])
    assert capacity["storage"] == 3 * G


def test_add_node_without_anything_is_empty(plugin):
    assert plugin.add_node(None, None) == (
        {"volumes": {}, "disks": [], "storage": 0},
        {"volumes": {}, "disks": [], "storage": 0},
    )


def test_add_node_takes_80_percent_of_the_engine_storage_total(plugin):
    capacity, _ = plugin.add_node(None, EngineInfo(storage_total=1000))
    assert capacity["storage"] == 800
    capacity, _ = plugin.add_node({"storage": 5}, EngineInfo(storage_total=1000))
    assert capacity["storage"] == 5  # a requested budget wins


def test_add_node_from_the_engine_storage_resource(plugin):
    engine = {"volumes": {"/data0": 100}, "disks": [{"device": "/dev/sda", "mounts": ["/"]}], "storage": 1000}
    capacity, usage = plugin.add_node(None, EngineInfo(storage_total=5, resources={"storage": engine}))
    assert capacity["volumes"] == {"/data0": 100} and capacity["storage"] == 800
    assert capacity["disks"][0]["device"] == "/dev/sda" and usage["volumes"] == {"/data0": 0}
    capacity, _ = plugin.add_node({"volumes": ["/data9:7"]}, EngineInfo(resources={"storage": engine}))
    assert capacity["volumes"] == {"/data9": 7}  # requested volumes win over the engine's


@pytest.mark.parametrize(
    ("resource", "info", "code"),
    [
        ({"volumes": ["/data0"]}, None, "invalid_volume"),
        ({"volumes": ["/data0:1G", "/data0:2G"]}, None, "invalid_volume"),
        ({"volumes": [":1G"]}, None, "invalid_volume"),
        ({"volumes": ["/data0:-1G"]}, None, "invalid_volume"),
        ({"storage": "-1"}, None, "invalid_argument"),
        ({"disks": ["/dev/sda:/:1:1:1"]}, None, "invalid_argument"),
        ({"disks": ["/dev/sda:/:1:1:1:1", "/dev/sda:/x:1:1:1:1"]}, None, "invalid_argument"),
        (None, EngineInfo(storage_total=-1), "invalid_argument"),
        (None, EngineInfo(resources={"storage": {"storage": "big"}}), "invalid_argument"),
    ],
)
def test_add_node_errors(plugin, resource, info, code):
    assert code_of(plugin.add_node, resource, info) == code


def test_validate_record_accepts_what_the_plugin_writes(plugin, big):
    plugin.validate_record(*big)
    _, _, usage = deploy(
        plugin, *big, 1, {"volumes": ["AUTO:/d:rw:1G:10", "AUTO:/m:rwm:1G"], "storage": "1G"}
    )
    plugin.validate_record(big[0], usage)


def test_validate_record_accepts_integral_floats_and_unused_foreign_devices(plugin):
    plugin.validate_record({"volumes": {"/a": 10.0}, "storage": 5.0}, {"volumes": {"/a": 1.0, "/gone": 0}})


@pytest.mark.parametrize(
    ("capacity", "usage", "code", "field"),
    [
        ({"volumes": {"/a": -1}}, {}, "invalid_volume", "capacity.volumes./a"),
        ({"volumes": {"/a": 1}}, {"volumes": {"/a": 2}}, "invalid_volume", "usage.volumes./a"),
        ({"volumes": {"/a": 1}}, {"volumes": {"/b": 1}}, "invalid_volume", "usage.volumes./b"),
        ({"storage": 1}, {"storage": 2}, "invalid_storage", "usage.storage"),
        ({"storage": -1}, {}, "invalid_storage", "capacity.storage"),
        ({"storage": 2**63}, {}, "invalid_storage", "capacity.storage"),
        ({"storage": math.nan}, {}, "invalid_argument", "capacity.storage"),
        ({"storage": True}, {}, "invalid_argument", "capacity.storage"),
        ({"volumes": {"/a": "1G"}}, {}, "invalid_argument", "capacity.volumes./a"),
        ({"disks": [{"mounts": []}]}, {}, "invalid_argument", "capacity.disks[0].device"),
        ({"disks": [{"device": "d", "read_IOPS": -1}]}, {}, "invalid_argument", "capacity.disks.d"),
        ({"disks": [{"device": "d"}, {"device": "d"}]}, {}, "invalid_argument", "capacity.disks.d"),
        (
            {"disks": [{"device": "d", "read_IOPS": 1}]},
            {"disks": [{"device": "d", "read_IOPS": 2}]},
            "invalid_argument",
            "usage.disks.d",
        ),
        ({}, {"disks": [{"device": "x", "read_bps": 1}]}, "invalid_argument", "usage.disks.x"),
        ("not a map", {}, "invalid_argument", "capacity"),
    ],
)
def test_validate_record_rejects(plugin, capacity, usage, code, field):
    with pytest.raises(BerthError) as caught:
        plugin.validate_record(capacity, usage)
    assert (caught.value.code, caught.value.field) == (code, field)


# --- volume plans and deploy ---------------------------------------------------------------------------


def used_node(plugin, sizes: dict[str, int], used: dict[str, int]):
    """A node with the given volumes (bytes) and per-volume usage, storage budget = volume total."""
    capacity, usage = node(plugin, volumes=[f"{d}:{s}" for d, s in sizes.items()])
    usage = plugin.set_usage(
        capacity, usage, {"volumes": used, "storage": sum(used.values())}, None, [], False, True
    )
    return capacity, usage


def devices(workloads, destination: str) -> list[str]:
    return [
        next(iter(placement))
        for workload in workloads
        for key, placement in workload["volume_plan_request"].items()
        if key.split(":")[1] == destination
    ]


def test_normal_bindings_fill_used_volumes_best_fit_first(plugin):
    capacity, usage = used_node(plugin, {"/a": 100, "/b": 100, "/c": 100}, {"/a": 70, "/b": 50})
    request = {"volumes": ["AUTO:/d:rw:20"]}
    # /a holds 1 more, /b 2; then the idle /c is handed over and holds 5: storage (180 free) would take 9
    assert plugin.deploy_capacity(capacity, usage, request).capacity == 8
    _, workloads = plugin.calculate_deploy(capacity, usage, 8, request)
    assert devices(workloads, "/d") == ["/a", "/b", "/b", "/c", "/c", "/c", "/c", "/c"]
    assert code_of(plugin.calculate_deploy, capacity, usage, 9, request) == "insufficient_resource"


def test_monopoly_bindings_take_a_whole_idle_volume_split_by_size(plugin):
    capacity, usage = used_node(plugin, {"/a": 101, "/b": 300, "/c": 10}, {"/c": 1})
    request = {"volumes": ["AUTO:/m2:rwm:30", "AUTO:/m1:rwm:10"]}
    assert plugin.deploy_capacity(capacity, usage, request).capacity == 2
    engines, workloads = plugin.calculate_deploy(capacity, usage, 2, request)
    assert workloads[0]["volume_plan_request"] == {
        "AUTO:/m1:mrw:10:0:0:0:0": {"/a": 26},  # 101 * 10/40 = 25, plus the remainder
        "AUTO:/m2:mrw:30:0:0:0:0": {"/a": 75},
    }
    assert workloads[1]["volume_plan_request"] == {
        "AUTO:/m1:mrw:10:0:0:0:0": {"/b": 75},
        "AUTO:/m2:mrw:30:0:0:0:0": {"/b": 225},
    }
    assert engines[0]["volumes"] == ["/a:/m1:rw:26", "/a:/m2:rw:75"]


def test_monopoly_and_normal_are_balanced_by_handing_idle_volumes_over(plugin):
    capacity, usage = used_node(plugin, {"/a": 100, "/b": 300, "/c": 50}, {})
    request = {"volumes": ["AUTO:/n:rw:10", "AUTO:/m:rwm:40"]}
    assert plugin.deploy_capacity(capacity, usage, request).capacity == 2
    _, workloads = plugin.calculate_deploy(capacity, usage, 2, request)
    assert devices(workloads, "/n") == ["/c", "/c"]
    assert devices(workloads, "/m") == ["/a", "/b"]


def test_unlimited_bindings_share_the_emptiest_volume_at_size_0(plugin):
    capacity, usage = used_node(plugin, {"/a": 100, "/b": 100}, {"/a": 50})
    request = {"volumes": ["AUTO:/u"]}
    assert plugin.deploy_capacity(capacity, usage, request).capacity == 100  # max_deploy_count
    engines, workloads = plugin.calculate_deploy(capacity, usage, 2, request)
    assert workloads[1]["volume_plan_request"] == {"AUTO:/u:rw:0:0:0:0:0": {"/b": 0}}
    assert engines[0]["volumes"] == ["/b:/u:rw:0"]
    assert code_of(plugin.calculate_deploy, capacity, usage, 101, request) == "insufficient_resource"


def test_auto_volumes_on_a_node_without_volumes_do_not_fit(plugin):
    capacity, usage = node(plugin, storage="1T")
    for volume in ["AUTO:/u", "AUTO:/n:rw:1", "AUTO:/m:rwm:1"]:
        assert plugin.deploy_capacity(capacity, usage, {"volumes": [volume]}).capacity == 0
        assert (
            code_of(plugin.calculate_deploy, capacity, usage, 1, {"volumes": [volume]})
            == "insufficient_resource"
        )


def test_mount_iops_are_charged_to_the_disk_of_the_path(plugin, big):
    request = {"volumes": ["/data0/logs:/logs:rw:0:100"]}
    assert plugin.deploy_capacity(*big, request).capacity == 10  # 1000 read IOPS on sda
    engines, workloads, usage = deploy(plugin, *big, 10, request)
    assert engines[0]["iops_options"] == {"/dev/sda": "100:0:0:0"}
    assert engines[0]["volumes"] == ["/data0/logs:/logs:rw:0:100:0:0:0"]
    assert (
        workloads[0]["disks_request"]
        == workloads[0]["disks_limit"]
        == [
            {
                "device": "/dev/sda",
                "mounts": ["/", "/data0"],
                "read_IOPS": 100,
                "write_IOPS": 0,
                "read_bps": 0,
                "write_bps": 0,
            }
        ]
    )
    assert usage["disks"][0]["read_IOPS"] == 1000
    assert code_of(plugin.calculate_deploy, *big, 11, request) == "insufficient_resource"


def test_mount_iops_need_a_disk(plugin):
    capacity, usage = node(plugin, volumes=["/data0:1G"])
    assert plugin.deploy_capacity(capacity, usage, {"volumes": ["/x:/y:rw:0:1"]}).capacity == 0
    assert plugin.deploy_capacity(capacity, usage, {"volumes": ["/x:/y"]}).capacity == 100  # no IO: no disk


def test_normal_iops_limit_plans_per_disk(plugin, big):
    request = {"volumes": ["AUTO:/d:rw:1G:100"]}
    # /data0 (sda, 1000 read IOPS) takes 10, then /data1 (sdb, 500) takes 5
    assert plugin.deploy_capacity(*big, request).capacity == 15


def test_limit_side_of_a_deploy(plugin, big):
    request = {
        "volumes-request": ["AUTO:/d:rw:1G:10"],
        "volumes": ["AUTO:/d:rw:3G:30"],
        "storage-limit": "1G",
    }
    engines, workloads = plugin.calculate_deploy(*big, 1, request)
    workload = workloads[0]
    assert workload["volume_plan_request"] == {f"AUTO:/d:rw:{G}:10:0:0:0": {"/data0": G}}
    assert workload["volume_plan_limit"] == {f"AUTO:/d:rw:{3 * G}:30:0:0:0": {"/data0": 3 * G}}
    assert workload["disks_request"][0]["read_IOPS"] == 10 and workload["disks_limit"][0]["read_IOPS"] == 30
    assert (workload["storage_request"], workload["storage_limit"]) == (2 * G, 4 * G)
    assert engines[0] == {
        "volumes": [f"/data0:/d:rw:{3 * G}:30:0:0:0"],
        "volume_changed": False,
        "storage": 4 * G,
        "iops_options": {"/dev/sda": "30:0:0:0"},
    }


def test_storage_only_requests(plugin):
    capacity, usage = node(plugin, storage="1000G")
    assert plugin.deploy_capacity(capacity, usage, {"storage": "1G"}).capacity == 1000  # not capped
    plugin.calculate_deploy(capacity, usage, 1000, {"storage": "1G"})
    assert (
        code_of(plugin.calculate_deploy, capacity, usage, 1001, {"storage": "1G"}) == "insufficient_resource"
    )
    # with mount volumes the plan count (max_deploy_count) caps it too
    assert plugin.deploy_capacity(capacity, usage, {"storage": "1G", "volumes": ["/a:/b"]}).capacity == 100


def test_max_deploy_count_caps_volume_plans():
    plugin = StoragePlugin(max_deploy_count=5)
    capacity, usage = node(plugin, volumes=["/data0:1T"])
    assert plugin.deploy_capacity(capacity, usage, {"volumes": ["AUTO:/d:rw:1"]}).capacity == 5


@pytest.mark.parametrize("count", [-1, True, 1.0, "2"])
def test_deploy_count_must_be_a_non_negative_integer(plugin, big, count):
    assert field_of(plugin.calculate_deploy, *big, count, None) == "deploy_count"


def test_deploy_capacity_usage_and_rate(plugin):
    capacity, usage = used_node(plugin, {"/a": 100, "/b": 300}, {"/a": 100})
    with_volumes = plugin.deploy_capacity(capacity, usage, {"volumes": ["AUTO:/d:rw:40"], "storage": 10})
    assert (with_volumes.usage, with_volumes.rate, with_volumes.weight) == (0.25, 0.1, 1.0)
    storage_only = plugin.deploy_capacity(capacity, usage, {"storage": 40})
    assert (storage_only.usage, storage_only.rate) == (0.25, 0.1)
    empty = plugin.deploy_capacity(*node(plugin), {"storage": 1})
    assert (empty.capacity, empty.usage, empty.rate) == (0, 0.0, 0.0)


# --- realloc -------------------------------------------------------------------------------------------


@pytest.fixture
def deployed(plugin, big):
    """(capacity, usage, workload) after one workload with a 10G volume on /data0 and 1G of storage."""
    _, workloads, usage = deploy(plugin, *big, 1, {"volumes": ["AUTO:/d:rw:10G:10"], "storage": "1G"})
    return big[0], usage, workloads[0]


def realloc(plugin, capacity, usage, workload, request):
    engine, delta, new = plugin.calculate_realloc(capacity, usage, workload, request)
    after = plugin.apply_workloads(usage, [delta], True)
    # The delta accounts exactly: the node now holds what the new workload holds.
    assert after == plugin.usage_from_workloads(capacity, [new])
    return engine, delta, new


def test_realloc_grows_a_volume_on_its_device(plugin, deployed):
    engine, delta, new = realloc(plugin, *deployed, {"volumes": ["AUTO:/d:rw:5G"]})
    assert new["volume_plan_request"] == {f"AUTO:/d:rw:{15 * G}:10:0:0:0": {"/data0": 15 * G}}
    assert new["storage_request"] == 16 * G
    assert engine["volumes"] == [f"/data0:/d:rw:{15 * G}:10:0:0:0"] and engine["volume_changed"] is False
    assert delta == {
        "volumes_request": [],
        "volumes_limit": [],
        "volume_plan_request": {"fake-source:fake-destination:fake-flags:0:0:0:0:0": {"/data0": 5 * G}},
        "volume_plan_limit": {},
        "storage_request": 5 * G,
        "storage_limit": 0,
        "disks_request": [],
        "disks_limit": [],
    }


def test_realloc_keeps_the_device_even_when_another_has_room(plugin, deployed):
    with pytest.raises(BerthError) as caught:
        plugin.calculate_realloc(*deployed, {"volumes": ["AUTO:/d:rw:95G"]})
    assert caught.value.code == "insufficient_resource"


def test_realloc_schedules_a_new_binding(plugin, deployed):
    engine, delta, new = realloc(plugin, *deployed, {"volumes": ["AUTO:/e:rw:1G:0:5"]})
    assert new["volume_plan_request"][f"AUTO:/e:rw:{G}:0:5:0:0"] == {"/data0": G}
    assert engine["volume_changed"] is True
    assert delta["disks_request"][0]["write_IOPS"] == 5 and delta["storage_request"] == G


def test_realloc_to_size_0_leaves_an_unlimited_binding(plugin, deployed):
    """eru drops a binding only when the delta takes it below 0; at exactly 0 it turns unlimited."""
    _, delta, new = realloc(plugin, *deployed, {"volumes": ["AUTO:/d:rw:-10G:-10"]})
    assert new["volume_plan_request"] == {"AUTO:/d:rw:0:0:0:0:0": {"/data0": 0}}
    assert delta["volume_plan_request"]["fake-source:fake-destination:fake-flags:0:0:0:0:0"] == {
        "/data0": -10 * G
    }
    assert delta["disks_request"][0]["read_IOPS"] == -10


def test_realloc_without_volumes_keeps_plan_and_io(plugin, deployed):
    engine, delta, new = realloc(plugin, *deployed, {"storage": "1G"})
    assert new["disks_request"] == deployed[2]["disks_request"]  # eru would drop the IO charge here
    assert new["volume_plan_request"] == deployed[2]["volume_plan_request"]
    assert (
        engine["volume_changed"] is False and delta["disks_request"] == [] and delta["storage_request"] == G
    )


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        ({"storage": "400G"}, "insufficient_resource"),
        ({"storage": "-12G"}, "invalid_storage"),  # below 0 once added to the current 11G
        ({"volumes": ["AUTO:/d:rw:0:-11"]}, "invalid_argument"),  # IO below 0
        ({"volumes": ["/x:/d"]}, "invalid_volume"),  # a second volume at /d
        ({"volumes": "AUTO:/d"}, "invalid_volume"),
    ],
)
def test_realloc_errors(plugin, deployed, request_, code):
    assert code_of(plugin.calculate_realloc, *deployed, request_) == code


def test_realloc_of_a_workload_that_does_not_match_the_node(plugin, deployed):
    capacity, usage, workload = deployed
    foreign = {**workload, "volume_plan_request": {f"AUTO:/d:rw:{10 * G}:10:0:0:0": {"/elsewhere": 1}}}
    assert (
        code_of(plugin.calculate_realloc, capacity, usage, foreign, {"volumes": ["AUTO:/d:rw:1"]})
        == "invalid_volume"
    )
    fresh_usage = plugin.usage_from_workloads(capacity, [])
    assert (
        code_of(plugin.calculate_realloc, capacity, fresh_usage, workload, {"volumes": ["AUTO:/d:rw:1"]})
        == "invalid_volume"
    )


def test_realloc_monopoly_group_stays_on_its_device_within_what_it_had(plugin):
    capacity, usage = used_node(plugin, {"/a": 100, "/b": 300}, {})
    _, workloads, usage = deploy(plugin, capacity, usage, 1, {"volumes": ["AUTO:/m:rwm:40"]})
    _, _, new = realloc(plugin, capacity, usage, workloads[0], {"volumes": ["AUTO:/m2:rwm:10"]})
    assert new["volume_plan_request"] == {
        "AUTO:/m2:mrw:10:0:0:0:0": {"/a": 20},
        "AUTO:/m:mrw:40:0:0:0:0": {"/a": 80},
    }
    assert code_of(
        plugin.calculate_realloc, capacity, usage, workloads[0], {"volumes": ["AUTO:/m:rwm:61"]}
    ) == ("insufficient_resource")


def test_realloc_reschedules_a_monopoly_group_that_had_no_device(plugin):
    capacity, usage = used_node(plugin, {"/a": 100, "/b": 300}, {})
    _, workloads, usage = deploy(plugin, capacity, usage, 1, {"volumes": ["AUTO:/n:rw:10"]})
    engine, _, new = realloc(plugin, capacity, usage, workloads[0], {"volumes": ["AUTO:/m:rwm:40"]})
    assert new["volume_plan_request"]["AUTO:/m:mrw:40:0:0:0:0"] == {"/b": 300}
    assert engine["volume_changed"] is True


def test_remap_never_changes_volumes(plugin, deployed):
    assert plugin.calculate_remap(deployed[0], deployed[1], {"w1": deployed[2]}) == {}


# --- node operations -----------------------------------------------------------------------------------


def test_absolute_capacity_request_keeps_what_it_leaves_out(plugin, big):
    capacity, usage = plugin.set_capacity(*big, None, {"volumes": ["/data2:10G"]}, False, True)
    assert capacity["volumes"] == {"/data2": 10 * G}
    assert capacity["storage"] == 60 * G  # the non-volume 50G stays, the volume part follows the volumes
    assert capacity["disks"] == big[0]["disks"]
    assert usage["volumes"] == {"/data2": 0}  # gone volumes leave usage, new ones join it at 0
    capacity, _ = plugin.set_capacity(*big, None, {"storage": "10G"}, False, True)
    assert capacity["storage"] == 10 * G and capacity["volumes"] == big[0]["volumes"]


def test_absolute_update_ignores_incr(plugin, big):
    request = {"storage": "10G"}
    assert plugin.set_capacity(*big, None, request, False, False) == plugin.set_capacity(
        *big, None, request, False, True
    )


def test_delta_capacity_request(plugin, big):
    request = {"volumes": ["/data2:10G"], "storage": "1G", "disks": ["/dev/sda::100:0:0:0"]}
    capacity, usage = plugin.set_capacity(*big, None, request, True, True)
    assert capacity["volumes"] == {"/data0": 100 * G, "/data1": 200 * G, "/data2": 10 * G}
    assert capacity["storage"] == 361 * G
    assert capacity["disks"][0]["read_IOPS"] == 1100 and capacity["disks"][0]["mounts"] == ["/", "/data0"]
    assert usage["volumes"]["/data2"] == 0
    back, _ = plugin.set_capacity(capacity, usage, None, request, True, False)
    assert back == big[0]


def test_delta_that_empties_a_volume_removes_it(plugin, big):
    capacity, usage = plugin.set_capacity(*big, None, {"volumes": ["/data0:-100G"]}, True, True)
    assert capacity["volumes"] == {"/data1": 200 * G} and capacity["storage"] == 250 * G
    assert usage["volumes"] == {"/data1": 0}


def test_rm_disks(plugin, big):
    capacity, usage = plugin.set_capacity(*big, None, {"rm-disks": "/dev/sdb,/dev/none"}, False, True)
    assert [d["device"] for d in capacity["disks"]] == ["/dev/sda"]
    assert [d["device"] for d in usage["disks"]] == ["/dev/sda"]
    assert field_of(plugin.set_capacity, *big, None, {"rm-disks": "/dev/sdb"}, True, True) == (
        "resource_request.rm-disks"
    )
    _, _, used = deploy(plugin, *big, 1, {"volumes": ["/data1/x:/x:rw:0:1"]})
    assert code_of(plugin.set_capacity, big[0], used, None, {"rm-disks": "/dev/sdb"}, False, True) == (
        "invalid_argument"
    )


def test_capacity_cannot_drop_below_usage(plugin, deployed):
    capacity, usage, _ = deployed
    assert code_of(plugin.set_capacity, capacity, usage, None, {"volumes": ["/data0:-95G"]}, True, True) == (
        "invalid_volume"
    )
    assert (
        code_of(plugin.set_capacity, capacity, usage, None, {"storage": "1G"}, False, True)
        == "invalid_storage"
    )
    assert (
        code_of(plugin.set_capacity, capacity, usage, None, {"storage": "345G"}, True, False)
        == "invalid_storage"
    )


def test_capacity_rollback_with_before_is_exact(plugin, deployed):
    """Core rolls a failed multi-plugin update back with `before` as an absolute write (eru §5.3)."""
    before, usage, _ = deployed
    changes = [
        ({"volumes": ["/data9:1"], "disks": ["/dev/sdz:/z:1:1:1:1"]}, True),
        ({"storage": "1T", "rm-disks": "/dev/sdb"}, False),
        ({"volumes": ["/data0:10G"]}, False),
    ]
    for request, delta in changes:
        after, after_usage = plugin.set_capacity(before, usage, None, request, delta, True)
        assert after != before
        # as a resource, and as a request in the stored shape: both restore byte for byte
        assert plugin.set_capacity(after, after_usage, before, None, False, False) == (before, usage)
        assert plugin.set_capacity(after, after_usage, None, before, False, False) == (before, usage)


def test_capacity_without_any_source(plugin, big):
    assert plugin.set_capacity(*big, None, None, True, True) == big  # a delta of nothing
    assert plugin.set_capacity(*big, None, None, False, True)[0] == {"volumes": {}, "disks": [], "storage": 0}


@pytest.mark.parametrize(("delta", "incr"), [(1, True), (True, None)])
def test_flags_must_be_booleans(plugin, big, delta, incr):
    assert code_of(plugin.set_capacity, *big, None, {}, delta, incr) == "invalid_argument"


def test_usage_matrix_and_source_priority(plugin, deployed):
    capacity, usage, workload = deployed
    empty = plugin.usage_from_workloads(capacity, [])
    # workloads: delta incr commits, delta decr releases, absolute rewrites from them
    assert plugin.set_usage(capacity, empty, None, None, [workload], True, True) == usage
    assert plugin.set_usage(capacity, usage, None, None, [workload], True, False) == empty
    assert plugin.set_usage(capacity, usage, None, None, [workload], False, False) == usage
    # a resource beats the workloads; a request beats both (its volume total joins its storage)
    assert plugin.set_usage(capacity, usage, empty, None, [workload], False, True) == empty
    request = {"volumes": ["/data1:1G"], "storage": "1G"}
    after = plugin.set_usage(capacity, usage, empty, request, [workload], False, True)
    assert (after["volumes"], after["storage"]) == ({"/data0": 0, "/data1": G}, 2 * G)
    after = plugin.set_usage(capacity, usage, None, {"volumes": ["/data0:-1G"]}, [], True, True)
    assert after["volumes"]["/data0"] == 9 * G and after["storage"] == 10 * G


def test_usage_cannot_go_below_zero_or_above_capacity(plugin, deployed):
    capacity, _, workload = deployed
    empty = plugin.usage_from_workloads(capacity, [])
    assert code_of(plugin.set_usage, capacity, empty, None, None, [workload], True, False) == "invalid_volume"
    assert code_of(plugin.apply_workloads, empty, [workload], False) == "invalid_volume"
    huge = {"volumes": ["/data0:101G"]}
    assert code_of(plugin.set_usage, capacity, empty, None, huge, [], False, True) == "invalid_volume"


def test_apply_workloads_then_release_is_exact(plugin, deployed):
    _, usage, workload = deployed
    twice = plugin.apply_workloads(usage, [workload, workload], True)
    assert plugin.apply_workloads(twice, [workload, workload], False) == usage
    assert field_of(plugin.apply_workloads, usage, [{"storage_request": "1G"}], True) == (
        "workloads_resource[0].storage_request"
    )


def error_of(call, *args) -> tuple[str, str | None, str]:
    with pytest.raises(BerthError) as caught:
        call(*args)
    return caught.value.code, caught.value.field, caught.value.message


def test_apply_workloads_pins_errors_and_leaves_usage_alone_without_workloads(plugin):
    """The shared kit's apply_workloads, pinned: the message when usage would go negative, workloads decoded
    before the usage, and no workloads leaving the usage as stored (disk order kept, duplicates refused)."""
    assert error_of(plugin.apply_workloads, {"storage": 5}, [{"storage_request": 6}], False) == (
        "invalid_storage", "usage.storage", f"usage.storage: must be in [0, {MAX_INT}], got -1"
    )
    assert error_of(plugin.apply_workloads, "bad", ["bad"], True)[1] == "workloads_resource[0]"
    assert error_of(plugin.apply_workloads, {}, [], 1)[1] == "incr"
    after = plugin.apply_workloads({"disks": [{"device": "/b"}, {"device": "/a"}]}, [], True)
    assert [disk["device"] for disk in after["disks"]] == ["/b", "/a"]
    assert error_of(plugin.apply_workloads, {"disks": [{"device": "/a"}, {"device": "/a"}]}, [], True) == (
        "invalid_argument", "usage.disks./a", "usage.disks./a: each disk needs a device name, used once"
    )


def test_usage_from_workloads_reads_the_capacity_first(plugin):
    assert error_of(plugin.usage_from_workloads, "bad", ["bad"])[1] == "capacity"


def test_diffs_in_eru_order(plugin, deployed):
    capacity, usage, workload = deployed
    assert plugin.diffs(capacity, usage, [workload]) == []
    assert plugin.diffs(capacity, usage, []) == [
        f"node.Storage != sum(workload.Storage): {11 * G} != 0",
        f"node.Volumes[/data0] != sum(workload.Volumes[/data0]): {10 * G} != 0",
        "node.Disks[/dev/sda] != sum(workload.Disks[/dev/sda]): "
        "/dev/sda:/,/data0:10:0:0:0 != /dev/sda:/,/data0:0:0:0:0",
    ]
    stray = {"volume_plan_request": {"AUTO:/x:rw:1:0:0:0:0": {"/data9": 1}}}
    assert plugin.diffs(capacity, plugin.usage_from_workloads(capacity, []), [stray]) == [
        "node.Volumes[/data9] != sum(workload.Volumes[/data9]): 0 != 1"
    ]


def test_usage_from_workloads_lists_every_volume_and_disk(plugin, deployed):
    capacity, usage, workload = deployed
    assert plugin.usage_from_workloads(capacity, [workload]) == usage
    assert plugin.usage_from_workloads(capacity, [])["volumes"] == {"/data0": 0, "/data1": 0}


def test_load_is_the_share_of_the_storage_budget_in_use(plugin, deployed):
    assert plugin.load(*deployed[:2]) == pytest.approx(11 / 350)
    assert plugin.load(*node(plugin)) == 0.0


def test_metrics(plugin, deployed):
    assert plugin.metrics_description() == [
        {
            "name": "storage_used",
            "help": "node used storage.",
            "type": "gauge",
            "labels": ["podname", "nodename"],
        },
        {
            "name": "storage_capacity",
            "help": "node available storage.",
            "type": "gauge",
            "labels": ["podname", "nodename"],
        },
    ]
    assert plugin.metrics("pod", "node.1", *deployed[:2]) == [
        {
            "name": "storage_used",
            "labels": ["pod", "node.1"],
            "key": "core.node.node_1.storage.used",
            "value": 11 * G,
        },
        {
            "name": "storage_capacity",
            "labels": ["pod", "node.1"],
            "key": "core.node.node_1.storage.capacity",
            "value": 350 * G,
        },
    ]


def test_plugin_identity():
    plugin = StoragePlugin()
    assert (plugin.name, plugin.priority, plugin.max_deploy_count) == ("storage", 1, 10000)
    with pytest.raises(BerthError):
        StoragePlugin(max_deploy_count=0)
