"""How even `spread` keeps equal nodes (DESIGN.md §8): the most minus the least loaded node of the
selection, after every round of placements, with 1 and 3 workers, at the default `--spread-sample`
(64) beside exact GLOBAL (a sample larger than the selection).

    .venv/bin/python bench/spread.py [--nodes 300] [--names 40] [--clients 48] [--rounds 55]
                                     [--nats URL --redis URL]

Equal empty nodes of 64 cores: `--nodes` selected by label (more than the sample: spread samples)
and `--names` selected by a list of names (at most the sample: spread is exact either way). Every
call places one instance of one core with a unique `request_id`, `--clients` at a time; a round
ends when all of them are answered, and the skew is counted then from the answers (nothing is
released, so the answers are the nodes' load). Each cell: the largest skew seen at any round's
end, and the skew at the last one.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgpack  # noqa: E402
import nats  # noqa: E402

from bench.allocation import Requests, Workers, add_nodes, delete_namespace, delete_stream  # noqa: E402
from bench.servers import given_or_started  # noqa: E402
from bus.redis import connect_redis  # noqa: E402

LABELS = {"bench": "spread"}
ONE_CORE = {"cpumem": {"cpu-request": 1, "memory-request": 1 << 30}}
EXACT = 1_000_000  # a sample larger than any selection: spread is exact GLOBAL


async def skews(args, nats_url: str, redis_url: str, workers: int, sample: int, by_names: bool) -> tuple[int, int]:
    prefix = f"spread{uuid.uuid4().hex[:8]}"
    procs = Workers(nats_url, redis_url, prefix, options=["--spread-sample", str(sample)])
    nc = await nats.connect(nats_url, name="bench-spread")
    try:
        procs.scale(workers)
        names = [f"s{i:05d}" for i in range(args.names if by_names else args.nodes)]
        await add_nodes(nc, prefix, names, 64, LABELS)
        chosen = {"nodenames": names} if by_names else {"labels": LABELS}
        requests = Requests({**chosen, "strategy": "spread", "deploy_count": 1, "workload_resource_request": ONE_CORE})
        load: Counter[str] = Counter(dict.fromkeys(names, 0))
        worst = last = 0
        for _ in range(args.rounds):
            replies = await asyncio.gather(*(placed(nc, prefix, requests) for _ in range(args.clients)))
            load.update(replies)
            last = max(load.values()) - min(load.values())
            worst = max(worst, last)
        return worst, last
    finally:
        procs.stop()
        await delete_stream(nc, prefix)
        await nc.close()
        redis = connect_redis(redis_url)
        await delete_namespace(redis, prefix)
        await redis.aclose()


async def placed(nc, prefix: str, requests: Requests) -> str:
    """The node one allocate placed on (the nodes have room for every round: no error expected)."""
    msg = await nc.request(f"{prefix}.resource.allocate", requests.next(), timeout=30)
    return msgpack.unpackb(msg.data)["allocations"][0]["nodename"]


async def measure(args, nats_url: str, redis_url: str) -> None:
    print(f"spread skew (most - least instances per node), equal nodes, {args.clients} callers, "
          f"{args.rounds} rounds of {args.clients} placements")
    print("| selection | spread | 1 worker: worst / last | 3 workers: worst / last |")
    print("|---|---|---|---|")
    for by_names, selection in ((False, f"{args.nodes} nodes by label"), (True, f"{args.names} nodes by names")):
        for label, sample in (("exact GLOBAL", EXACT), (f"S = {args.sample}", args.sample)):
            cells = []
            for workers in (1, 3):
                worst, last = await skews(args, nats_url, redis_url, workers, sample, by_names)
                cells.append(f"{worst} / {last}")
            print(f"| {selection} | {label} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats")
    parser.add_argument("--redis")
    parser.add_argument("--nodes", type=int, default=300)
    parser.add_argument("--names", type=int, default=40)
    parser.add_argument("--clients", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=55)
    parser.add_argument("--sample", type=int, default=64)
    args = parser.parse_args()
    with given_or_started(args):
        asyncio.run(measure(args, args.nats, args.redis))


if __name__ == "__main__":
    main()
