"""What a provisioner produces: a `Sample` of one metric of one entity, named by its `Ids`.

Small on purpose: the wire module (schemas/metrics.py) and the store use these types without importing
anything that reads the kernel.
"""

from __future__ import annotations

import msgspec

from schemas.metric_scopes import Ids


class Sample(msgspec.Struct, frozen=True, gc=False):
    """One metric value. `ids` holds the scope's id values in the order `SCOPES[scope]` names them."""

    scope: str
    ids: Ids
    metric: str
    value: float
    time: float
