"""The operator interface: where a resource's instances actually run.

The broker only talks to this interface, so a new platform (Kubernetes, say) is one more class:
validate a param, say which capacity block it draws from and how much is free there, launch (or
scale: `launch` makes `spec.instances` instances exist, whatever already runs), report status,
count the instances still running, release.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from schemas.broker import BlockDetail, Endpoint, ResourceParam, ServiceInfo


def service_info(endpoints: list[Endpoint], instances: int, starting: int, exited: int, lost: int = 0) -> ServiceInfo:
    """crm's service status from what the instances do: `staging` while one is still starting,
    then `failed` if one exited or was lost with its node, else `running`."""
    if not instances or starting:
        status, message = "staging", f"{len(endpoints)} of {instances} instances ready"
    elif exited or lost:
        status = "failed"
        message = "; ".join(f"{count} of {instances} instances {how}" for count, how in
                            ((exited, "exited"), (lost, "were lost with their node")) if count)
    else:
        status, message = "running", ""
    return ServiceInfo(status, message, instances, len(endpoints), endpoints)


class OperatorError(Exception):
    """The platform could not do what was asked (the message says why)."""


@dataclass(frozen=True)
class LaunchSpec:
    user: str
    resource_id: str
    param: ResourceParam
    instances: int


class Operator(Protocol):
    name: str

    def validate(self, param: ResourceParam) -> None:
        """Raise `InvalidArgument` (field under `param.`) if this operator cannot run `param`."""

    def block_key(self, param: ResourceParam) -> str:
        """The capacity block `param` draws from (crm: "<platform>/<city>")."""

    async def free_instances(self, param: ResourceParam) -> int:
        """Instances of `param`'s block the platform can still start (before reservations)."""

    async def blocks(self) -> list[BlockDetail]:
        """Every capacity block as the operator sees it, nothing reserved (`views.unreserved`)."""

    async def launch(self, spec: LaunchSpec) -> None:
        """Make `spec.instances` instances exist; idempotent (a retry adopts what already runs)."""

    async def status(self, user: str, resource_id: str) -> ServiceInfo: ...

    async def running_instances(self, user: str, resource_ids: list[str]) -> list[int]:
        """Instances of each resource still running: a cheap check (no network probe) that they
        have not died, for a whole pool at once."""

    async def lost_instances(self, user: str, resource_id: str) -> int:
        """Instances of the resource lost with their node (down, gone, or its agent runs them no
        more): the platform's failure, not the resource's."""

    async def release(self, user: str, resource_id: str, instances: int) -> None:
        """Stop and forget every instance; a resource with nothing running is released at once."""
