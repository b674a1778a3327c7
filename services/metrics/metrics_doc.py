"""Print the table of every metric the agent writes: `python -m services.metrics.metrics_doc`.

The table comes from `metrics_list.METRICS`, the list the tests check every sampled metric
against; scripts/docs_reference.py writes it into docs/reference/metrics.md, and tests/test_docs.py
fails when that page is out of date.
"""

from __future__ import annotations

from schemas.metric_scopes import SCOPES
from services.metrics.metrics_list import METRICS


def table() -> str:
    """One row per metric, grouped by scope in the order of `SCOPES`."""
    order = list(SCOPES)
    lines = ["| scope | ids | metric | unit | meaning |", "|---|---|---|---|---|"]
    for m in sorted(METRICS, key=lambda m: order.index(m.scope)):
        ids = ", ".join(f"`{name}`" for name in SCOPES[m.scope]) or "-"
        lines.append(f"| {m.scope} | {ids} | `{m.name}` | {m.unit} | {m.description.replace('|', '/')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
