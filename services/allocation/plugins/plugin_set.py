"""The worker's plugins as one set: fan a question out to each selected plugin and merge the answers.

Like eru's `schedule/`, this is synchronous, deterministic and free of I/O: callers load node
records, ask the set, and commit what it returns. Every method works on `States`, the selected
plugins' stored states of one node (plugin name -> `PluginState`), and on per-plugin inputs
(`Keyed`: plugin name -> that plugin's map, None where none was given). Answers are per plugin
too; the transport (endpoints.py) turns them into the wire shape of either level.

Two memo caches live here, keyed by a plugin's stored bytes: nodes in the same state (a fleet of
identical machines) are planned once. Their results are never mutated. Each holds at most
`MEMO_BYTES` (`bus.caches.Memo`, the oldest first out): under a steady load every commit makes
states never seen before, and a memo without a bound in bytes grew a worker by hundreds of MB.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from msgspec import Struct

from bus.caches import Memo
from services.allocation.errors import node_not_found
from services.allocation.plugins.interface import DeployCapacity, EngineInfo, NamingPlugin, ResourcePlugin
from services.allocation.records import NodeRecord, PluginState, decode_state, encode_state

Raw = dict[str, Any]
Keyed = dict[str, Raw | None]  # plugin name -> that plugin's part of a request or resource
States = dict[str, PluginState]  # plugin name -> one node's stored state for it

MEMO_BYTES = 16 << 20  # each memo's bound (docs/operations/sizing.md, "What a worker keeps")
_ENTRY = 200  # a memo entry's own bytes beside the state it is keyed by: tuples, a Struct, dict slots


class Deployment(Struct):
    """One engine-params and one workload-resource map (keyed by plugin) per instance."""

    engines_params: list[Raw]
    workloads_resource: list[Raw]


class Reallocation(Struct):
    """A realloc's answer, each map keyed by plugin."""

    engine_params: Raw
    delta_resource: Raw
    workload_resource: Raw


class StateChange(Struct):
    """The selected plugins' states of a node before and after a change."""

    before: States
    after: States


class NodeInfo(Struct):
    """The selected plugins' states of a node, and how their usage differs from its workloads."""

    states: States
    diffs: list[str]


