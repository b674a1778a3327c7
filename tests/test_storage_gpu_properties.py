"""Property tests of the storage and gpu plugins' calculations.

For random nodes (already partly used by earlier deploys) and random requests:
- applying every plan one calculation returns never over-allocates a volume, disk, budget or card;
- deploy then release (apply_workloads incr, then decr) puts usage back exactly, and so does a realloc delta;
- deploy_capacity is exactly what calculate_deploy places: that many succeed, one more fails;
- malformed input of any shape raises a BerthError, never anything else.

The strategies are shaped so that most examples reach the arithmetic: nodes mostly have room
(volumes, a storage budget and IO quota to spare), requests mostly ask for a few small bindings,
realloc deltas mostly stay within what the workload holds, and gpu requests mostly name the node's
cards. Each test labels its examples with `event()` ("arithmetic", "edge: ...", "refused: ...") and
rejects those with nothing to check with `assume()`: `pytest --hypothesis-show-statistics` shows
the shares.
"""

from __future__ import annotations

import contextlib

import msgspec
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from schemas.errors import BerthError
from services.allocation.plugins.gpu import GpuPlugin
from services.allocation.plugins.storage import StoragePlugin
from services.allocation.plugins.storage.plans import Host, volume_plans
from services.allocation.plugins.storage.types import StorageNode
from services.allocation.plugins.storage.volumes import parse_binding

# Fewer examples than before the strategies were shaped, yet more of them reach the arithmetic.
MODERATE = settings(max_examples=70, deadline=None)
MAX_DEPLOY = 20  # small, so that requests do reach the plan cap
MOUNT_PATHS = ["/data0/logs", "/data1", "/tmp"]

storage = StoragePlugin(max_deploy_count=MAX_DEPLOY)
gpu = GpuPlugin()


# --- storage strategies --------------------------------------------------------------------------------

def mostly(common: st.SearchStrategy, rare: st.SearchStrategy) -> st.SearchStrategy:
    """`common` three times in four, `rare` otherwise (`one_of` would pick each half the time)."""
    return st.sampled_from([True, True, True, False]).flatmap(lambda usual: common if usual else rare)


def sized(low: int, high: int, *, rare_low: int, rare_high: int) -> st.SearchStrategy[int]:
    return mostly(st.integers(low, high), st.integers(rare_low, rare_high))


SIZES = sized(1, 10, rare_low=1, rare_high=30)
BUDGETS = sized(0, 20, rare_low=0, rare_high=40)
io_quota = st.tuples(*[mostly(st.integers(10, 40), st.integers(0, 40))] * 4)
io_ask = mostly(st.none(), st.tuples(*[sized(0, 3, rare_low=0, rare_high=8)] * 4))  # IO needs a disk's quota


@st.composite
def storage_nodes(draw) -> tuple[dict, dict]:
    """A fresh node: up to 4 volumes /dataN, up to 2 disks holding some of them (and maybe /)."""
    roomy = st.lists(st.integers(20, 60), min_size=1, max_size=4)
    sizes = draw(mostly(roomy, st.lists(st.integers(0, 60), max_size=4)))
    disk_count = draw(sized(1, 2, rare_low=0, rare_high=2))
    mounts: list[list[str]] = [[] for _ in range(disk_count)]
    if disk_count and draw(st.booleans()):
        mounts[0].append("/")
    for index in range(len(sizes)):
        # mostly on a disk (a volume outside every disk has no IO quota)
        owner = draw(sized(0, disk_count - 1, rare_low=-1, rare_high=disk_count - 1)) if disk_count else -1
        if owner >= 0:
            mounts[owner].append(f"/data{index}")
    disks = [f"/dev/sd{i}:{','.join(m)}:{':'.join(map(str, draw(io_quota)))}" for i, m in enumerate(mounts)]
    request = {
        "volumes": [f"/data{i}:{size}" for i, size in enumerate(sizes)],
        "storage": draw(mostly(st.integers(60, 200), st.integers(0, 200))),
        "disks": disks,
    }
    return storage.add_node(request, None)


def _io(io: tuple[int, int, int, int] | None) -> str:
    return "" if io is None else ":" + ":".join(map(str, io))


