"""Parsers against real kernel file formats, cgroup layout detection and discovery, and the
provisioners run on small sample trees (so exact values can be checked).

The sample texts were captured on a 6.18 kernel (hybrid cgroup host) unless a comment says they
show an older or newer kernel's variant.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.metrics.cgroups import container_id, detect_layout, discover, pod_uid
from services.metrics.metrics_list import BY_SCOPE_AND_NAME
from services.metrics.parsers import (
    CpuTimes,
    parse_blkio,
    parse_cpu_max,
    parse_cpuacct_usage_all,
    parse_cpulist,
    parse_diskstats,
    parse_flat_keyed,
    parse_int,
    parse_io_stat,
    parse_loadavg,
    parse_meminfo,
    parse_memory_limit,
    parse_net_dev,
    parse_numa_stat,
    parse_pressure,
    parse_proc_stat,
)
from services.metrics.provisioners import (
    CgroupProvisioner,
    CpuProvisioner,
    DiskProvisioner,
    MemoryProvisioner,
    NetworkProvisioner,
    PressureProvisioner,
    Roots,
    Sample,
)

PAGE = os.sysconf("SC_PAGE_SIZE")

# ------------------------------------------------------------------------------------ procfs

PROC_STAT = """\
cpu  962 0 1175 67581 143 0 12 32 0 0
cpu0 336 0 470 34123 3 0 2 12 0 0
cpu1 626 0 705 33457 140 0 10 19 0 0
intr 261681 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 1 1 16 0 0 0 0 38 29 0 15 1 57032
ctxt 753625
btime 1796223416
processes 7094
procs_running 2
procs_blocked 1
softirq 122548 0 10700 4 2132 57029 0 2 26239 0 26442
"""


def test_proc_stat():
    stat = parse_proc_stat(PROC_STAT)
    assert stat.total == CpuTimes(962, 0, 1175, 67581, 143, 0, 12, 32)
    assert sorted(stat.cpus) == [0, 1]
    assert stat.cpus[1].iowait == 140 and stat.cpus[1].steal == 19
    assert (stat.procs_running, stat.procs_blocked) == (2, 1)
    # guest columns are already inside user and nice, so the total leaves them out
    assert stat.cpus[0].total == 336 + 470 + 34123 + 3 + 2 + 12
    assert stat.cpus[0].idle_all == 34123 + 3


def test_proc_stat_old_kernel_with_fewer_columns():
    # 2.6.11-era kernels print 8 columns (no guest, guest_nice); missing ones count as 0.
    stat = parse_proc_stat("cpu  10 0 5 100 1 0 0\ncpu0 10 0 5 100 1 0 0\n")
    assert stat.cpus[0] == CpuTimes(10, 0, 5, 100, 1, 0, 0, 0)


def test_proc_stat_counts_cpus_with_gaps():
    # An offline CPU has no line; ids are kept as the kernel numbers them.
    stat = parse_proc_stat("cpu  1 0 1 1 0 0 0 0 0 0\ncpu0 1 0 1 1 0 0 0 0 0 0\ncpu2 1 0 1 1 0 0 0 0 0 0\n")
    assert sorted(stat.cpus) == [0, 2]


def test_loadavg():
    load = parse_loadavg("0.91 0.22 0.06 2/98 4058\n")
    assert (load.load1, load.load5, load.load15, load.running, load.total) == (0.91, 0.22, 0.06, 2, 98)


MEMINFO = """\
MemTotal:       24683584 kB
MemFree:        23873400 kB
MemAvailable:   24101152 kB
Buffers:           13936 kB
Cached:           443280 kB
Active(anon):      25248 kB
Inactive(file):   239984 kB
SReclaimable:      98480 kB
HugePages_Total:       0
HugePages_Free:        3
Hugepagesize:       2048 kB
"""


def test_meminfo_is_bytes_and_page_counts_stay_counts():
    info = parse_meminfo(MEMINFO)
    assert info["MemTotal"] == 24683584 * 1024
    assert info["Active(anon)"] == 25248 * 1024
    assert info["Inactive(file)"] == 239984 * 1024
    assert info["HugePages_Free"] == 3
    assert info["Hugepagesize"] == 2048 * 1024


NODE_MEMINFO = """\
Node 0 MemTotal:        5072632 kB
Node 0 MemFree:         4262500 kB
Node 0 MemUsed:          810132 kB
Node 0 Active(file):     147232 kB
Node 0 Inactive(file):   239984 kB
Node 0 FilePages:        457216 kB
Node 0 Shmem:             69972 kB
Node 0 SReclaimable:      98480 kB
Node 0 HugePages_Total:     0
"""


def test_node_meminfo_drops_the_node_prefix_and_has_no_memavailable():
    info = parse_meminfo(NODE_MEMINFO)
    assert info["MemUsed"] == 810132 * 1024
    assert info["MemTotal"] - info["MemFree"] == info["MemUsed"]
    assert "MemAvailable" not in info
    assert info["HugePages_Total"] == 0


def test_vmstat():
    text = "nr_free_pages 5968350\npgsteal_kswapd 12\npgscan_direct 7\ncompact_stall 0\nworkingset_refault_file 65879\n"
    vmstat = parse_flat_keyed(text)
    assert vmstat == {
        "nr_free_pages": 5968350,
        "pgsteal_kswapd": 12,
        "pgscan_direct": 7,
        "compact_stall": 0,
        "workingset_refault_file": 65879,
    }


DISKSTATS = """\
   7       0 loop0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0
 254       0 vda 31227 6837 1818402 6811 24490 12315 1588296 13374 0 6292 21155 9441 41 745280 702 4734 266
 254       1 vda1 30000 6800 1800000 6700 24000 12000 1580000 13000 0 6100 20000 9441 41 745280 702
   8       0 sda 100 0 800 50 200 0 1600 70 0 90 120
   8      16 sdb 5 6 7 8
