"""Typos are never silent (DESIGN.md §8, pinned for the next work), and errors speak to people.

"Unknown keys inside a plugin's maps (`workload_resource_request`, `resource`, `capacity`, `usage`,
node `info.resources`) are `invalid_argument` naming the key, with the accepted keys in the message".
Stored records and ledgers stay lenient (old data may carry keys no longer read). The wire-level
checks (manager paths, nothing changed, no node created) are in tests/contract/test_contract_allocation.py.
"""

from __future__ import annotations

import pytest

from schemas.errors import BerthError
from services.allocation.plugins.cpumem import CpuMemPlugin
from services.allocation.plugins.gpu import GpuPlugin
from services.allocation.plugins.interface import EngineInfo
from services.allocation.plugins.storage import StoragePlugin

GiB = 1 << 30
WRR = "workload_resource_request"
CPUMEM_REQUEST_KEYS = "cpu-bind, cpu-limit, cpu-request, keep-cpu-bind, memory-limit, memory-request"
STORAGE_REQUEST_KEYS = (
    "storage, storage-limit, storage-request, volume, volume-limit, volume-request, volumes, volumes-limit, "
    "volumes-request"
)


def refused(call, *args) -> BerthError:
    with pytest.raises(BerthError) as caught:
        call(*args)
    return caught.value


def counts(error: BerthError) -> tuple:
    return error.details["requested"], error.details["available"], error.details["unit"]


def assert_unknown(error: BerthError, field: str, accepted: str) -> None:
    key = field.rsplit(".", 1)[-1]
    assert (error.code, error.field) == ("invalid_argument", field)
    assert error.message == f"{field}: unknown key {key!r}; accepted: {accepted}"
    assert error.details["accepted"] == accepted.split(", ")


@pytest.fixture
def cpumem():
    plugin = CpuMemPlugin()
    return plugin, *plugin.add_node({"cpu": 4, "memory": "8G"}, None)


@pytest.fixture
def storage():
    plugin = StoragePlugin(max_deploy_count=100)
    return plugin, *plugin.add_node({"volumes": ["/data:100G"], "storage": "50G"}, None)


@pytest.fixture
def gpu():
    plugin = GpuPlugin()
    return plugin, *plugin.add_node({"prod_count_map": {"a100": 2}}, None)


# -- workload requests ------------------------------------------------------------------------------


def test_cpumem_request_typo_places_nothing(cpumem):
    plugin, capacity, usage = cpumem
    error = refused(plugin.calculate_deploy, capacity, usage, 1, {"cpu_request": 1})
    assert_unknown(error, f"{WRR}.cpu_request", CPUMEM_REQUEST_KEYS)
    error = refused(plugin.deploy_capacity, capacity, usage, {"cpu": 1})
    assert_unknown(error, f"{WRR}.cpu", CPUMEM_REQUEST_KEYS)


def test_cpumem_request_accepts_every_key_it_reads(cpumem):
    plugin, capacity, usage = cpumem
    request = {"cpu-bind": False, "keep-cpu-bind": False, "cpu-request": 1, "cpu-limit": 2,
               "memory-request": GiB, "memory-limit": GiB}
    assert plugin.calculate_deploy(capacity, usage, 1, request)[1][0]["cpu_request"] == 1


def test_cpumem_realloc_request_typo(cpumem):
    plugin, capacity, usage = cpumem
    _, [workload] = plugin.calculate_deploy(capacity, usage, 1, {"cpu-request": 1})
    error = refused(plugin.calculate_realloc, capacity, usage, workload, {"keep_cpu_bind": True})
    assert_unknown(error, f"{WRR}.keep_cpu_bind", CPUMEM_REQUEST_KEYS)