@st.composite
def binding(draw, index: int, sizes: st.SearchStrategy[int], ios: st.SearchStrategy) -> str:
    """One binding of a random kind. Destinations are indexed (a request never mounts one twice) and
    fix the kind and source, so a realloc delta with the same index names the same binding."""
    kind = draw(st.sampled_from(["normal", "monopoly", "unlimited", "mount"]))
    if kind == "normal":
        return f"AUTO:/n{index}:rw:{draw(sizes)}{_io(draw(ios))}"
    if kind == "monopoly":
        return f"AUTO:/m{index}:rwm:{draw(sizes)}{_io(draw(ios))}"
    if kind == "unlimited":
        return f"AUTO:/u{index}"
    return f"{MOUNT_PATHS[index % len(MOUNT_PATHS)]}:/p{index}:rw:0{_io(draw(ios))}"


@st.composite
def storage_requests(draw, sizes=SIZES, ios=io_ask, storage=BUDGETS) -> dict:
    count = draw(mostly(st.integers(1, 3), st.integers(0, 3)))
    request: dict = {"volumes": [draw(binding(index, sizes, ios)) for index in range(count)]}
    if draw(st.booleans()):
        request["storage"] = draw(storage)
    return request


@st.composite
def used_storage_nodes(draw) -> tuple[dict, dict, list[dict]]:
    """A node with 0 to 2 earlier deploys committed: (capacity, usage, the workloads on it)."""
    capacity, usage = draw(storage_nodes())
    workloads: list[dict] = []
    for _ in range(draw(st.integers(0, 2))):
        request, count = draw(storage_requests()), draw(st.integers(1, 3))
        if storage.deploy_capacity(capacity, usage, request).capacity >= count:
            _, placed = storage.calculate_deploy(capacity, usage, count, request)
            usage = storage.apply_workloads(usage, placed, True)
            workloads += placed
    return capacity, usage, workloads


def needs_planning(request: dict) -> bool:
    return any(parse_binding(text, "v").needs_planning for text in request["volumes"])


# --- storage properties --------------------------------------------------------------------------------


@MODERATE
@given(used_storage_nodes(), storage_requests())
def test_storage_plans_of_one_calculation_fit_together(node, request):
    capacity, usage, _ = node
    # every plan volume_plans offers, applied at once, stays within each volume and disk
    cap, used = msgspec.convert(capacity, StorageNode), msgspec.convert(usage, StorageNode)
    bindings = [parse_binding(text, "v") for text in request["volumes"]]
    host = Host.of(cap, used)
    for plan in volume_plans(host, bindings, MAX_DEPLOY):
        for placement in plan.volumes.values():
            host.used[placement.device] += placement.size
        for disk, io in plan.disks.items():
            host.quota[disk] = host.quota[disk] - io
    assert all(host.free(device) >= 0 for device in host.size)
    assert all(min(quota.values()) >= 0 for quota in host.quota.values())
    # and so does a whole deploy of `capacity` instances, storage budget included
    count = storage.deploy_capacity(capacity, usage, request).capacity
    event("arithmetic" if count else "edge: nothing fits")
    _, workloads = storage.calculate_deploy(capacity, usage, count, request)
    storage.validate_record(capacity, storage.apply_workloads(usage, workloads, True))


@MODERATE
@given(used_storage_nodes(), storage_requests())
def test_storage_deploy_then_release_is_exact(node, request):
    capacity, usage, earlier = node
    count = min(storage.deploy_capacity(capacity, usage, request).capacity, 3)
    event("arithmetic" if count else "edge: nothing fits")
    _, workloads = storage.calculate_deploy(capacity, usage, count, request)
    committed = storage.apply_workloads(usage, workloads, True)
    assert storage.apply_workloads(committed, workloads, False) == usage
    assert storage.diffs(capacity, committed, earlier + workloads) == []


@MODERATE
@given(used_storage_nodes(), storage_requests())
def test_storage_engine_params_follow_from_the_workload_resource(node, request):
    # an allocate's answer is rebuilt from the ledger on a retry: the params must be the deploy's own
    capacity, usage, _ = node
    count = min(storage.deploy_capacity(capacity, usage, request).capacity, 3)
    event("arithmetic" if count else "edge: nothing fits")
    params, workloads = storage.calculate_deploy(capacity, usage, count, request)
    assert [storage.engine_params(workload) for workload in workloads] == params


