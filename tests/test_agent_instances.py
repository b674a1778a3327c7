"""The agent's instances with real processes: start, readiness, exit, stop, CPU and memory confinement
(cgroups where this host allows them, CPU affinity otherwise), and adoption by a restarted agent.

Every test runs under a prefix of its own; its processes are found by their marker and its cgroups
under a parent cgroup of its own, and a test that leaves either behind fails.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import pytest_asyncio

from schemas.agent import InstanceInfo, InstanceParam, Owner, StartInstance
from schemas.errors import BerthError, InvalidArgument
from services.agent.cgroups import CgroupRoot
from services.agent.instances import Instances, StateLocked
from services.agent.state import Record, StateDir
from services.processes import procfs
from services.processes.catalog import Catalog
from services.processes.ports import free_port
from tests.agent_helpers import remove_parent_cgroup
from tests.broker_helpers import CATALOG, ROOT, kill_marked, marked_pids
from tests.bus_helpers import eventually

NODE = "n1"
NOBODY_CATALOG = """
[images.http-server-nobody]
argv = ["python3", "$CATALOG_DIR/http_server.py", "--port", "$PORT_HTTP"]
user = "nobody"
"""
HTTP = {"http": "http"}
MiB = 1 << 20


class Agent:
    """An `Instances` and the events it emitted, as (kind, info)."""

    def __init__(self, instances: Instances, events: list[tuple[str, InstanceInfo]]) -> None:
        self.instances = instances
        self.events = events

    def kinds(self, instance: str) -> list[str]:
        return [kind for kind, info in self.events if info.instance == instance]

    def last(self, instance: str, kind: str) -> InstanceInfo:
        return [info for k, info in self.events if info.instance == instance and k == kind][-1]

    async def wait_for(self, instance: str, kind: str) -> InstanceInfo:
        await eventually(lambda: _now(kind in self.kinds(instance)), timeout=30)
        return self.last(instance, kind)

    def info(self, instance: str) -> InstanceInfo | None:
        found, _ = self.instances.get([instance])
        return found[0] if found else None


async def _now(value):
    return value


@pytest.fixture
def tag() -> str:
    """This test's prefix: the markers of its processes start with it."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest_asyncio.fixture
async def cgroup_root(tag):
    """A `CgroupRoot` under a parent cgroup of this test's own, removed at the end; a test that left
    an instance's cgroup behind fails."""
    root = CgroupRoot(parent=f"berth-test-{tag}")
    yield root
    left = await remove_parent_cgroup(root)
    assert not left, f"cgroups left behind: {left}"


@pytest.fixture
def processes(tag):
    """Fails a test that leaves a process of its prefix alive (after killing it)."""
    yield
    left = kill_marked(tag)
    assert not left, f"processes left behind: {left}"


@pytest_asyncio.fixture
async def agent(tmp_path, tag, cgroup_root, processes):
    """`await agent(cgroups=..., state=...)` -> an opened `Agent`; closed at the end (its processes are
    the test's to stop). `cgroups`: "root" (this test's CgroupRoot, the default) or None."""
    opened: list[Instances] = []

    async def make(state: Path | None = None, cgroups: str | None = "root", **options) -> Agent:
        events: list[tuple[str, InstanceInfo]] = []
        options.setdefault("catalog", Catalog.load(CATALOG))
        instances = Instances(
            state_dir=state or tmp_path / "state",
            node=NODE,
            prefix=tag,
            cgroups=cgroup_root if cgroups == "root" else None,
            stop_grace=1.0,
            probe_interval=0.05,
            on_event=lambda kind, info: events.append((kind, info)),
            **options,
        )
        await instances.open()
        opened.append(instances)
        return Agent(instances, events)

    yield make
    for instances in opened:
        await instances.close()


def spec(instance: str, image: str = "http-server", env: dict | None = None, **fields) -> StartInstance:
    return StartInstance(
        instance=instance, param=InstanceParam(image=image, env=env or {}, ports=dict(HTTP)), **fields
    )


def running_with_marker(tag: str, instance: str) -> list[int]:
    """Live processes carrying this instance's marker (a process and its children)."""
    return [pid for marker, pid in marked_pids(tag) if marker == f"{tag}/{NODE}/{instance}"]