def test_storage_request_typo_and_every_alias_accepted(storage):
    plugin, capacity, usage = storage
    error = refused(plugin.calculate_deploy, capacity, usage, 1, {"volumes_request": ["AUTO:/v:rw:1G"]})
    assert_unknown(error, f"{WRR}.volumes_request", STORAGE_REQUEST_KEYS)
    binding = ["AUTO:/v:rw:1G"]
    for limit in ("volumes", "volume", "volume-limit", "volumes-limit"):
        for request in ("volumes-request", "volume-request"):
            plugin.calculate_deploy(capacity, usage, 1, {request: binding, limit: binding})
        plugin.calculate_deploy(capacity, usage, 1, {limit: binding})
    budget = {"storage": "1G", "storage-request": "1G", "storage-limit": "1G"}
    plugin.calculate_deploy(capacity, usage, 1, budget)


def test_gpu_request_typo(gpu):
    plugin, capacity, usage = gpu
    error = refused(plugin.calculate_deploy, capacity, usage, 1, {"prod_count": {"a100": 1}})
    assert_unknown(error, f"{WRR}.prod_count", "prod_count_map")
    assert_unknown(refused(plugin.deploy_capacity, capacity, usage, {"x": 1}), f"{WRR}.x", "prod_count_map")


# -- node requests, engine info and client-given records ----------------------------------------------


def test_cpumem_node_request_typo_registers_nothing():
    plugin = CpuMemPlugin()
    error = refused(plugin.add_node, {"cpu": 4, "memroy": "8G"}, None)
    assert_unknown(error, "resource.memroy", "cpu, memory, numa-cpu, numa-memory, share")
    # A snapshot (a map with `cpu_map`) is checked against the stored shape's keys, nested maps too.
    error = refused(plugin.add_node, {"cpu": 1, "cpu_map": {"0": 100}, "numa-cpu": ["0"]}, None)
    assert_unknown(error, "resource.numa-cpu", "cpu, cpu_map, memory, numa, numa_memory")
    every_key = {"cpu": 2, "share": 50, "memory": "1G", "numa-cpu": ["0", "1"], "numa-memory": ["1", "1"]}
    plugin.add_node(every_key, None)


def test_engine_info_resources_typo():
    info = EngineInfo(ncpu=2, memory_total=GiB, resources={"cpumem": {"cpu": 2, "memroy": GiB}})
    assert_unknown(
        refused(CpuMemPlugin().add_node, None, info), "info.resources.cpumem.memroy",
        "cpu, cpu_map, memory, numa, numa_memory",
    )
    disks = [{"device": "a", "read_iops": 1}]
    info = EngineInfo(resources={"storage": {"volumes": {"/d": GiB}, "disks": disks}})
    assert_unknown(
        refused(StoragePlugin().add_node, None, info), "info.resources.storage.disks[0].read_iops",
        "device, mounts, read_IOPS, read_bps, write_IOPS, write_bps",
    )
    info = EngineInfo(resources={"gpu": {"prod_count_map": {"a100": 1}, "count": 1}})
    assert_unknown(refused(GpuPlugin().add_node, None, info), "info.resources.gpu.count", "prod_count_map")


def test_set_capacity_typos(cpumem, storage, gpu):
    plugin, capacity, usage = cpumem
    error = refused(plugin.set_capacity, capacity, usage, None, {"cpus": 8}, False, True)
    assert_unknown(error, "resource_request.cpus", "cpu, memory, numa-cpu, numa-memory, share")
    error = refused(plugin.set_capacity, capacity, usage, {**capacity, "mem": 1}, None, False, True)
    assert_unknown(error, "resource.mem", "cpu, cpu_map, memory, numa, numa_memory")
    plugin, capacity, usage = storage
    error = refused(plugin.set_capacity, capacity, usage, None, {"rm_disks": "a"}, False, True)
    assert_unknown(error, "resource_request.rm_disks", "disks, rm-disks, storage, volumes")
    error = refused(plugin.set_capacity, capacity, usage, {"storage": 1, "volume": {}}, None, False, True)
    assert_unknown(error, "resource.volume", "disks, storage, volumes")
    plugin, capacity, usage = gpu
    error = refused(plugin.set_usage, capacity, usage, None, {"prod_count_mapp": {}}, [], False, True)
    assert_unknown(error, "resource_request.prod_count_mapp", "prod_count_map")