"""


def test_diskstats_20_18_and_14_columns():
    disks = parse_diskstats(DISKSTATS)
    vda = disks["vda"]  # 20 columns (5.5+: discards and flushes)
    assert (vda.reads, vda.sectors_read, vda.writes, vda.sectors_written, vda.io_ticks_ms) == (
        31227, 1818402, 24490, 1588296, 6292,
    )  # fmt: skip
    assert disks["vda1"].io_ticks_ms == 6100  # 18 columns (4.18+: discards)
    assert disks["sda"].io_ticks_ms == 90  # 14 columns (before 4.18)
    assert "sdb" not in disks  # 2.6-era 7-column partition line: no io_ticks
    assert disks["loop0"].reads == 0


NET_DEV = """\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:   37368     502    0    0    0     0          0         0    37368     502    0    0    0     0       0          0
  eth0: 55812160    1340    0    1    0     0          0         3    96983     961    0    0    0     4       5          0
  eth1:1234567890   10    2    0    0     0          0         0        7       1    0    0    0     0       0          0
"""


def test_net_dev():
    nics = parse_net_dev(NET_DEV)
    assert sorted(nics) == ["eth0", "eth1", "lo"]
    eth0 = nics["eth0"]
    assert eth0["receive_bytes"] == 55812160 and eth0["receive_drop"] == 1 and eth0["receive_multicast"] == 3
    assert eth0["transmit_bytes"] == 96983 and eth0["transmit_colls"] == 4 and eth0["transmit_carrier"] == 5
    assert len(eth0) == 16
    # old kernels print no space between the colon and a wide byte count
    assert nics["eth1"]["receive_bytes"] == 1234567890 and nics["eth1"]["receive_errs"] == 2


def test_pressure_some_and_full():
    text = "some avg10=4.23 avg60=1.20 avg300=0.54 total=3955120\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    pressure = parse_pressure(text)
    assert pressure.some is not None and pressure.full is not None
    assert (pressure.some.avg10, pressure.some.avg60, pressure.some.avg300) == (4.23, 1.20, 0.54)
    assert pressure.some.total_us == 3955120
    assert pressure.full.total_us == 0


def test_pressure_cpu_file_without_full_line():
    # cpu.pressure had only a "some" line before Linux 5.13
    pressure = parse_pressure("some avg10=0.00 avg60=0.10 avg300=0.05 total=1234\n")
    assert pressure.full is None and pressure.some is not None and pressure.some.total_us == 1234


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0-1\n", [0, 1]), ("0-3,8,10-11", [0, 1, 2, 3, 8, 10, 11]), ("5", [5]), ("\n", []), ("1,1,0", [0, 1])],
)
def test_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["3-1", "a", "0-", "-1", "1;2"])
def test_cpulist_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_cpulist(text)


# ------------------------------------------------------------------------------ cgroup v1

V1_MEMORY_STAT = """\
cache 16240640
rss 5021696
shmem 9580544
mapped_file 8052736
pgfault 21293
hierarchical_memory_limit 9223372036854771712
total_cache 488976384
total_rss 163188736
total_shmem 71651328
total_mapped_file 100864000
total_dirty 282624
total_writeback 0
total_workingset_refault_anon 0
total_workingset_refault_file 5881
total_swap 0
total_pgfault 2256171
total_pgmajfault 749
total_inactive_anon 195776512
total_active_anon 25894912
total_inactive_file 263118848
total_active_file 154206208
"""

V1_NUMA_STAT = """\
total=5191 N0=5191 N1=0
file=1626 N0=1626 N1=0
anon=374 N0=374 N1=0
unevictable=3191 N0=3191 N1=0
hierarchical_total=159191 N0=159000 N1=191
hierarchical_file=101886 N0=101886 N1=0
hierarchical_anon=54114 N0=53923 N1=191
hierarchical_unevictable=3191 N0=3191 N1=0
"""


def test_v1_single_value_files():
    assert parse_int("86241176464\n") == 86241176464  # cpuacct.usage
    assert parse_int("652013568\n") == 652013568  # memory.usage_in_bytes
    assert parse_memory_limit("9223372036854771712\n") is None  # unlimited, page-rounded LONG_MAX
    assert parse_memory_limit("536870912\n") == 536870912


def test_v1_cpuacct_usage_all():
    text = "cpu user system\n0 15999918877 12703817394\n1 34020453469 19768945307\n"
    assert parse_cpuacct_usage_all(text) == {0: (15999918877, 12703817394), 1: (34020453469, 19768945307)}


def test_v1_cpu_stat():
    text = "nr_periods 120\nnr_throttled 7\nthrottled_time 350000000\nnr_bursts 0\nburst_time 0\n"
    assert parse_flat_keyed(text)["throttled_time"] == 350000000


def test_v1_memory_stat():
    stat = parse_flat_keyed(V1_MEMORY_STAT)
    assert stat["total_rss"] == 163188736 and stat["rss"] == 5021696
    assert stat["hierarchical_memory_limit"] == 9223372036854771712


def test_v1_numa_stat_is_pages_with_hierarchical_lines():
    numa = parse_numa_stat(V1_NUMA_STAT)
    assert numa["total"] == {0: 5191, 1: 0}
    assert numa["hierarchical_anon"] == {0: 53923, 1: 191}
    assert set(numa) == {
        "total", "file", "anon", "unevictable",
        "hierarchical_total", "hierarchical_file", "hierarchical_anon", "hierarchical_unevictable",
    }  # fmt: skip


def test_v1_blkio():
    text = "8:0 Read 4096\n8:0 Write 8192\n8:0 Sync 8192\n8:0 Async 4096\n8:0 Total 12288\n" \
           "253:0 Read 10\n253:0 Write 0\nTotal 12298\n"  # fmt: skip
    devices = parse_blkio(text)
    assert devices == {
        "8:0": {"Read": 4096, "Write": 8192, "Sync": 8192, "Async": 4096, "Total": 12288},
        "253:0": {"Read": 10, "Write": 0},
    }
    assert parse_blkio("Total 0\n") == {}


# ------------------------------------------------------------------------------ cgroup v2

V2_MEMORY_STAT = """\
anon 2121728
file 8806400
kernel 1036288
shmem 0
file_mapped 4096000
file_dirty 12288
file_writeback 0
active_anon 2109440
inactive_anon 12288
active_file 4517888
inactive_file 4288512
pgfault 5733
pgmajfault 12
workingset_refault_anon 0
workingset_refault_file 3
workingset_activate_anon 0
workingset_activate_file 1
pgscan 30
pgsteal 20
pgscan_kswapd 25
pgscan_direct 5
pgsteal_kswapd 18
pgsteal_direct 2
"""


def test_v2_cpu_stat_and_cpu_max():
    text = "usage_usec 82505135\nuser_usec 50020372\nsystem_usec 32484762\nnice_usec 0\n" \
           "nr_periods 10\nnr_throttled 2\nthrottled_usec 5000\nnr_bursts 0\nburst_usec 0\n"  # fmt: skip
    stat = parse_flat_keyed(text)
    assert (stat["usage_usec"], stat["throttled_usec"]) == (82505135, 5000)
    assert parse_cpu_max("max 100000\n") == parse_cpu_max("max 100000")
    assert (parse_cpu_max("max 100000\n").quota_us, parse_cpu_max("max 100000\n").period_us) == (-1, 100000)
    assert (parse_cpu_max("50000 100000\n").quota_us, parse_cpu_max("50000 100000\n").period_us) == (
        50000,
        100000,
    )


def test_v2_memory_files():
    assert parse_int("11505664\n") == 11505664  # memory.current
    assert parse_memory_limit("max\n") is None
    assert parse_memory_limit("1073741824\n") == 1 << 30
    assert parse_flat_keyed(V2_MEMORY_STAT)["pgsteal_kswapd"] == 18


def test_v2_numa_stat_is_bytes():
    numa = parse_numa_stat("anon N0=2121728 N1=4096\nfile N0=8806400 N1=0\nkernel_stack N0=65536 N1=0\n")
    assert numa["anon"] == {0: 2121728, 1: 4096}
    assert numa["kernel_stack"] == {0: 65536, 1: 0}


def test_v2_io_stat_skips_fractional_iocost_fields():
    text = "8:0 rbytes=90430464 wbytes=299008000 rios=8950 wios=21478 dbytes=0 dios=0\n" \
           "253:0 rbytes=1 wbytes=2 rios=3 wios=4 dbytes=0 dios=0 cost.vrate=135.04 cost.usage=42\n"  # fmt: skip
    devices = parse_io_stat(text)
    assert devices["8:0"]["wios"] == 21478
    assert devices["253:0"] == {
        "rbytes": 1,
        "wbytes": 2,
        "rios": 3,
        "wios": 4,
        "dbytes": 0,
        "dios": 0,
        "cost.usage": 42,
    }


def test_v2_pressure_files():
    text = "some avg10=0.00 avg60=0.47 avg300=0.58 total=3134406\nfull avg10=0.00 avg60=0.40 avg300=0.49 total=2797844\n"
    pressure = parse_pressure(text)
    assert pressure.full is not None and pressure.full.avg60 == 0.40 and pressure.full.total_us == 2797844


# ------------------------------------------------------------------------ sample trees


def make_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def assert_listed(samples: list[Sample]) -> None:
    unlisted = {(s.scope, s.metric) for s in samples} - set(BY_SCOPE_AND_NAME)
    assert not unlisted


def by_key(samples: list[Sample]) -> dict[tuple, float]:
    return {(s.scope, s.ids, s.metric): s.value for s in samples}


# ------------------------------------------------------------------ layout and discovery


def test_layout_v2(tmp_path):
    make_tree(tmp_path, {"cgroup.controllers": "cpuset cpu io memory pids\n", "cgroup.procs": ""})
    layout = detect_layout(str(tmp_path))
    assert layout.mode == "v2" and layout.v1 == {}
    assert layout.locate("memory", "memory") == (2, str(tmp_path))
    assert layout.locate("cpuacct", None) == (2, str(tmp_path))


def test_layout_v1(tmp_path):
    make_tree(tmp_path, {f"{c}/cgroup.procs": "" for c in ("cpu", "cpuacct", "memory", "blkio", "pids")})
    layout = detect_layout(str(tmp_path))
    assert layout.mode == "v1" and layout.unified is None
    assert layout.locate("blkio", "io") == (1, str(tmp_path / "blkio"))


def test_layout_hybrid_like_this_host(tmp_path):
    # v1 controllers on a tmpfs; cgroup2 at unified/ holding only hugetlb; no root cgroup.controllers
    make_tree(tmp_path, {f"{c}/cgroup.procs": "" for c in ("cpu", "cpuacct", "memory", "blkio")})
    make_tree(tmp_path, {"unified/cgroup.controllers": "hugetlb\n", "unified/cpu.pressure": ""})
    layout = detect_layout(str(tmp_path))
    assert layout.mode == "hybrid"
    assert layout.locate("memory", "memory") == (1, str(tmp_path / "memory"))
    assert layout.unified == str(tmp_path / "unified") and layout.unified_controllers == {"hugetlb"}


def test_layout_hybrid_with_a_controller_only_in_v2(tmp_path):
    make_tree(tmp_path, {f"{c}/cgroup.procs": "" for c in ("cpu", "cpuacct", "memory")})
    make_tree(tmp_path, {"unified/cgroup.controllers": "io\n"})
    layout = detect_layout(str(tmp_path))
    assert layout.locate("blkio", "io") == (2, str(tmp_path / "unified"))


def test_layout_none(tmp_path):
    assert detect_layout(str(tmp_path)).mode == "none"
    assert discover(detect_layout(str(tmp_path))).pods == {}


UID = "1b2c3d4e-0000-4a5b-8c9d-0123456789ab"
CID = "a" * 64


@pytest.mark.parametrize(
    ("name", "uid"),
    [
        (f"pod{UID}", UID),
        (f"kubepods-burstable-pod{UID.replace('-', '_')}.slice", UID),
        (f"kubepods-pod{UID.replace('-', '_')}.slice", UID),
        ("kubepods-besteffort.slice", None),
        ("kubepods-pod.slice", None),
        ("burstable", None),
        ("pod", None),
    ],
)
def test_pod_uid(name, uid):
    assert pod_uid(name) == uid


@pytest.mark.parametrize(
    ("name", "cid"),
    [
        (CID, CID),
        (f"cri-containerd-{CID}.scope", CID),
        (f"docker-{CID}.scope", CID),
        (f"crio-{CID}.scope", CID),
        (f"crio-conmon-{CID}.scope", None),
        ("init.scope", None),
    ],
)
def test_container_id(name, cid):
    assert container_id(name) == cid


def test_discover_cgroupfs_driver(tmp_path):
    guaranteed, burstable = "11111111-1111-1111-1111-111111111111", UID
    make_tree(tmp_path / "memory", {
        "cgroup.procs": "",
        f"kubepods/pod{guaranteed}/{CID}/cgroup.procs": "",
        f"kubepods/burstable/pod{burstable}/{'b' * 64}/cgroup.procs": "",
        f"kubepods/burstable/pod{burstable}/{'c' * 64}/cgroup.procs": "",
        "kubepods/besteffort/cgroup.procs": "",
        f"docker/{'d' * 64}/cgroup.procs": "",
        "system.slice/cron.service/cgroup.procs": "",
    })  # fmt: skip
    found = discover(detect_layout(str(tmp_path)), configured=["/system.slice", "/kubepods"])
    assert set(found.pods) == {guaranteed, burstable}
    assert found.pods[guaranteed].containers == {CID: f"/kubepods/pod{guaranteed}/{CID}"}
    assert sorted(found.pods[burstable].containers) == ["b" * 64, "c" * 64]
    assert found.pods[burstable].path == f"/kubepods/burstable/pod{burstable}"
    assert found.cgroups == [
        "/kubepods", "/kubepods/burstable", "/kubepods/besteffort", f"/docker/{'d' * 64}", "/system.slice",
    ]  # fmt: skip
    assert found.living_pods()[burstable] == ["b" * 64, "c" * 64]


def test_discover_systemd_driver_on_v2(tmp_path):
    slice_ = f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID.replace('-', '_')}.slice"
    make_tree(tmp_path, {
        "cgroup.controllers": "cpu memory io\n",
        f"{slice_}/cri-containerd-{CID}.scope/cgroup.procs": "",
        f"{slice_}/crio-conmon-{CID}.scope/cgroup.procs": "",
        f"system.slice/docker-{'e' * 64}.scope/cgroup.procs": "",
        "system.slice/containerd.service/cgroup.procs": "",
    })  # fmt: skip
    found = discover(detect_layout(str(tmp_path)))
    assert found.pods[UID].containers == {CID: f"/{slice_}/cri-containerd-{CID}.scope"}
    assert found.cgroups == [
        "/kubepods.slice", "/kubepods.slice/kubepods-besteffort.slice", f"/system.slice/docker-{'e' * 64}.scope",
    ]  # fmt: skip


# ---------------------------------------------------------------- node provisioners on trees


def proc_tree(
    root: Path, stat: str, vmstat: str = "pgsteal_kswapd 100\n", disk_io: int = 0, rx: int = 0
) -> None:
    make_tree(root, {
        "proc/stat": stat,
        "proc/loadavg": "0.50 0.25 0.10 3/120 999\n",
        "proc/meminfo": MEMINFO,
        "proc/vmstat": vmstat,
        "proc/sys/vm/watermark_scale_factor": "10\n",
        "proc/pressure/cpu": f"some avg10=1.00 avg60=2.00 avg300=3.00 total={disk_io * 1000}\n",
        "proc/diskstats": f" 254 0 vda {100 + disk_io} 0 {800 + disk_io * 8} 0 50 0 400 0 0 {disk_io} 0\n"
                          " 254 1 vda1 1 0 8 0 1 0 8 0 0 1 0\n"
                          " 254 16 vdb 1 0 8 0 1 0 8 0 0 1 0\n"
                          "   7 0 loop0 0 0 0 0 0 0 0 0 0 0 0\n",
        "proc/net/dev": NET_DEV.replace("55812160", str(55812160 + rx)),
        "sys/devices/system/node/online": "0-1\n",
        "sys/devices/system/node/node0/cpulist": "0\n",
        "sys/devices/system/node/node1/cpulist": "1\n",
        "sys/devices/system/node/node0/meminfo": NODE_MEMINFO,
        "sys/devices/system/node/node1/meminfo": NODE_MEMINFO.replace("Node 0", "Node 1"),
        "sys/block/vda/queue/rotational": "1\n",
        "sys/block/vda/queue/wbt_lat_usec": "75000\n",
        "sys/block/loop0/queue/rotational": "0\n",
        "sys/class/net/eth0/speed": "10000\n",
        "sys/class/net/eth1/speed": "-1\n",
    })  # fmt: skip


def roots(tmp_path: Path) -> Roots:
    return Roots(proc=str(tmp_path / "proc"), sys=str(tmp_path / "sys"), cgroup=str(tmp_path / "cgroup"))


STAT_0 = "cpu  200 0 0 200 0 0 0 0 0 0\ncpu0 100 0 0 100 0 0 0 0 0 0\ncpu1 100 0 0 100 0 0 0 0 0 0\nprocs_running 3\n"
# one second later: cpu1 fully busy in user; cpu0 1 tick system, 89 idle, 10 iowait
STAT_1 = "cpu  300 0 1 289 10 0 0 0 0 0\ncpu0 100 0 1 189 10 0 0 0 0 0\ncpu1 200 0 0 100 0 0 0 0 0 0\nprocs_running 1\n"


def test_cpu_provisioner_ratios_and_numa(tmp_path):
    proc_tree(tmp_path, STAT_0)
    cpu = CpuProvisioner(roots(tmp_path))
    first = by_key(cpu.sample(10.0, 1000.0))
    assert first[("node", (), "cpu.total.system")] == 2
    assert first[("node", (), "procs.running.system")] == 3
    assert first[("node", (), "cpu.load.5min.system")] == 0.25
    assert not any(scope == "cpu" for scope, _, _ in first)  # ratios need two rounds
    proc_tree(tmp_path, STAT_1)
    samples = cpu.sample(11.0, 1001.0)
    assert_listed(samples)
    assert all(s.time == 1001.0 for s in samples)
    got = by_key(samples)
    assert got[("cpu", (1,), "cpu.usage.ratio.cpu")] == 1.0
    assert got[("cpu", (0,), "cpu.usage.ratio.cpu")] == pytest.approx(0.01)
    assert got[("cpu", (0,), "cpu.iowait.ratio.cpu")] == pytest.approx(0.10)
    assert got[("cpu", (0,), "cpu.sys.usage.ratio.cpu")] == pytest.approx(0.01)
    assert got[("node", (), "cpu.usage.ratio.system")] == pytest.approx(101 / 200)
    assert got[("node", (), "cpu.usage.system")] == pytest.approx(2 * 101 / 200)
    assert got[("numa", (1,), "cpu.usage.numa")] == 1.0
    assert got[("numa", (0,), "cpu.usage.numa.avg")] == pytest.approx(0.01)
    assert got[("numa", (0,), "cpu.iowait.ratio.numa.avg")] == pytest.approx(0.10)


def test_memory_provisioner_and_reclaim_deltas(tmp_path):
    proc_tree(tmp_path, STAT_0, vmstat="pgsteal_kswapd 100\npgscan_kswapd 300\ncompact_stall 2\n")
    memory = MemoryProvisioner(roots(tmp_path))
    first = by_key(memory.sample(1.0, 100.0))
    assert first[("node", (), "mem.total.system")] == 24683584 * 1024
    assert first[("node", (), "mem.used.system")] == (24683584 - 23873400) * 1024
    assert first[("node", (), "mem.kswapdsteal.system")] == 100
    assert first[("node", (), "mem.scale.factor.system")] == 10
    assert ("node", (), "mem.kswapdsteal.delta.system") not in first  # no previous round, no delta
    assert ("node", (), "mem.direct.pgsteal.system") not in first  # absent from this vmstat
    assert first[("numa", (1,), "mem.used.numa")] == 810132 * 1024
    assert first[("numa", (0,), "mem.available.numa")] == (4262500 + 147232 + 239984 + 98480) * 1024
    proc_tree(tmp_path, STAT_0, vmstat="pgsteal_kswapd 150\npgscan_kswapd 290\ncompact_stall 2\n")
    samples = memory.sample(2.0, 101.0)
    assert_listed(samples)
    got = by_key(samples)
    assert got[("node", (), "mem.kswapdsteal.delta.system")] == 50
    assert ("node", (), "mem.kswapd.pgscan.delta.system") not in got  # went backwards: no delta


def test_disk_network_and_pressure_rates(tmp_path):
    proc_tree(tmp_path, STAT_0)
    os.symlink("../devices/pci0000:00/virtio1/block/vdb", tmp_path / "sys/block/vdb")
    provisioners = [
        DiskProvisioner(roots(tmp_path)),
        NetworkProvisioner(roots(tmp_path)),
        PressureProvisioner(roots(tmp_path)),
    ]
    for p in provisioners:
        p.sample(0.0, 50.0)
    proc_tree(tmp_path, STAT_0, disk_io=500, rx=2000)
    samples = [s for p in provisioners for s in p.sample(2.0, 52.0)]
    assert_listed(samples)
    got = by_key(samples)
    assert got[("device", ("vda",), "io.read.ops.system")] == 250
    assert got[("device", ("vda",), "io.read.bps.system")] == 500 * 8 * 512 / 2
    assert got[("device", ("vda",), "io.write.ops.system")] == 0
    assert got[("device", ("vda",), "io.busy.rate.system")] == 0.25
    assert got[("device", ("vda",), "io.disk.type")] == 1  # rotational, not a virtio link
    assert got[("device", ("vda",), "io.disk.wbt")] == 75000
    assert got[("device", ("vdb",), "io.disk.type")] == 4  # its sysfs link goes through virtio
    assert not any(ids in (("vda1",), ("loop0",)) for _, ids, _ in got)  # partitions and loops skipped
    assert got[("network", ("eth0",), "net.receive.bps")] == 1000
    assert got[("network", ("eth0",), "net.speed")] == 10000
    assert ("network", ("eth1",), "net.speed") not in got  # -1: unknown
    assert not any(ids == ("lo",) for scope, ids, _ in got if scope == "network")
    assert got[("node", (), "cpu.psi.some.ratio.system")] == 0.25  # 500 ms stalled in 2 s
    assert got[("node", (), "cpu.psi.some.avg300.system")] == 3.0
    assert ("node", (), "cpu.psi.full.avg10.system") not in got


def test_provisioners_tolerate_missing_files(tmp_path):
    for cls in (CpuProvisioner, MemoryProvisioner, PressureProvisioner, DiskProvisioner, NetworkProvisioner):
        assert cls(roots(tmp_path)).sample(1.0, 1.0) == []
    assert CgroupProvisioner(roots(tmp_path)).sample(1.0, 1.0) == []


# -------------------------------------------------------------- cgroup provisioner on trees

POD = f"/kubepods/burstable/pod{UID}"
CONTAINER = f"{POD}/{CID}"


def v1_cgroup(
    root: Path, path: str, usage_ns: tuple[int, int], rss: int, io_bytes: int, throttled: int
) -> None:
    """One cgroup in every v1 hierarchy of a hybrid host (two CPUs: cpu0 on node 0, cpu1 on node 1)."""
    cpu0, cpu1 = usage_ns
    make_tree(root, {
        f"cpuacct{path}/cpuacct.usage_all": f"cpu user system\n0 {cpu0} 0\n1 {cpu1 // 2} {cpu1 // 2}\n",
        f"cpu{path}/cpu.cfs_quota_us": "200000\n",
        f"cpu{path}/cpu.cfs_period_us": "100000\n",
        f"cpu{path}/cpu.shares": "1024\n",
        f"cpu{path}/cpu.stat": f"nr_periods {throttled * 10}\nnr_throttled {throttled}\nthrottled_time {throttled * 1000000}\n",
        f"memory{path}/memory.usage_in_bytes": "652013568\n",
        f"memory{path}/memory.limit_in_bytes": "9223372036854771712\n",
        f"memory{path}/memory.stat": V1_MEMORY_STAT.replace("total_rss 163188736", f"total_rss {rss}"),
        f"memory{path}/memory.numa_stat": V1_NUMA_STAT,
        f"blkio{path}/blkio.throttle.io_service_bytes_recursive": f"8:0 Read {io_bytes}\n8:0 Write 0\nTotal {io_bytes}\n",
        f"blkio{path}/blkio.throttle.io_serviced_recursive": f"8:0 Read {io_bytes // 4096}\n8:0 Write 0\nTotal 0\n",
        f"unified{path}/memory.pressure": "some avg10=0.00 avg60=1.50 avg300=0.00 total=0\n",
    })  # fmt: skip


def hybrid_host(root: Path) -> None:
    make_tree(root / "cgroup", {f"{c}/cgroup.procs": "" for c in ("cpu", "cpuacct", "memory", "blkio")})
    make_tree(root / "cgroup", {"unified/cgroup.controllers": "hugetlb\n"})
    make_tree(
        root / "sys/devices/system/node", {"online": "0-1\n", "node0/cpulist": "0\n", "node1/cpulist": "1\n"}
    )


def test_cgroup_v1_hybrid_container(tmp_path):
    hybrid_host(tmp_path)
    cg = tmp_path / "cgroup"
    v1_cgroup(cg, CONTAINER, (1_000_000_000, 2_000_000_000), rss=4096, io_bytes=8192, throttled=1)
    provisioner = CgroupProvisioner(roots(tmp_path))
    first = by_key(provisioner.sample(5.0, 500.0))
    ids = (UID, CID)
    assert first[("container", ids, "cpu.limit.container")] == 2.0
    assert first[("container", ids, "cpu.quota.container")] == 200000
    assert first[("container", ids, "cpu.throttled.time.container")] == 1000  # ns -> us
    assert first[("container", ids, "mem.rss.container")] == 4096
    assert first[("container", ids, "mem.usage.container")] == 652013568
    assert ("container", ids, "mem.limit.container") not in first  # unlimited
    assert first[("container", ids, "mem.psiavg60.container")] == 1.5  # katalyst's name, from unified/
    assert first[("container-numa", (*ids, 1), "mem.anon.numa.container")] == 191 * PAGE  # hierarchical_
    assert first[("container-numa", (*ids, 0), "cpu.usage.count.numa.container")] == 1_000_000_000
    assert ("container", ids, "cpu.usage.container") not in first
    assert provisioner.discovery is not None and list(provisioner.discovery.pods) == [UID]
    # cgroup scope: the QoS cgroups exist (burstable) but have no files of their own here
    assert "/kubepods/burstable" in provisioner.discovery.cgroups

    v1_cgroup(cg, CONTAINER, (1_500_000_000, 3_000_000_000), rss=8192, io_bytes=16384, throttled=3)
    samples = provisioner.sample(6.0, 501.0)
    assert_listed(samples)
    got = by_key(samples)
    assert got[("container", ids, "cpu.usage.container")] == pytest.approx(1.5)
    assert got[("container", ids, "cpu.usage.user.container")] == pytest.approx(1.0)
    assert got[("container", ids, "cpu.usage.sys.container")] == pytest.approx(0.5)
    assert got[("container", ids, "cpu.usage.ratio.container")] == pytest.approx(0.75)
    assert got[("container-numa", (*ids, 0), "cpu.usage.numa.container")] == pytest.approx(0.5)
    assert got[("container-numa", (*ids, 1), "cpu.usage.numa.container")] == pytest.approx(1.0)
    assert got[("container", ids, "cpu.nr.throttled.container.rate")] == 2
    assert got[("container", ids, "cpu.nr.period.container.rate")] == 20
    assert got[("container", ids, "blkio.read.bps.container")] == 8192
    assert got[("container", ids, "blkio.read.iops.container")] == 2
    assert got[("container", ids, "mem.pgfault.container.rate")] == 0

    # the container restarts in place: counters start again from zero, so no rates this round
    v1_cgroup(cg, CONTAINER, (1000, 1000), rss=8192, io_bytes=0, throttled=0)
    got = by_key(provisioner.sample(7.0, 502.0))
    assert ("container", ids, "cpu.usage.container") not in got
    assert ("container", ids, "blkio.read.bps.container") not in got
    assert got[("container", ids, "mem.rss.container")] == 8192


def test_cgroup_v2_systemd_pod_and_configured_cgroup(tmp_path):
    pod = f"/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice"
    container = f"{pod}/cri-containerd-{CID}.scope"
    make_tree(tmp_path / "sys/devices/system/node", {"online": "0\n", "node0/cpulist": "0-1\n"})

    def write(usage_usec: int, rbytes: int) -> None:
        make_tree(tmp_path / "cgroup", {
            "cgroup.controllers": "cpu io memory\n",
            f"{container}/cpu.stat": f"usage_usec {usage_usec}\nuser_usec {usage_usec}\nsystem_usec 0\n"
                                     "nr_periods 0\nnr_throttled 0\nthrottled_usec 0\n",
            f"{container}/cpu.max": "max 100000\n",
            f"{container}/cpu.weight": "100\n",
            f"{container}/memory.current": "11505664\n",
            f"{container}/memory.max": "1073741824\n",
            f"{container}/memory.swap.current": "0\n",
            f"{container}/memory.stat": V2_MEMORY_STAT,
            f"{container}/memory.numa_stat": "anon N0=2121728\nfile N0=8806400\n",
            f"{container}/io.stat": f"8:0 rbytes={rbytes} wbytes=0 rios=1 wios=0 dbytes=0 dios=0\n",
            f"{container}/cpu.pressure": "some avg10=1.00 avg60=0.00 avg300=0.00 total=0\n"
                                         "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
            "system.slice/cpu.stat": f"usage_usec {usage_usec}\nuser_usec 0\nsystem_usec {usage_usec}\n",
        })  # fmt: skip

    write(1_000_000, 0)
    provisioner = CgroupProvisioner(roots(tmp_path), cgroup_paths=["/system.slice", "/not/there"])
    provisioner.sample(1.0, 10.0)
    write(1_250_000, 4096)
    samples = provisioner.sample(1.5, 10.5)
    assert_listed(samples)
    got = by_key(samples)
    ids = (UID, CID)
    assert got[("container", ids, "cpu.usage.container")] == pytest.approx(0.5)
    assert got[("container", ids, "cpu.quota.container")] == -1
    assert ("container", ids, "cpu.limit.container") not in got
    assert ("container", ids, "cpu.usage.ratio.container") not in got  # unlimited: no ratio
    assert got[("container", ids, "cpu.share.container")] == 100
    assert got[("container", ids, "mem.limit.container")] == 1 << 30
    assert got[("container", ids, "mem.rss.container")] == 2121728
    assert got[("container", ids, "mem.kswapdstall.container")] == 18
    assert got[("container", ids, "mem.workingsetrefault.container")] == 3
    assert got[("container", ids, "mem.workingsetactivate.container")] == 1
    assert got[("container-numa", (*ids, 0), "mem.total.numa.container")] == 2121728 + 8806400
    assert got[("container", ids, "blkio.read.bps.container")] == 8192
    assert got[("container", ids, "cpu.psi.some.avg10.container")] == 1.0
    assert got[("container", ids, "cpu.psi.full.ratio.container")] == 0
    assert got[("cgroup", ("/system.slice",), "cpu.usage.sys.cgroup")] == pytest.approx(0.5)
    assert not any(ids == ("/not/there",) for _, ids, _ in got)
    assert not any(scope == "container-numa" and m.startswith("cpu.") for scope, _, m in got)  # v1 only