class PluginSet:
    """The plugins by name, in their configured order (which is the order of every answer)."""

    def __init__(self, plugins: dict[str, ResourcePlugin]) -> None:
        self.plugins = {name: NamingPlugin(plugin) for name, plugin in plugins.items()}
        self._capacity_memo: Memo[tuple[str, bytes, bytes], DeployCapacity] = Memo(
            "allocation capacity memo", MEMO_BYTES, lambda key, _: _ENTRY + len(key[1]) + len(key[2])
        )
        self._deploy_memo: Memo[tuple[str, bytes, bytes, int], tuple[list[Raw], list[Raw], bytes]] = Memo(
            "allocation deploy memo", MEMO_BYTES, _deploy_entry_size
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self.plugins)

    def __len__(self) -> int:
        return len(self.plugins)

    def __contains__(self, name: object) -> bool:
        return name in self.plugins

    def __getitem__(self, name: str) -> NamingPlugin:
        return self.plugins[name]

    def covers(self, names: list[str]) -> bool:
        """Whether `names` selects every plugin (a manager-level command)."""
        return len(names) == len(self.plugins)

    def states(self, record: NodeRecord, names: list[str]) -> States:
        """The selected plugins' states of a node; a plugin without a record there is not found."""
        missing = [name for name in names if name not in record.plugins]
        if missing:
            raise node_not_found(record.name, missing[0])
        return {name: record.plugins[name] for name in names}

    # -- calculations -------------------------------------------------------------------------

    def deploy(self, states: States, count: int, requests: Keyed) -> Deployment:
        return per_instance(count, [
            (name, *self.plugins[name].calculate_deploy(state.capacity, state.usage, count, requests[name]))
            for name, state in states.items()
        ])

    def deploy_stored(
        self, node: str, stored: dict[str, bytes], count: int, requests: Keyed, request_keys: dict[str, bytes]
    ) -> tuple[Deployment, dict[str, bytes]]:
        """A deploy of every plugin on a node's stored (encoded) states, and each of those states
        after it, encoded. Memoised on the stored bytes."""
        after: dict[str, bytes] = {}
        answers = []
        for name in self.plugins:
            params, resources, after[name] = self._deploy_on(
                node, stored, name, count, requests[name], request_keys[name]
            )
            answers.append((name, params, resources))
        return per_instance(count, answers), after

    def _deploy_on(
        self, node: str, stored: dict[str, bytes], name: str, count: int, request: Raw | None, request_key: bytes
    ) -> tuple[list[Raw], list[Raw], bytes]:
        """One plugin's deploy on a stored state: (engine params, workload resources, the state after)."""
        raw = stored.get(name)
        if raw is None:
            raise node_not_found(node, name)
        key = (name, raw, request_key, count)
        done = self._deploy_memo.get(key)
        if done is None:
            current = decode_state(raw)
            plugin = self.plugins[name]
            params, resources = plugin.calculate_deploy(current.capacity, current.usage, count, request)
            usage = plugin.apply_workloads(current.usage, resources, True)
            done = self._deploy_memo.put(key, (params, resources, encode_state(PluginState(current.capacity, usage))))
        return done

    def realloc(self, states: States, workload: Keyed, requests: Keyed) -> Reallocation:
        engine, delta, resource = {}, {}, {}
        for name, state in states.items():
            engine[name], delta[name], resource[name] = self.plugins[name].calculate_realloc(
                state.capacity, state.usage, workload.get(name) or {}, requests[name]
            )
        return Reallocation(engine, delta, resource)

    def reallocated(self, states: States, current: Raw, resource: Raw) -> States:
        """The states once a workload gives back its `current` resource and takes `resource`."""
        after = {}
        for name, state in states.items():
            plugin = self.plugins[name]
            returned = plugin.apply_workloads(state.usage, split([current], name), False)
            after[name] = PluginState(state.capacity, plugin.apply_workloads(returned, [resource[name]], True))
        return after

    def engine_params(self, workload: Raw) -> Raw:
        """The engine params (keyed by plugin) an instance holding `workload` was deployed with."""
        return {name: plugin.engine_params(workload.get(name) or {}) for name, plugin in self.plugins.items()}

    def remap(self, states: States, workloads: dict[str, Keyed]) -> dict[str, Raw]:
        """Workload id -> new engine params (keyed by plugin) of the workloads whose binding changes."""
        remapped: dict[str, Raw] = {}
        for name, state in states.items():
            parts = {wid: (workload or {}).get(name) or {} for wid, workload in workloads.items()}
            for wid, params in self.plugins[name].calculate_remap(state.capacity, state.usage, parts).items():
                remapped.setdefault(wid, {})[name] = params
        return dict(sorted(remapped.items()))

    def capacity_function(
        self, names: list[str], requests: Keyed, request_keys: dict[str, bytes], *, strict: bool
    ) -> Callable[[NodeRecord], DeployCapacity | None]:
        """A record's merged capacity for the request (None: no room), memoised on each plugin's
        stored bytes. A node without a record for one of the plugins is an error for a listed node
        (`strict`), else it has no room."""
        memo = self._capacity_memo

        def compute(record: NodeRecord) -> DeployCapacity | None:
            entries = []
            for name in names:
                raw = record.raw.get(name)
                if raw is None:
                    if strict:
                        raise node_not_found(record.name, name)
                    return None
                key = (name, raw, request_keys[name])
                capacity = memo.get(key)
                if capacity is None:
                    state = record.plugins[name]
                    capacity = memo.put(key, self.plugins[name].deploy_capacity(state.capacity, state.usage,
                                                                                requests[name]))
                if capacity.capacity <= 0:
                    return None
                entries.append(capacity)
            return merge_capacities(entries)

        return compute

    def most_idle(self, names: list[str], nodes: dict[str, States]) -> tuple[str, int]:
        """The most idle node by the highest-priority plugin, and that priority; ties go to the
        smallest name."""
        best: tuple[str, int] | None = None
        for name in names:
            plugin = self.plugins[name]
            loads = {node: plugin.load(states[name].capacity, states[name].usage) for node, states in nodes.items()}
            if best is None or plugin.priority > best[1]:
                best = (least_loaded(loads), plugin.priority)
        assert best is not None
        return best

    def metrics_description(self, names: list[str]) -> list[Raw]:
        return [description for name in names for description in self.plugins[name].metrics_description()]

    def metrics(self, states: States, podname: str, node: str) -> list[Raw]:
        return [
            metric
            for name, state in states.items()
            for metric in self.plugins[name].metrics(podname, node, state.capacity, state.usage)
        ]

    def diffs(self, states: States, workloads: Iterable[Raw | None]) -> list[str]:
        """How each plugin's usage differs from what the workloads (keyed by plugin) explain."""
        workloads = list(workloads)
        return [
            diff
            for name, state in states.items()
            for diff in self.plugins[name].diffs(state.capacity, state.usage, split(workloads, name))
        ]

    # -- new states ---------------------------------------------------------------------------

    def added(self, names: list[str], resources: Keyed, info: EngineInfo | None) -> States:
        """A new node's states from its node requests (else engine info)."""
        return {name: PluginState(*self.plugins[name].add_node(resources[name], info)) for name in names}

    def validate(self, states: States) -> None:
        """Refuse states that must not be stored (set-node-resource-info)."""
        for name, state in states.items():
            self.plugins[name].validate_record(state.capacity, state.usage)

    def with_capacity(self, states: States, resources: Keyed, requests: Keyed, delta: bool, incr: bool) -> States:
        return {
            name: PluginState(*self.plugins[name].set_capacity(
                state.capacity, state.usage, resources[name], requests[name], delta, incr))
            for name, state in states.items()
        }

    def with_usage(
        self, states: States, resources: Keyed, requests: Keyed, workloads: list[Raw], delta: bool, incr: bool
    ) -> States:
        return {
            name: PluginState(state.capacity, self.plugins[name].set_usage(
                state.capacity, state.usage, resources[name], requests[name], split(workloads, name), delta, incr))
            for name, state in states.items()
        }

    def fixed(self, states: States, workloads: list[Raw]) -> States:
        """The states with usage rewritten to what the workloads explain."""
        return {
            name: PluginState(state.capacity, self.plugins[name].usage_from_workloads(state.capacity, split(workloads, name)))
            for name, state in states.items()
        }

    def released(self, states: States, workloads: list[Raw]) -> States:
        """The states of the plugins this set knows once the workloads give their resources back."""
        return {
            name: PluginState(state.capacity, self.plugins[name].apply_workloads(state.usage, split(workloads, name), False))
            for name, state in states.items()
            if name in self.plugins
        }


