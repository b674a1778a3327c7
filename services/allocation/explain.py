"""Says why a request was refused: reads the selected nodes again, on the refusal path only, and
has refusal.py judge them. The explanation is a courtesy: if it cannot be made (the store fails
meanwhile), the refusal goes out as it was."""

from __future__ import annotations

import logging

from schemas.errors import BerthError
from services.allocation.fleet import Fleet
from services.allocation.plugins.plugin_set import Keyed, PluginSet
from services.allocation.records import NodeRecord
from services.allocation.refusal import Memo, Verdict, explain, judge
from services.allocation.selection import Selection
from services.allocation.store import NodeStore

log = logging.getLogger("berth.allocation")
CHUNK = 1000  # records read (and judged) at a time


class Explainer:
    def __init__(self, store: NodeStore, fleet: Fleet, plugins: PluginSet) -> None:
        self.store = store
        self.fleet = fleet
        self.plugins = plugins

    async def allocate(
        self, error: BerthError, nodes: Selection, strategy: str, count: int, requests: Keyed
    ) -> BerthError:
        """`error` with why an allocate of `count` instances on `nodes` was refused. A node is
        wanted for one instance when the strategy spreads or packs over a selection; for all of
        them when it is named alone, and for `count` under `each` (at most `count` fit on it)."""
        whole = strategy == "each" or nodes.single is not None
        need, most = (count, count) if whole else (1, None)
        try:
            memo: Memo = {}
            verdicts: list[Verdict] = []
            names = await self._candidates(nodes)
            for start in range(0, len(names), CHUNK):
                records = await self.store.load_many(names[start:start + CHUNK])
                verdicts += [
                    judge(record, self.plugins, requests, need, memo=memo) for record in records.values()
                    if record is not None and nodes.admits(record.name, record.labels)
                ]
            return explain(error, verdicts, need, most)
        except Exception:
            log.warning("could not explain a refusal; it goes out unexplained", exc_info=True)
            return error

    def calculation(self, error: BerthError, record: NodeRecord, count: int, requests: Keyed) -> BerthError:
        """`error` with why a calculate-deploy of `count` instances on `record`'s node was refused
        (it calculates whatever the node's status)."""
        try:
            verdict = judge(record, self.plugins, requests, count, statuses=False)
            return explain(error, [verdict], count, count)
        except Exception:
            log.warning("could not explain a refusal; it goes out unexplained", exc_info=True)
            return error

    async def _candidates(self, nodes: Selection) -> list[str]:
        """The nodes a selection names, or those whose labels match, down and draining ones included."""
        if nodes.names is not None:
            return list(dict.fromkeys(nodes.names.names))
        await self.fleet.follow_directory()
        return self.fleet.directory.select(nodes.labels or {})
