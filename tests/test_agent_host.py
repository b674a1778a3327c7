"""services/agent/host.py: reading fake and real host trees, and the node request the real plugins store."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.agent.host import Host, HostUnreadable, describe, node_resource, read_host
from services.allocation.plugins.plugin_set import PluginSet
from services.allocation.worker import make_plugins
from services.metrics.parsers import parse_cpulist
from tests.agent_hosts import fake_host, set_online

GiB = 1 << 30


def fs_size(path: Path | str) -> int:
    stat = os.statvfs(path)
    return stat.f_blocks * stat.f_frsize


def stored(resource: dict, share_base: int = 100) -> tuple[PluginSet, dict]:
    """The plugin set and the node states its add-node stores for `resource` (no engine info)."""
    plugins = PluginSet(make_plugins(share_base=share_base))
    return plugins, plugins.added(list(plugins), resource, None)


def capacity(host: Host, share_base: int = 100, **reserve) -> dict:
    _, states = stored(node_resource(host, share_base=share_base, **reserve), share_base)
    return {name: state.capacity for name, state in states.items()}


# -- reading fake trees ----------------------------------------------------------------------------


def test_one_numa_node_four_cpus(tmp_path: Path) -> None:
    host = read_host(str(fake_host(tmp_path)))
    assert host == Host(
        cpus=[0, 1, 2, 3],
        numa={0: [0, 1, 2, 3]},
        memory=8 * GiB,
        numa_memory={0: 8 * GiB},
        storage=fs_size(tmp_path),
    )
    assert describe(host) == "4 CPUs on 1 NUMA node, 8.0 GiB, 0 volumes, 0 GPUs"


def test_two_numa_nodes_eight_cpus(tmp_path: Path) -> None:
    host = read_host(str(fake_host(tmp_path, cpus=8, numa_nodes=2, memory=32 * GiB)))
    assert host.cpus == list(range(8))
    assert host.numa == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert host.numa_memory == {0: 16 * GiB, 1: 16 * GiB}
    assert describe(host) == "8 CPUs on 2 NUMA nodes, 32.0 GiB, 0 volumes, 0 GPUs"


def test_sparse_numa_ids_and_a_memory_only_node(tmp_path: Path) -> None:
    host = read_host(str(fake_host(tmp_path, cpus=4, numa_nodes=[0, 2], memory_only=[3], memory=12 * GiB)))
    assert host.numa == {0: [0, 1], 2: [2, 3], 3: []}
    assert host.numa_memory == {0: 4 * GiB, 2: 4 * GiB, 3: 4 * GiB}


def test_a_host_without_numa(tmp_path: Path) -> None:
    host = read_host(str(fake_host(tmp_path, cpus=2, numa_nodes=0)))
    assert (host.cpus, host.numa, host.numa_memory) == ([0, 1], {}, {})
    assert describe(host) == "2 CPUs, 8.0 GiB, 0 volumes, 0 GPUs"


def test_offline_cpus_and_hot_plug(tmp_path: Path) -> None:
    root = fake_host(tmp_path, cpus=8, numa_nodes=2, offline=[1, 6])
    host = read_host(str(root))
    assert host.cpus == [0, 2, 3, 4, 5, 7]
    assert host.numa == {0: [0, 2, 3], 1: [4, 5, 7]}
    set_online(root, [0, 1, 2, 3, 4])
    assert read_host(str(root)).numa == {0: [0, 1, 2, 3], 1: [4]}


def test_cpus_from_proc_stat_without_the_online_list(tmp_path: Path) -> None:
    root = fake_host(tmp_path, cpus=4, numa_nodes=0, offline=[2])
    (root / "sys/devices/system/cpu/online").unlink()
    assert read_host(str(root)).cpus == [0, 1, 3]


def test_whole_disks_only(tmp_path: Path) -> None:
    disks = {"sda": 100 * GiB, "nvme0n1": 1 << 40, "md0": 10 * GiB}
    noise = dict.fromkeys(["loop0", "ram0", "zram0", "dm-0", "sr0", "fd0"], GiB)
    host = read_host(str(fake_host(tmp_path, disks=disks | noise)))
    assert host.disks == {"md0": 10 * GiB, "nvme0n1": 1 << 40, "sda": 100 * GiB}


def test_volumes_are_real_devices_mounted_on_directories(tmp_path: Path) -> None:
    root = fake_host(tmp_path, volumes=["/data", "/srv/b", "/with space"])
    (root / "data2").mkdir()
    (root / "etc").mkdir()
    (root / "etc/hosts").write_text("")
    for name in ("boot/efi", "snap/core", "tmp2", "run/media", "var/root"):
        (root / name).mkdir(parents=True)
    with (root / "proc/mounts").open("a") as mounts:
        mounts.write(
            "/dev/vdb /data2 ext4 rw 0 0\n"  # a bind mount of /data's device
            "/dev/vdq /etc/hosts ext4 rw 0 0\n"  # a file, as containers bind
            "/dev/vdr /boot/efi vfat rw 0 0\n"
            "/dev/loop3 /snap/core squashfs ro 0 0\n"
            "tmpfs /tmp2 tmpfs rw 0 0\n"
            "/dev/vds /run/media ext4 rw 0 0\n"
            "/dev/vda /var/root ext4 rw 0 0\n"  # the root's device again
            "/dev/vdt /missing ext4 rw 0 0\n"  # no such directory
        )
    host = read_host(str(root))
    size = fs_size(tmp_path)
    assert host.volumes == {"/data": size, "/srv/b": size, "/with space": size}
    assert host.storage == size


def test_gpus_from_drm_cards(tmp_path: Path) -> None:
    gpus = {"10de:2204": 2, "1002:73BF": 1, "8086:9a49": 1}
    host = read_host(str(fake_host(tmp_path, gpus=gpus)), nvidia_smi=None)
    assert host.gpus == {"amd-73bf": 1, "nvidia-2204": 2}
    assert describe(host).endswith(", 3 GPUs")


def fake_nvidia_smi(path: Path, output: str, status: int = 0) -> str:
    script = path / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}EOF\nexit {status}\n")
    script.chmod(0o755)
    return str(script)


def test_nvidia_smi_names_the_cards_of_this_machine(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(
        tmp_path, "NVIDIA GeForce RTX 3090\nNVIDIA GeForce RTX 3090\nTesla V100-SXM2-16GB\n"
    )
    gpus = read_host("/", nvidia_smi=smi).gpus
    assert gpus["nvidia-geforce-rtx-3090"] == 2
    assert gpus["nvidia-tesla-v100-sxm2-16gb"] == 1
    assert not any(product.startswith("nvidia-") and product[7:].isalnum() for product in gpus)  # no PCI ids


def test_a_failing_nvidia_smi_falls_back_to_drm(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(tmp_path, "NVIDIA GeForce RTX 3090\n", status=9)
    assert "nvidia-geforce-rtx-3090" not in read_host("/", nvidia_smi=smi).gpus


def test_nvidia_smi_is_never_asked_about_a_fake_tree(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(tmp_path, "NVIDIA GeForce RTX 3090\n")
    root = fake_host(tmp_path / "host", gpus={"10de:2204": 1})
    assert read_host(str(root), nvidia_smi=smi).gpus == {"nvidia-2204": 1}


def test_a_wrong_root_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(HostUnreadable, match=str(tmp_path / "nothing")) as raised:
        read_host(str(tmp_path / "nothing"))
    assert isinstance(raised.value, ValueError)


def test_a_partial_tree_reads_as_zeros(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 1024 kB\n")
    host = read_host(str(tmp_path))
    assert host == Host(memory=1 << 20, storage=fs_size(tmp_path))


def test_this_machine() -> None:
    host = read_host("/", nvidia_smi=None)
    online = Path("/sys/devices/system/cpu/online")
    if online.exists():
        assert host.cpus == parse_cpulist(online.read_text())
    assert len(host.cpus) == os.cpu_count()
    assert set(os.sched_getaffinity(0)) <= set(host.cpus)
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    assert host.memory == int(meminfo["MemTotal"].split()[0]) * 1024 > 0
    assert host.storage == fs_size("/") > 0
    if host.numa:
        assert sorted(cpu for cpus in host.numa.values() for cpu in cpus) == host.cpus


# -- the node request, stored by the real plugins ------------------------------------------------


def test_a_whole_host_is_offered(tmp_path: Path) -> None:
    host = read_host(str(fake_host(tmp_path, cpus=4)))
    cpumem = capacity(host)["cpumem"]
    assert cpumem["cpu"] == 4
    assert cpumem["cpu_map"] == dict.fromkeys(["0", "1", "2", "3"], 100)
    assert cpumem["memory"] == 8 * GiB
    assert cpumem["numa"] == dict.fromkeys(["0", "1", "2", "3"], "0")
    assert cpumem["numa_memory"] == {"0": 8 * GiB}


def test_a_fractional_reservation_comes_off_the_highest_cpus(tmp_path: Path) -> None:
    host = read_host(str(fake_host(tmp_path, cpus=4)))
    cpumem = capacity(host, reserve_cpu=1.5)["cpumem"]
    assert cpumem["cpu_map"] == {"0": 100, "1": 100, "2": 50}
    assert cpumem["cpu"] == 3  # cpumem counts cores, whatever their pieces
    assert capacity(host, reserve_cpu=1.5, share_base=1000)["cpumem"]["cpu_map"] == {
        "0": 1000,
        "1": 1000,
        "2": 500,
    }


def test_whole_cores_and_memory_reserved_on_two_numa_nodes(tmp_path: Path) -> None:
    host = read_host(str(fake_host(tmp_path, cpus=8, numa_nodes=2, memory=32 * GiB)))
    cpumem = capacity(host, reserve_cpu=2, reserve_memory=2 * GiB)["cpumem"]
    assert list(cpumem["cpu_map"]) == ["0", "1", "2", "3", "4", "5"]
    assert cpumem["numa"] == {"0": "0", "1": "0", "2": "0", "3": "0", "4": "1", "5": "1"}
    assert cpumem["memory"] == 30 * GiB
    assert cpumem["numa_memory"] == {"0": 15 * GiB, "1": 15 * GiB}


def test_reserved_memory_comes_from_the_numa_nodes_in_proportion() -> None:
    host = Host(cpus=[0, 1], numa={0: [0], 1: [1]}, memory=8 * GiB, numa_memory={0: 6 * GiB, 1: 2 * GiB})
    assert capacity(host, reserve_memory=2 * GiB)["cpumem"]["numa_memory"] == {
        "0": 9 * GiB // 2,
        "1": 3 * GiB // 2,
    }
    odd = capacity(host, reserve_memory=2 * GiB + 1)["cpumem"]
    assert odd["numa_memory"]["1"] == (6 * GiB - 1) // 4 and sum(odd["numa_memory"].values()) == odd["memory"]
    assert capacity(host, reserve_memory=9 * GiB)["cpumem"]["numa_memory"] == {"0": 0, "1": 0}


def test_sparse_numa_ids_are_kept_down_to_the_engine(tmp_path: Path) -> None:
    host = read_host(str(fake_host(tmp_path, cpus=4, numa_nodes=[0, 2], memory_only=[3], memory=12 * GiB)))
    plugins, states = stored(node_resource(host))
    cpumem = states["cpumem"]
    assert cpumem.capacity["numa"] == {"0": "0", "1": "0", "2": "2", "3": "2"}
    assert cpumem.capacity["numa_memory"] == {"0": 4 * GiB, "2": 4 * GiB, "3": 4 * GiB}
    request = {"cpu-bind": True, "cpu-request": 2, "memory-request": GiB}
    used = plugins["cpumem"].apply_workloads(
        cpumem.usage, [{"cpu_request": 2, "cpu_map": {"0": 100, "1": 100}}], True
    )
    params, _ = plugins["cpumem"].calculate_deploy(cpumem.capacity, used, 1, request)
    assert params[0]["numa_node"] == "2"  # the kernel's id, for cpuset.mems


def test_a_host_without_numa_gets_no_numa_keys(tmp_path: Path) -> None:
    host = read_host(str(fake_host(tmp_path, cpus=2, numa_nodes=0)))
    assert set(node_resource(host)["cpumem"]) == {"cpu", "cpu_map", "memory"}
    assert capacity(host)["cpumem"]["numa"] == {}


def test_reserving_every_cpu_is_refused(tmp_path: Path) -> None:
    host = read_host(str(fake_host(tmp_path, cpus=8)))
    with pytest.raises(ValueError, match="--reserve-cpu 8 leaves no CPU of 8"):
        node_resource(host, reserve_cpu=8)
    with pytest.raises(ValueError, match="leaves no CPU of 8"):
        node_resource(host, reserve_cpu=7.999)  # less than one piece is left: nothing
    with pytest.raises(ValueError, match="negative"):
        node_resource(host, reserve_cpu=-1)
    with pytest.raises(ValueError, match="negative"):
        node_resource(host, reserve_memory=-1)


def test_storage_holds_the_root_and_the_volumes(tmp_path: Path) -> None:
    host = read_host(str(fake_host(tmp_path, volumes=["/data", "/srv/b", "/with space"])))
    size = fs_size(tmp_path)
    storage = capacity(host)["storage"]
    assert storage["volumes"] == {"/data": size, "/srv/b": size}  # a path with whitespace is left out
    assert storage["storage"] == host.storage + 2 * size
    assert storage["disks"] == []


def test_gpus_are_offered_per_product(tmp_path: Path) -> None:
    host = read_host(str(fake_host(tmp_path, gpus={"10de:2204": 2, "1002:73bf": 1})))
    assert capacity(host)["gpu"] == {"prod_count_map": {"amd-73bf": 1, "nvidia-2204": 2}}
    assert capacity(read_host(str(fake_host(tmp_path / "none"))))["gpu"] == {"prod_count_map": {}}


def test_the_map_is_also_an_absolute_capacity_request(tmp_path: Path) -> None:
    """Re-registering a host whose shape changed (a CPU unplugged, a card gone) replaces the capacity."""
    root = fake_host(tmp_path, cpus=8, numa_nodes=2, gpus={"10de:2204": 2}, volumes=["/data"])
    plugins, states = stored(node_resource(read_host(str(root))))
    set_online(root, [0, 1, 2, 3, 4, 5, 6])
    (root / "sys/class/drm/card1/device/vendor").unlink()
    changed = node_resource(read_host(str(root)), reserve_cpu=0.5)
    after = plugins.with_capacity(states, dict.fromkeys(plugins), changed, delta=False, incr=True)
    _, fresh = stored(changed)
    assert {name: state.capacity for name, state in after.items()} == {
        name: s.capacity for name, s in fresh.items()
    }
    assert after["cpumem"].capacity["cpu_map"]["6"] == 50 and after["gpu"].capacity["prod_count_map"] == {
        "nvidia-2204": 1
    }


@st.composite
def hosts(draw: st.DrawFn) -> Host:
    """1-4 NUMA nodes (sparse ids, maybe memory-only ones), 1-64 CPUs in blocks, any memory figures."""
    nodes = sorted(draw(st.sets(st.integers(0, 7), min_size=1, max_size=4)))
    with_cpus = nodes[: draw(st.integers(1, len(nodes)))]
    count = draw(st.integers(1, 64))
    numa: dict[int, list[int]] = {node: [] for node in nodes}
    for cpu in range(count):
        numa[with_cpus[cpu * len(with_cpus) // count]].append(cpu)
    numa_memory = {node: draw(st.integers(0, 1 << 40)) for node in nodes}
    memory = draw(st.integers(0, 1 << 42))
    return Host(
        cpus=list(range(count)),
        numa=numa if draw(st.booleans()) else {},
        memory=memory,
        numa_memory=numa_memory,
    )


@settings(max_examples=300, deadline=None)
@given(hosts(), st.floats(0, 64), st.integers(0, 1 << 42), st.sampled_from([1, 100, 1000]))
def test_the_plugins_store_the_host_less_the_reservation(
    host: Host, reserve_cpu: float, reserve_memory: int, share_base: int
) -> None:
    pieces = len(host.cpus) * share_base - round(reserve_cpu * share_base)
    if pieces <= 0:
        with pytest.raises(ValueError, match="leaves no CPU"):
            node_resource(host, reserve_cpu=reserve_cpu, share_base=share_base)
        return
    cpumem = capacity(host, share_base, reserve_cpu=reserve_cpu, reserve_memory=reserve_memory)["cpumem"]
    assert sum(cpumem["cpu_map"].values()) == pieces  # the unreserved CPU total, in pieces
    assert sum(cpumem["cpu_map"].values()) / share_base == pytest.approx(
        len(host.cpus) - reserve_cpu, abs=1 / share_base
    )
    assert cpumem["cpu"] == len(cpumem["cpu_map"]) == math.ceil(pieces / share_base)
    assert cpumem["memory"] == max(host.memory - reserve_memory, 0)
    if host.numa:
        assert sum(cpumem["numa_memory"].values()) == cpumem["memory"]
        assert set(cpumem["numa_memory"]) == {str(node) for node in host.numa}
        node_of = {cpu: node for node, cpus in host.numa.items() for cpu in cpus}
        assert cpumem["numa"] == {core: str(node_of[int(core)]) for core in cpumem["cpu_map"]}
    else:
        assert cpumem["numa"] == {} and cpumem["numa_memory"] == {}
