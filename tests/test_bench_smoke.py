"""The allocation benchmarks run from a clean clone and print their tables: each at a tiny size, for
a few seconds, against the test servers. No figure is checked (this machine is shared and noisy):
only that every row is there and no placement failed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_bench(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, f"bench/{script}", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_growth_prints_every_measure_at_each_size(nats_url, redis_url):
    table = run_bench("growth.py", "--nats", nats_url, "--redis", redis_url, "--sizes", "40,80",
                      "--placements", "64", "--clients", "4", "--idle", "1")
    assert "| measure | 40 nodes | 80 nodes |" in table
    for measure in ("add-node", "capacity over every node, first call", "allocate spread by label",
                    "allocate pack by label", "list-nodes, every page", "worker memory per node",
                    "worker CPU while idle", "bare echo", "raw Redis Lua"):
        assert measure in table, measure


def cannot_cap_workers() -> str | None:
    """Why bench/scaling.py could not cap its workers here, found as it finds it (its `CpuCaps`
    makes and removes a group of its own under the cgroup cpu controller), or None when it can."""
    from bench.scaling import CpuCaps

    try:
        caps = CpuCaps(0.5)
    except SystemExit as refusal:
        return str(refusal)
    caps.close()
    return None


def test_scaling_prints_the_efficiency_of_capped_workers(nats_url, redis_url):
    """Skipped, with the reason, on a host without a writable cgroup cpu controller (decided before
    the run); anywhere else the bench must run capped and print its table: failing is failing."""
    if (why := cannot_cap_workers()) is not None:
        pytest.skip(f"bench/scaling.py: {why}")
    done = subprocess.run(
        [sys.executable, "bench/scaling.py", "--nats", nats_url, "--redis", redis_url, "--workers", "1,2",
         "--nodes", "40", "--placements", "32", "--clients", "4", "--cpu-quota", "0.5"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| allocate | 1 worker | 2 workers | efficiency at 2 |" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| spread", "| pack"))]
    assert len(rows) == 4 and "errors:" not in done.stdout


def test_scaling_with_fixed_callers_on_a_core_of_their_own_prints_one_worker_with_a_share():
    """`--fixed-clients` adds one worker alone with a share of the callers; `--isolate` pins the
    capped processes to the last core and the servers it starts and the client to the others."""
    if (why := cannot_cap_workers()) is not None:
        pytest.skip(f"bench/scaling.py: {why}")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("bench/scaling.py --isolate needs two cores")
    done = subprocess.run(
        [sys.executable, "bench/scaling.py", "--workers", "1,2", "--fixed-clients", "--isolate",
         "--nodes", "40", "--placements", "32", "--clients", "4", "--cpu-quota", "0.5"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    last = max(os.sched_getaffinity(0))
    assert f"capped processes on CPU {last}, the rest on the others" in done.stdout
    assert "| 1 worker, 2 callers: placements/s, CPU s / 1,000 |" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| spread", "| pack"))]
    assert len(rows) == 4 and all(row.count("|") == 8 for row in rows) and "errors:" not in done.stdout


def test_allocation_bench_prints_cpu_per_placement_beside_the_echo(nats_url, redis_url):
    table = run_bench("allocation.py", "--nats", nats_url, "--redis", redis_url, "--nodes", "40",
                      "--placements", "64", "--clients", "4", "--workers", "1")
    assert table.count("worker CPU") == 4 and table.count("echo CPU") == 2
    assert "errors: none" in table


def test_compare_measures_two_trees_in_the_same_rounds_and_leaves_no_worktree(nats_url, redis_url):
    """bench/compare.py against HEAD (an A/A run here, where the checkout is HEAD): every row with
    both trees' figures and their ratio, and the temporary worktree removed afterwards."""
    table = run_bench("compare.py", "--nats", nats_url, "--redis", redis_url, "--against", "HEAD", "--turns", "2",
                      "--nodes", "20", "--placements", "32", "--clients", "4")
    assert "| row | this checkout | HEAD | this / that, turn by turn |" in table
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| allocate ")]
    assert sorted(row[0].strip() for row in rows) == sorted(
        f"allocate {strategy} by {selector}" for strategy in ("spread", "pack") for selector in ("names", "labels"))
    assert all(float(row[1].split()[0]) >= 0 and float(row[2].split()[0]) >= 0 for row in rows)
    assert "| anchor: bare echo of the labelled request |" in table
    listed = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "berth-compare-" not in listed.stdout