@MODERATE
@given(used_storage_nodes(), storage_requests())
def test_storage_capacity_is_what_deploy_places(node, request):
    capacity, usage, _ = node
    count = storage.deploy_capacity(capacity, usage, request).capacity
    # eru caps the *reported* capacity of a request that needs no volume or IO at max_deploy_count
    # while its deploy is bounded by the storage budget alone; only there can one more still fit.
    assume(needs_planning(request) or count < MAX_DEPLOY)
    event("arithmetic" if count else "edge: nothing fits")
    storage.calculate_deploy(capacity, usage, count, request)
    try:
        storage.calculate_deploy(capacity, usage, count + 1, request)
    except BerthError as error:
        assert error.code == "insufficient_resource"
    else:
        raise AssertionError(f"{count + 1} instances fit where capacity said {count}")


# A realloc request over the same destinations, so it grows, shrinks, adds or drops bindings:
# mostly small changes (a shrink below what a binding holds is refused, now and then).
storage_deltas = storage_requests(
    sizes=sized(0, 5, rare_low=-20, rare_high=20),
    ios=st.none() | st.tuples(*[sized(0, 2, rare_low=-4, rare_high=4)] * 4),
    storage=mostly(st.integers(0, 5), st.integers(-20, 20)),
)


@MODERATE
@given(used_storage_nodes(), storage_requests(), storage_deltas)
def test_storage_realloc_delta_accounts_exactly(node, request, delta):
    capacity, usage, earlier = node
    assume(storage.deploy_capacity(capacity, usage, request).capacity >= 1)  # a workload to realloc
    _, [workload] = storage.calculate_deploy(capacity, usage, 1, request)
    usage = storage.apply_workloads(usage, [workload], True)
    try:
        _, change, new = storage.calculate_realloc(capacity, usage, workload, delta)
    except BerthError as error:
        event(f"refused: {error.code}")
        assert error.code in {
            "insufficient_resource",
            "invalid_volume",
            "invalid_storage",
            "invalid_argument",
        }
        return
    event("arithmetic")
    after = storage.apply_workloads(usage, [change], True)
    storage.validate_record(capacity, after)
    assert storage.diffs(capacity, after, [*earlier, new]) == []
    assert storage.apply_workloads(after, [change], False) == usage


# --- gpu -----------------------------------------------------------------------------------------------

PRODUCTS = ["a100", "h100", "nvidia-3090"]
gpu_maps = st.dictionaries(st.sampled_from(PRODUCTS), st.integers(1, 4), min_size=1)


@st.composite
def used_gpu_nodes(draw) -> tuple[dict, dict, list[dict]]:
    cards = mostly(
        st.dictionaries(st.sampled_from(PRODUCTS), st.integers(4, 12), min_size=1),
        st.dictionaries(st.sampled_from(PRODUCTS), st.integers(0, 12)),  # maybe no card at all
    )
    capacity, usage = gpu.add_node({"prod_count_map": draw(cards)}, None)
    workloads: list[dict] = []
    for _ in range(draw(st.integers(0, 3))):
        request = {"prod_count_map": draw(gpu_maps)}
        count = min(gpu.deploy_capacity(capacity, usage, request).capacity, draw(st.integers(1, 3)))
        _, placed = gpu.calculate_deploy(capacity, usage, count, request)
        usage = gpu.apply_workloads(usage, placed, True)
        workloads += placed
    return capacity, usage, workloads


@st.composite
def gpu_scenarios(draw) -> tuple[tuple[dict, dict, list[dict]], dict[str, int]]:
    """A used node, and cards to ask for: mostly a few of those it has free, any now and then."""
    node = draw(used_gpu_nodes())
    capacity, usage, _ = node
    free = {
        product: count - usage["prod_count_map"].get(product, 0)
        for product, count in capacity["prod_count_map"].items()
        if count > usage["prod_count_map"].get(product, 0)
    }
    if not free:
        return node, draw(gpu_maps)
    fitting = st.dictionaries(
        st.sampled_from(sorted(free)), st.integers(1, 2), min_size=1
    ).filter(lambda cards: all(cards[p] <= free[p] for p in cards))
    return node, draw(mostly(fitting, gpu_maps))