def per_instance(count: int, answers: list[tuple[str, list[Raw], list[Raw]]]) -> Deployment:
    """Each plugin's (name, engine params, workload resources) merged into maps keyed by plugin,
    one per instance."""
    engines: list[Raw] = [{} for _ in range(count)]
    workloads: list[Raw] = [{} for _ in range(count)]
    for name, params, resources in answers:
        for i in range(count):
            engines[i][name] = params[i]
            workloads[i][name] = resources[i]
    return Deployment(engines, workloads)


def merge_capacities(entries: list[DeployCapacity]) -> DeployCapacity:
    """One node's capacity over the plugins, as eru core merges it (reference §5.2) with its
    deliberate fixes: the minimum capacity, and a proper weighted mean of rate and usage."""
    weight = sum(e.weight for e in entries)
    return DeployCapacity(
        capacity=min(e.capacity for e in entries),
        usage=sum(e.usage * e.weight for e in entries) / weight if weight else 0.0,
        rate=sum(e.rate * e.weight for e in entries) / weight if weight else 0.0,
        weight=weight,
    )


def least_loaded(loads: dict[str, float]) -> str:
    """The node with the smallest load; ties go to the smallest name."""
    return min(loads.items(), key=lambda item: (item[1], item[0]))[0]


def split(workloads: Iterable[Raw | None], name: str) -> list[Raw]:
    """One plugin's part of each workload resource keyed by plugin."""
    return [(workload or {}).get(name) or {} for workload in workloads]


def capacities(states: States) -> Raw:
    return {name: state.capacity for name, state in states.items()}


def usages(states: States) -> Raw:
    return {name: state.usage for name, state in states.items()}


def _deploy_entry_size(key: tuple[str, bytes, bytes, int], done: tuple[list[Raw], list[Raw], bytes]) -> int:
    """A deploy memo entry's bytes: the state before and after, and about what an instance's
    params and resource take (encoded, a bound instance of every plugin is under 1 KiB)."""
    return _ENTRY + len(key[1]) + len(key[2]) + len(done[2]) + 1024 * len(done[0])
