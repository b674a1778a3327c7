"""Pure parsers of the kernel's text files (procfs, sysfs, cgroup v1 and v2).

Each function takes the file's text and returns numbers in the file's own units; converting units
and turning counters into rates is the provisioners' job. The parsers use plain string splitting
(no regular expressions) because some of them run for every cgroup in every round, and they skip
lines they do not understand, because new kernels add fields and keys.
"""

from __future__ import annotations

import msgspec

# memory.limit_in_bytes shows "unlimited" as LONG_MAX rounded down to a page (9223372036854771712);
# anything from 2^62 up cannot be a real limit on any machine.
UNLIMITED_BYTES = 1 << 62


class CpuTimes(msgspec.Struct, frozen=True, gc=False):
    """One `cpu` line of /proc/stat, in USER_HZ ticks.

    guest and guest_nice are left out: the kernel already counts them in user and nice.
    """

    user: int = 0
    nice: int = 0
    system: int = 0
    idle: int = 0
    iowait: int = 0
    irq: int = 0
    softirq: int = 0
    steal: int = 0

    @property
    def total(self) -> int:
        return (
            self.user
            + self.nice
            + self.system
            + self.idle
            + self.iowait
            + self.irq
            + self.softirq
            + self.steal
        )

    @property
    def idle_all(self) -> int:
        return self.idle + self.iowait


class ProcStat(msgspec.Struct, gc=False):
    """/proc/stat: the aggregate `cpu` line, one line per online CPU, and the task counts."""

    total: CpuTimes
    cpus: dict[int, CpuTimes]
    procs_running: int = 0
    procs_blocked: int = 0


class LoadAvg(msgspec.Struct, frozen=True):
    load1: float
    load5: float
    load15: float
    running: int
    total: int


class DiskStats(msgspec.Struct, frozen=True, gc=False):
    """The /proc/diskstats counters berth uses (cumulative since boot)."""

    reads: int
    sectors_read: int
    writes: int
    sectors_written: int
    io_ticks_ms: int


class PsiLine(msgspec.Struct, frozen=True):
    """One line of a pressure file: averages in percent, total stall time in microseconds."""

    avg10: float
    avg60: float
    avg300: float
    total_us: int


class Pressure(msgspec.Struct, frozen=True):
    """A PSI file. `full` is absent from cpu.pressure before Linux 5.13."""

    some: PsiLine | None = None
    full: PsiLine | None = None


class CpuMax(msgspec.Struct, frozen=True):
    """cgroup v2 cpu.max; quota_us is -1 when unlimited ("max"), as in v1's cpu.cfs_quota_us."""

    quota_us: int
    period_us: int


# The 16 columns of /proc/net/dev, in order, as "<direction>_<field>".
NET_DEV_FIELDS = (
    "receive_bytes", "receive_packets", "receive_errs", "receive_drop",
    "receive_fifo", "receive_frame", "receive_compressed", "receive_multicast",
    "transmit_bytes", "transmit_packets", "transmit_errs", "transmit_drop",
    "transmit_fifo", "transmit_colls", "transmit_carrier", "transmit_compressed",
)  # fmt: skip


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def parse_int(text: str) -> int:
    """A file holding one integer: cpuacct.usage, memory.usage_in_bytes, memory.current, cpu.shares."""
    return int(text.strip())


def parse_memory_limit(text: str) -> int | None:
    """memory.limit_in_bytes (v1) or memory.max (v2) in bytes; None when unlimited."""
    text = text.strip()
    if text == "max":
        return None
    value = int(text)
    return None if value >= UNLIMITED_BYTES else value


def parse_cpu_max(text: str) -> CpuMax:
    """cgroup v2 cpu.max: "<quota|max> <period>"."""
    quota, period = text.split()
    return CpuMax(-1 if quota == "max" else int(quota), int(period))


def parse_cpulist(text: str, *, max_id: int | None = None, max_cpus: int | None = None) -> list[int]:
    """A kernel CPU or node list such as "0-3,8,10-11" (also cpuset strings); "" is empty.

    Raises ValueError on anything else, so callers can reject a bad cpuset from a request; with
    `max_id` and `max_cpus` also on a list beyond them, found before any range is expanded (a
    request's "0-4000000000" must not become four billion ints).
    """
    ranges = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, dash, high = part.partition("-")
        first = int(low)
        last = int(high) if dash else first
        if first < 0 or last < first:
            raise ValueError(f"bad range {part!r}")
        if max_id is not None and last > max_id:
            raise ValueError(f"CPU {last} is beyond the highest CPU id {max_id}")
        ranges.append((first, last))
    if max_cpus is not None and sum(last - first + 1 for first, last in ranges) > max_cpus:
        raise ValueError(f"more than {max_cpus} CPUs")
    return sorted({cpu for first, last in ranges for cpu in range(first, last + 1)})


def parse_proc_stat(text: str) -> ProcStat:
    """/proc/stat. Lines other than `cpu*` and `procs_*` (the long `intr` line) are not split."""
    total = CpuTimes()
    cpus: dict[int, CpuTimes] = {}
    running = blocked = 0
    for line in text.split("\n"):
        if line.startswith("cpu"):
            fields = line.split()
            # Older kernels print fewer columns; missing ones count as 0.
            times = CpuTimes(*(int(v) for v in fields[1:9]))
            if fields[0] == "cpu":
                total = times
            else:
                cpus[int(fields[0][3:])] = times
        elif line.startswith("procs_running "):
            running = int(line[14:])
        elif line.startswith("procs_blocked "):
            blocked = int(line[14:])
    return ProcStat(total, cpus, running, blocked)