@MODERATE
@given(gpu_scenarios())
def test_gpu_deploy_capacity_fits_exactly_and_releases_exactly(scenario):
    # only non-empty requests: an empty one reports 1 000 000 (eru) yet deploys any count
    (capacity, usage, earlier), cards = scenario
    request = {"prod_count_map": cards}
    count = gpu.deploy_capacity(capacity, usage, request).capacity
    event("arithmetic" if count else "edge: nothing fits")
    params, workloads = gpu.calculate_deploy(capacity, usage, count, request)
    assert [gpu.engine_params(workload) for workload in workloads] == params  # what a retry rebuilds
    committed = gpu.apply_workloads(usage, workloads, True)
    gpu.validate_record(capacity, committed)  # never over-allocated
    assert gpu.diffs(capacity, committed, earlier + workloads) == []
    assert gpu.apply_workloads(committed, workloads, False) == usage
    try:
        gpu.calculate_deploy(capacity, usage, count + 1, request)
    except BerthError as error:
        assert error.code == "insufficient_resource"
    else:
        raise AssertionError(f"{count + 1} instances fit where capacity said {count}")


@MODERATE
@given(gpu_scenarios(), st.data())
def test_gpu_realloc_delta_accounts_exactly(scenario, data):
    (capacity, usage, earlier), cards = scenario
    request = {"prod_count_map": cards}
    assume(gpu.deploy_capacity(capacity, usage, request).capacity >= 1)  # a workload to realloc
    _, [workload] = gpu.calculate_deploy(capacity, usage, 1, request)
    usage = gpu.apply_workloads(usage, [workload], True)
    # Mostly within what the workload holds and one more card; any change now and then.
    held = workload["prod_count_map"]
    within = st.fixed_dictionaries({product: st.integers(-count, 1) for product, count in held.items()})
    delta = data.draw(mostly(within, st.dictionaries(st.sampled_from(PRODUCTS), st.integers(-5, 5))))
    try:
        _, change, new = gpu.calculate_realloc(capacity, usage, workload, {"prod_count_map": delta})
    except BerthError as error:
        event(f"refused: {error.code}")
        assert error.code == "insufficient_resource"
        return
    event("arithmetic")
    after = gpu.apply_workloads(usage, [change], True)
    gpu.validate_record(capacity, after)
    assert gpu.diffs(capacity, after, [*earlier, new]) == []
    assert gpu.apply_workloads(after, [change], False) == usage


# --- no panics -----------------------------------------------------------------------------------------

junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=3),
    max_leaves=8,
)
storage_keys = st.sampled_from(
    ["volumes", "volume", "volumes-request", "storage", "storage-limit", "disks", "rm-disks"]
)


@MODERATE
@given(
    st.dictionaries(storage_keys, junk, max_size=3),
    st.dictionaries(st.sampled_from(["prod_count_map"]), junk),
)
def test_malformed_input_only_ever_raises_berth_errors(storage_junk, gpu_junk):
    capacity, usage = storage.add_node({"volumes": ["/data0:10"], "disks": ["/dev/sda:/:1:1:1:1"]}, None)
    gpu_node = gpu.add_node({"prod_count_map": {"a100": 2}}, None)
    calls = [
        lambda: storage.calculate_deploy(capacity, usage, 1, storage_junk),
        lambda: storage.deploy_capacity(capacity, usage, storage_junk),
        lambda: storage.add_node(storage_junk, None),
        lambda: storage.set_capacity(capacity, usage, None, storage_junk, True, True),
        lambda: storage.set_usage(capacity, usage, storage_junk, None, [], False, True),
        lambda: storage.calculate_realloc(capacity, usage, storage_junk, storage_junk),
        lambda: storage.validate_record(storage_junk, usage),
        lambda: gpu.calculate_deploy(*gpu_node, 1, gpu_junk),
        lambda: gpu.calculate_realloc(*gpu_node, gpu_junk, gpu_junk),
        lambda: gpu.set_usage(*gpu_node, gpu_junk, None, [gpu_junk], True, True),
    ]
    accepted = 0
    for call in calls:
        with contextlib.suppress(BerthError):
            call()
            accepted += 1
    event(f"calls that took the junk: {accepted} of {len(calls)}")