def status(pid: int, field: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def cgroup_of(pid: int) -> dict[str, str]:
    """/proc/<pid>/cgroup as {controller: path} (v2's line under "")."""
    found = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            found[controller] = path
    return found


async def get(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.0\r\n\r\n")
    body = await reader.read()
    writer.close()
    return body.decode()


def needs_cgroups(root: CgroupRoot) -> None:
    if os.geteuid() != 0:
        pytest.skip("cgroups: the tests do not run as root")
    if root.mode() != "cgroup":
        pytest.skip(f"cgroups: no writable cpuset hierarchy under {root.mount} (mode {root.mode()})")


def last_cpu() -> int:
    return max(os.sched_getaffinity(0))


def alive(pids: list[int], started: dict[int, int]) -> list[int]:
    """Those of `pids` still running (a zombie waiting for its parent's wait is not)."""
    return [pid for pid in pids if procfs.is_running(pid, started[pid])]


# -- start, readiness, exit, stop -----------------------------------------------------------------


async def test_a_start_is_started_then_ready_and_its_port_answers(agent, tag):
    a = await agent()
    info = await a.instances.start(spec("broker/u/r/0", owner=Owner("u", "r", 0), workload_id="w1"))
    assert info.state == "starting" and info.pid > 0 and info.address == "127.0.0.1"
    ready = await a.wait_for("broker/u/r/0", "ready")
    assert ready.pid == info.pid and ready.ports == info.ports
    assert f"hello from {tag}/{NODE}/broker/u/r/0" in await get(info.ports["http"])
    assert a.kinds("broker/u/r/0")[:2] == ["started", "ready"]  # (a busy machine may add a flap)
    assert a.instances.held_workloads() == {"broker/u/r/0": ("w1", info.started_at)}
    assert a.instances.running() == 1 and [i.instance for i in a.instances.list()] == ["broker/u/r/0"]
    assert await a.instances.stop("broker/u/r/0") is True
    assert await a.instances.stop("broker/u/r/0") is False  # a second stop
    assert a.kinds("broker/u/r/0")[-1] == "stopped"
    assert a.instances.get(["broker/u/r/0"]) == ([], ["broker/u/r/0"])


async def test_the_same_id_started_twice_runs_one_process(agent, tag):
    a = await agent()
    first, second = await asyncio.gather(a.instances.start(spec("i1")), a.instances.start(spec("i1")))
    assert first.pid == second.pid
    await eventually(lambda: _now(running_with_marker(tag, "i1") == [first.pid]))
    again = await a.instances.start(spec("i1"))  # a retried start answers what runs
    assert again.pid == first.pid and a.kinds("i1").count("started") == 1
    with pytest.raises(BerthError) as refused:
        await a.instances.start(spec("i1", cpus=[0]))
    assert refused.value.code == "instance_exists" and refused.value.status == 409
    assert refused.value.field == "instance"
    await a.instances.stop("i1")


async def test_a_param_the_catalog_refuses_starts_nothing(agent, tag):
    a = await agent()
    with pytest.raises(InvalidArgument) as refused:
        await a.instances.start(spec("i1", image="no-such-image"))
    assert refused.value.field == "param.image"
    with pytest.raises(InvalidArgument) as refused:
        await a.instances.start(spec("i1", env={"PATH": "/tmp"}))
    assert refused.value.field == "param.env.PATH"
    with pytest.raises(BerthError) as failed:  # in the catalog, but its program does not exist
        await a.instances.start(spec("i1", image="missing-binary"))
    assert failed.value.code == "instance_start_failed" and "/nonexistent/server" in failed.value.message
    assert a.instances.list() == [] and not list((a.instances.state.records).iterdir())
    assert a.events == []


async def test_an_exit_is_reported_with_its_code_and_kept_until_stop(agent, tag):
    a = await agent()
    failing = spec("i1", image="http-server-failing", env={"FAIL_INSTANCES": "0"}, owner=Owner("u", "r", 0))
    await a.instances.start(failing)  # exits with 3 in instance index 0
    exited = await a.wait_for("i1", "exited")
    assert exited.state == "exited" and exited.exit_code == 3 and exited.exited_at is not None
    assert a.info("i1").state == "exited" and a.info("i1").exit_code == 3  # kept
    assert a.instances.running() == 0 and len(a.instances) == 1
    assert (await a.instances.start(failing)).state == "exited"  # a retried start starts nothing
    assert await a.instances.stop("i1") is True
    assert a.kinds("i1") == ["started", "exited", "stopped"]
    assert a.info("i1") is None


async def test_stop_ends_the_process_group_and_removes_record_and_cgroup(agent, tag, cgroup_root, tmp_path):
    a = await agent()
    log = tmp_path / "term.log"
    info = await a.instances.start(spec("i1", image="http-server-stubborn", env={"TERM_LOG": str(log)}))
    await a.wait_for("i1", "ready")
    group = await eventually(lambda: _now(p if len(p := running_with_marker(tag, "i1")) == 2 else None))
    assert info.pid in group  # the server and the child it started in its group
    started = {pid: procfs.start_time(pid) for pid in group}
    assert list(a.instances.state.records.iterdir())
    assert await a.instances.stop("i1") is True
    assert alive(group, started) == []  # SIGTERM ignored, so SIGKILL after the grace
    assert "SIGTERM ignored" in log.read_text()
    assert not list(a.instances.state.records.iterdir())
    if info.cgroup:
        assert not any(Path(h, info.cgroup.lstrip("/")).exists() for h in cgroup_root.hierarchies.values())
    stopped = a.last("i1", "stopped")
    assert stopped.state == "exited" and stopped.exit_code == -signal.SIGKILL


# -- confinement ----------------------------------------------------------------------------------


async def test_bound_cpus_and_memory_confine_the_process_in_its_cgroup(agent, cgroup_root):
    needs_cgroups(cgroup_root)
    a = await agent()
    cpu = last_cpu()
    info = await a.instances.start(spec("broker/u/r/0", cpus=[cpu], mems=[0], memory_limit=256 * MiB))
    assert info.pinning == "cgroup" and info.cgroup.startswith(f"/{cgroup_root.parent}/{NODE}/broker_u_r_0-")
    assert status(info.pid, "Cpus_allowed_list") == str(cpu)
    assert status(info.pid, "Mems_allowed_list") == "0"
    joined = cgroup_of(info.pid)
    if cgroup_root.version == 1:
        assert {name: joined[name] for name in cgroup_root.hierarchies} == dict.fromkeys(
            cgroup_root.hierarchies, info.cgroup
        )
        cpuset = Path(cgroup_root.hierarchies["cpuset"], info.cgroup.lstrip("/"))
        memory = Path(cgroup_root.hierarchies["memory"], info.cgroup.lstrip("/"))
        assert (memory / "memory.limit_in_bytes").read_text().strip() == str(256 * MiB)
    else:
        assert joined[""] == info.cgroup
        cpuset = memory = Path(cgroup_root.hierarchies["unified"], info.cgroup.lstrip("/"))
        assert (memory / "memory.max").read_text().strip() == str(256 * MiB)
    assert (cpuset / "cpuset.cpus").read_text().strip() == str(cpu)
    assert str(info.pid) in (cpuset / "cgroup.procs").read_text().split()
    await a.wait_for("broker/u/r/0", "ready")  # it runs fine in there
    await a.instances.stop("broker/u/r/0")


async def test_bound_cpus_set_the_affinity_without_cgroups(agent):
    a = await agent(cgroups=None)
    cpu = last_cpu()
    info = await a.instances.start(spec("i1", cpus=[cpu]))
    assert info.pinning == "affinity" and info.cgroup == ""
    assert status(info.pid, "Cpus_allowed_list") == str(cpu)
    assert cgroup_of(info.pid) == cgroup_of(os.getpid())  # where the agent is
    await a.wait_for("i1", "ready")
    await a.instances.stop("i1")


@pytest.mark.parametrize("mode", ["cgroup", "affinity"])
async def test_cpus_this_machine_lacks_are_not_pinned(agent, cgroup_root, mode):
    """A fake host topology binds CPUs this machine does not have: the instance is pinned to the
    bound CPUs that exist, or not at all; it starts either way."""
    if mode == "cgroup":
        needs_cgroups(cgroup_root)
    a = await agent(cgroups="root" if mode == "cgroup" else None)
    absent = os.cpu_count() + 64
    allowed_here = status(os.getpid(), "Cpus_allowed_list")
    none = await a.instances.start(spec("none", cpus=[absent, absent + 1], mems=[7]))
    assert none.pinning == "none"
    assert status(none.pid, "Cpus_allowed_list") == allowed_here
    cpu = last_cpu()
    some = await a.instances.start(spec("some", cpus=[cpu, absent]))
    assert some.pinning == mode and status(some.pid, "Cpus_allowed_list") == str(cpu)
    await a.wait_for("none", "ready")
    await a.wait_for("some", "ready")
    assert "exited" not in a.kinds("none") + a.kinds("some")
    await a.instances.stop_all()
    assert a.instances.list() == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only root starts a process as another user")
async def test_an_entry_with_a_user_joins_its_cgroup_before_it_becomes_that_user(agent, cgroup_root):
    """Joining a cgroup needs the agent's rights: the child joins, then takes the entry's user."""
    needs_cgroups(cgroup_root)
    readable = Path(tempfile.mkdtemp(prefix="berth-nobody-"))  # a folder the user may read
    try:
        readable.chmod(0o755)
        shutil.copy(ROOT / "tests" / "http_server.py", readable / "http_server.py")
        (readable / "catalog.toml").write_text(NOBODY_CATALOG)
        a = await agent(catalog=Catalog.load(readable / "catalog.toml"))
        cpu = last_cpu()
        info = await a.instances.start(spec("i1", image="http-server-nobody", cpus=[cpu]))
        assert info.pinning == "cgroup" and status(info.pid, "Cpus_allowed_list") == str(cpu)
        assert status(info.pid, "Uid").split() == ["65534"] * 4 and status(info.pid, "Groups") == ""
        assert set(cgroup_of(info.pid).values()) >= {info.cgroup}
        await a.wait_for("i1", "ready")
        await a.instances.stop("i1")
    finally:
        shutil.rmtree(readable)


# -- a restarted agent ----------------------------------------------------------------------------


async def test_a_restarted_agent_adopts_what_runs_and_notices_what_died(agent, tag, tmp_path):
    first = await agent()
    kept = await first.instances.start(spec("kept", workload_id="w1"))
    died = await first.instances.start(spec("died"))
    await first.wait_for("kept", "ready")
    await first.wait_for("died", "ready")
    await first.instances.close()  # the agent goes away; its processes run on
    assert procfs.is_running(kept.pid, procfs.start_time(kept.pid))
    os.killpg(died.pid, signal.SIGKILL)  # one dies while no agent watches
    await eventually(lambda: _now(not procfs.is_running(died.pid, procfs.start_time(died.pid) or 0)))

    second = await agent()
    adopted = second.info("kept")
    assert adopted.pid == kept.pid and adopted.state == "ready" and adopted.ports == kept.ports
    assert running_with_marker(tag, "kept") == [kept.pid]  # no second process
    assert second.instances.held_workloads() == {"kept": ("w1", kept.started_at)}
    assert second.kinds("died") == ["exited"]
    assert second.info("died").state == "exited" and second.info("died").exit_code is None
    assert second.kinds("kept") == []  # nothing changed for it

    os.killpg(kept.pid, signal.SIGKILL)  # an adopted process is watched too
    exited = await second.wait_for("kept", "exited")
    assert exited.exit_code is None  # not this agent's child: no exit status
    assert await second.instances.stop("kept") and await second.instances.stop("died")
    assert not list(second.instances.state.records.iterdir())


async def test_an_intent_is_adopted_by_its_marker_or_found_exited(agent, tag, tmp_path):
    """What an agent that died between recording an intent and spawning leaves behind: with the
    process (it died after the spawn) or without (before)."""
    state = StateDir(tmp_path / "state")
    state.records.mkdir(parents=True)
    port = free_port()
    state.save(Record(spec=spec("spawned"), ports={"http": port}, started_at=1.0))
    state.save(Record(spec=spec("never"), ports={"http": free_port()}, started_at=1.0))
    env = {"PATH": os.environ["PATH"], "BERTH_INSTANCE": f"{tag}/{NODE}/spawned"}
    argv = [sys.executable, f"{ROOT}/tests/http_server.py", "--port", str(port)]
    orphan = await asyncio.to_thread(subprocess.Popen, argv, env=env, start_new_session=True)
    try:
        await eventually(lambda: _now(running_with_marker(tag, "spawned") == [orphan.pid]))
        a = await agent()
        assert a.info("spawned").pid == orphan.pid and a.kinds("spawned") == ["started"]
        assert a.info("never").state == "exited" and a.kinds("never") == ["exited"]
        assert running_with_marker(tag, "never") == []  # started nothing
        await a.wait_for("spawned", "ready")
        assert await a.instances.stop("spawned")
        assert await asyncio.to_thread(orphan.wait, 5) == -signal.SIGTERM
        await a.instances.stop("never")
    finally:
        orphan.kill()
        orphan.wait()


async def test_a_second_agent_on_the_same_state_folder_is_refused(agent, tmp_path):
    a = await agent()
    other = Instances(state_dir=tmp_path / "state", catalog=Catalog.load(CATALOG), node=NODE, prefix="x")
    with pytest.raises(StateLocked, match="in use by another agent"):
        await other.open()
    await a.instances.close()
    await other.open()  # free again once the first has closed
    await other.close()