def parse_loadavg(text: str) -> LoadAvg:
    """/proc/loadavg: "0.91 0.22 0.06 2/98 4058"."""
    one, five, fifteen, tasks = text.split()[:4]
    running, _, total = tasks.partition("/")
    return LoadAvg(float(one), float(five), float(fifteen), int(running), int(total))


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo or /sys/devices/system/node/nodeN/meminfo, as bytes (counts stay counts).

    Node files prefix every line with "Node N "; that prefix is dropped so both give the same keys.
    """
    values: dict[str, int] = {}
    for line in text.split("\n"):
        fields = line.split()
        if fields[:1] == ["Node"]:
            fields = fields[2:]
        if len(fields) < 2:
            continue
        value = _int(fields[1])
        if value is None:
            continue
        # Every size is printed in kB (KiB); HugePages_* lines are page counts without a unit.
        values[fields[0].rstrip(":")] = value * 1024 if fields[2:3] == ["kB"] else value
    return values


def parse_flat_keyed(text: str) -> dict[str, int]:
    """ "key value" lines: /proc/vmstat, numastat, cgroup cpu.stat, memory.stat, cpuacct.stat."""
    values: dict[str, int] = {}
    for line in text.split("\n"):
        key, _, value = line.partition(" ")
        number = _int(value)
        if number is not None:
            values[key] = number
    return values


def parse_pressure(text: str) -> Pressure:
    """A PSI file: "some avg10=4.23 avg60=1.20 avg300=0.54 total=3955120" and a "full" line."""
    lines: dict[str, PsiLine] = {}
    for line in text.split("\n"):
        kind, _, rest = line.partition(" ")
        if kind not in ("some", "full"):
            continue
        fields = {}
        for pair in rest.split():
            key, _, value = pair.partition("=")
            fields[key] = value
        lines[kind] = PsiLine(
            float(fields["avg10"]), float(fields["avg60"]), float(fields["avg300"]), int(fields["total"])
        )
    return Pressure(**lines)


def parse_diskstats(text: str) -> dict[str, DiskStats]:
    """/proc/diskstats: 14 columns before 4.18, 18 with discards, 20 with flushes (5.5+).

    The 7-column partition lines of 2.6-era kernels carry no io_ticks and are skipped.
    """
    disks: dict[str, DiskStats] = {}
    for line in text.split("\n"):
        f = line.split()
        if len(f) < 14:
            continue
        # After major, minor, name: reads, reads merged, sectors read, ms reading, writes, writes
        # merged, sectors written, ms writing, in flight, io_ticks (ms busy), weighted ms.
        disks[f[2]] = DiskStats(int(f[3]), int(f[5]), int(f[7]), int(f[9]), int(f[12]))
    return disks


def parse_net_dev(text: str) -> dict[str, dict[str, int]]:
    """/proc/net/dev: interface -> {"receive_bytes": ..., "transmit_colls": ...}.

    The interface name ends at the colon; old kernels print no space between it and a large byte
    count ("eth0:123456"), so split on the colon rather than on whitespace.
    """
    nics: dict[str, dict[str, int]] = {}
    for line in text.split("\n"):
        name, colon, counters = line.partition(":")
        if not colon or "|" in line:
            continue
        values = counters.split()
        if len(values) < len(NET_DEV_FIELDS):
            continue
        nics[name.strip()] = dict(zip(NET_DEV_FIELDS, map(int, values)))
    return nics


def parse_numa_stat(text: str) -> dict[str, dict[int, int]]:
    """memory.numa_stat, both versions: key -> {node: amount}.

    v1 prints pages as "total=5191 N0=5191 N1=0" (plus hierarchical_* lines); v2 prints bytes
    as "anon N0=2121728 N1=0". The units differ; the caller knows which version it read.
    """
    stats: dict[str, dict[int, int]] = {}
    for line in text.split("\n"):
        fields = line.split()
        if not fields:
            continue
        per_node: dict[int, int] = {}
        for field in fields[1:]:
            node, _, amount = field.partition("=")
            if node.startswith("N"):
                per_node[int(node[1:])] = int(amount)
        stats[fields[0].partition("=")[0]] = per_node
    return stats


def parse_cpuacct_usage_all(text: str) -> dict[int, tuple[int, int]]:
    """cgroup v1 cpuacct.usage_all: cpu -> (user ns, system ns), after a "cpu user system" header."""
    usage: dict[int, tuple[int, int]] = {}
    for line in text.split("\n")[1:]:
        fields = line.split()
        if len(fields) == 3:
            usage[int(fields[0])] = (int(fields[1]), int(fields[2]))
    return usage


def parse_io_stat(text: str) -> dict[str, dict[str, int]]:
    """cgroup v2 io.stat: "MAJ:MIN rbytes=.. wbytes=.. rios=.. wios=.. dbytes=.. dios=..".

    With iocost enabled lines also carry "cost.vrate=135.04" and similar; non-integers are skipped.
    """
    devices: dict[str, dict[str, int]] = {}
    for line in text.split("\n"):
        fields = line.split()
        if not fields:
            continue
        stats = devices.setdefault(fields[0], {})
        for field in fields[1:]:
            key, _, value = field.partition("=")
            number = _int(value)
            if number is not None:
                stats[key] = number
    return devices


def parse_blkio(text: str) -> dict[str, dict[str, int]]:
    """cgroup v1 blkio.throttle.io_service_bytes / io_serviced: "8:0 Read 4096" lines.

    Returns device -> {"Read": n, "Write": n, ...}; the closing "Total n" line is dropped.
    """
    devices: dict[str, dict[str, int]] = {}
    for line in text.split("\n"):
        fields = line.split()
        if len(fields) == 3:
            devices.setdefault(fields[0], {})[fields[1]] = int(fields[2])
    return devices