def test_set_info_records_are_checked_for_typos(cpumem, storage, gpu):
    for plugin, capacity, usage in (cpumem, storage, gpu):
        plugin.validate_record(capacity, usage)
        error = refused(plugin.validate_record, capacity, {**usage, "typo": 1})
        assert (error.code, error.field) == ("invalid_argument", "usage.typo")
        assert "unknown key 'typo'; accepted: " in error.message


def test_stored_records_and_ledgers_stay_lenient(cpumem, storage, gpu):
    """Old data may carry keys no longer read: what was stored is never refused for them."""
    for plugin, capacity, usage in (cpumem, storage, gpu):
        _, [workload] = plugin.calculate_deploy({**capacity, "old": 1}, {**usage, "old": 1}, 1, None)
        plugin.apply_workloads(usage, [{**workload, "old": 1}], True)
        plugin.diffs(capacity, usage, [{**workload, "old": 1}])


def test_client_workload_resources_are_checked_for_typos(cpumem):
    plugin, capacity, usage = cpumem
    plugin.check_workload_keys({"cpu_request": 1, "cpu_map": {}}, "workloads_resource[0]")
    error = refused(plugin.check_workload_keys, {"cpu_requests": 1}, "workloads_resource[0]")
    assert error.field == "workloads_resource[0].cpu_requests"
    accepted = "cpu_limit, cpu_map, cpu_request, memory_limit, memory_request, numa_memory, numa_node"
    assert f"accepted: {accepted}" in error.message


# -- messages for people ----------------------------------------------------------------------------


def test_pattern_errors_say_the_form_in_words(storage):
    error = refused(CpuMemPlugin().add_node, {"cpu": "0:100,eight"}, None)
    assert error.message == "resource.cpu: 'eight' should be '<cpu id>:<pieces>', such as '3:100'"
    error = refused(CpuMemPlugin().add_node, {"cpu": "a:100"}, None)
    assert "'a' should be a whole number such as '0' or '17'" in error.message
    error = refused(StoragePlugin().add_node, {"volumes": ["/data"]}, None)
    assert error.message == "resource.volumes[0]: '/data' should be '<device>:<size>', such as '/data:100G'"
    error = refused(StoragePlugin().add_node, {"disks": ["/dev/sda"]}, None)
    assert "'/dev/sda' should be '<device>:<mount points, comma-separated>:<read IOPS>" in error.message
    plugin, capacity, usage = storage
    error = refused(plugin.calculate_deploy, capacity, usage, 1, {"volumes": ["nothing"]})
    assert "'nothing' should be '<source>:<destination>'" in error.message


def test_capacity_errors_state_their_unit(cpumem, storage, gpu):
    plugin, capacity, usage = cpumem
    error = refused(plugin.calculate_deploy, capacity, usage, 3, {"memory-request": "3G"})
    assert error.code == "insufficient_capacity"
    assert error.details == {
        "plugin": "cpumem", "resource": "memory", "requested": 3, "available": 2, "unit": "instances",
        "memory_request": 3 * GiB, "memory_free": 8 * GiB,
    }
    assert error.message.endswith(
        f"3 instances wanted, room for 2 ({3 * GiB} bytes each, {8 * GiB} bytes free)"
    )
    error = refused(plugin.calculate_deploy, capacity, usage, 1, {"cpu-request": 6})
    assert counts(error) == (6, 4, "cores")
    assert error.message.endswith("6 cores wanted by one instance, the node has 4")
    error = refused(plugin.calculate_deploy, capacity, usage, 5, {"cpu-bind": True, "cpu-request": 1})
    assert counts(error) == (5, 4, "instances")
    plugin, capacity, usage = storage
    error = refused(plugin.calculate_deploy, capacity, usage, 3, {"storage": "60G"})  # 150G in all
    assert counts(error) == (3, 2, "instances")
    plugin, capacity, usage = gpu
    error = refused(plugin.calculate_deploy, capacity, usage, 3, {"prod_count_map": {"a100": 1}})
    assert error.details == {"product": "a100", "requested": 3, "available": 2, "unit": "cards"}
    assert error.message == "not enough a100: 3 cards wanted, 2 free"
