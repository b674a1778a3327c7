"""The manual: the site builds with `mkdocs build --strict`, its generated references are up to date,
the README stays an entrance, and the examples of the README, Getting started and the Python client
page run as they are written.

Examples run in the order of their page, against an allocation service and metrics agents of
nodes `n1` and this host served in this test's namespace (the commands find them through
NATS_URL and BERTH_PREFIX, as they would through `berth up`'s up.env). A shell block runs in bash,
where `berth` is the command of this checkout; a Python block runs as `python -m asyncio` runs it
(top-level `await` allowed), a block without `await` in a thread of its own. A block is left out
when an HTML comment just above it says `not run: <why>`; one marked `runs until stopped` is
stopped once it printed a line.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import inspect
import os
import re
import runpy
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from berth import Client

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README_LINES = 250
EXAMPLE_SECONDS = 60
HOST_NODE = socket.gethostname().split(".")[0]  # as the metrics examples name this host's node


# -- the site and its generated pages --------------------------------------------------------------


def test_the_site_builds_strictly(tmp_path):
    """Every page is in the navigation, every link and anchor resolves, nothing warns."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs and mkdocs-material are not installed (make setup installs them)")
    site = tmp_path / "site"
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    pages = ("getting-started", "client", "reference/cli", "reference/wire", "reference/metrics", "DESIGN")
    for page in pages:
        assert (site / page / "index.html").is_file(), page


def test_the_generated_references_are_up_to_date():
    """docs/reference/ is what scripts/docs_reference.py writes from this checkout's parsers and tables."""
    check = [sys.executable, "scripts/docs_reference.py", "--check"]
    run = subprocess.run(check, cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_readme_is_an_entrance():
    """At most 250 lines; the three commands and how `berth` gets on the PATH come first; every page
    it links to exists."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_LINES
    first = "\n".join(readme.splitlines()[:40])
    for command in ("make setup", "make up", "make test", ". .venv/bin/activate", ".venv/bin/berth"):
        assert command in first, command
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert links
    for link in links:
        if "://" not in link:
            assert (ROOT / link).exists(), link


# -- the examples ----------------------------------------------------------------------------------


@dataclass
class Block:
    page: str
    line: int
    language: str
    code: str
    note: str  # the HTML comment just above it, if any

    @property
    def runs(self) -> bool:
        return self.language in ("sh", "bash", "python") and not self.note.startswith("not run")

    @property
    def endless(self) -> bool:
        return self.note.startswith("runs until stopped")


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, in order."""
    found, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^```(\w*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        note = re.match(r"^<!--\s*(.*?)\s*-->$", above)
        found.append(Block(path.name, i + 1, opening.group(1), "\n".join(lines[i + 1:end]) + "\n",
                           note.group(1) if note else ""))
        i = end + 1
    return found


def _cli_module() -> str:
    """The `berth` command's module in this checkout (berth/cli.py, or services/cli.py before it moved)."""
    spec = importlib.util.find_spec("berth.cli")
    here = spec is not None and spec.origin is not None and Path(spec.origin).resolve().is_relative_to(ROOT)
    return "berth.cli" if here else "services.cli"


@pytest.fixture
async def deployment(serve_allocation, serve, nc, redis, prefix, nats_url, tmp_path, monkeypatch):
    """What the examples talk to: allocation, metrics agents of n1 and this host with a sample of
    `cpu.usage.system` every few tenths of a second, and the variables the commands and
    `Client.connect()` read. Yields the folder the shell examples run in."""
    from services.metrics.config import MetricsServiceConfig
    from services.metrics.worker import MetricsWorker

    await serve_allocation()
    workers = []
    for node in sorted({"n1", HOST_NODE}):
        worker = MetricsWorker(nc, redis, prefix, MetricsServiceConfig(node=node, insurance_seconds=60),
                               provisioners=[])
        worker.start()
        await serve(worker.service)
        workers.append(worker)
    for name in list(os.environ):
        if name.startswith("BERTH_") or name in ("NATS_URL", "REDIS_URL"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("NATS_URL", nats_url)
    monkeypatch.setenv("BERTH_PREFIX", prefix)
    monkeypatch.setenv("BERTH_STATE", str(tmp_path / "no-berth-up"))
    shell = tmp_path / "shell"
    (shell / ".venv").parent.mkdir()
    if sys.prefix != sys.base_prefix:  # `. .venv/bin/activate` activates the venv running the tests
        (shell / ".venv").symlink_to(sys.prefix)
    else:
        (shell / ".venv" / "bin").mkdir(parents=True)
        (shell / ".venv" / "bin" / "activate").write_text("")

    client = Client(nc, prefix=prefix, timeout=5.0)

    async def sample() -> None:
        value = 0.0
        while True:
            value += 0.25
            for node in {"n1", HOST_NODE}:
                await client.metrics.put(node, scope="node", metric="cpu.usage.system", value=value)
            await asyncio.sleep(0.3)

    sampling = asyncio.create_task(sample())
    try:
        yield shell
    finally:
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
        for worker in workers:
            await worker.stop()


async def run_shell(block: Block, folder: Path) -> str:
    """A shell block in bash, `berth` being this checkout's command; fails on the first command that does."""
    script = (f'set -eo pipefail\nberth() {{ "{sys.executable}" -m {_cli_module()} "$@"; }}\n' + block.code)
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", script, cwd=folder, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    where = f"{block.page}:{block.line}"
    try:
        out, err = await asyncio.wait_for(proc.communicate(), EXAMPLE_SECONDS)
    except TimeoutError:
        proc.kill()
        raise AssertionError(f"{where}: still running after {EXAMPLE_SECONDS} s") from None
    assert proc.returncode == 0, f"{where} exited {proc.returncode}:\n{out.decode()}{err.decode()}"
    return out.decode()


async def run_python(block: Block) -> list[str]:
    """A Python block as `python -m asyncio` runs it; the lines it printed."""
    printed: list[str] = []
    def capture(*args: object, **options: object) -> None:
        printed.append(" ".join(map(str, args)))

    namespace = {"__name__": "__docs__", "print": capture}
    code = compile(block.code, f"{block.page}:{block.line}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    if code.co_flags & inspect.CO_COROUTINE:
        task = asyncio.ensure_future(eval(code, namespace))
    else:
        task = asyncio.ensure_future(asyncio.to_thread(exec, code, namespace))
    where = f"{block.page}:{block.line}"
    if block.endless:
        async with asyncio.timeout(EXAMPLE_SECONDS):
            while not printed and not task.done():
                await asyncio.sleep(0.05)
        assert printed or task.exception() is None, f"{where}: {task.exception()!r}"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert printed, f"{where} printed nothing"
    else:
        try:
            await asyncio.wait_for(task, EXAMPLE_SECONDS)
        except TimeoutError:
            raise AssertionError(f"{where}: still running after {EXAMPLE_SECONDS} s") from None
    return printed


async def run_page(path: Path, folder: Path) -> list[tuple[Block, str]]:
    ran = []
    for block in blocks(path):
        if block.runs:
            output = await run_shell(block, folder) if block.language != "python" else "\n".join(
                await run_python(block))
            ran.append((block, output))
    return ran


async def test_the_readme_examples_run(deployment):
    ran = await run_page(ROOT / "README.md", deployment)
    assert [block.language for block, _ in ran] == ["sh", "python"]
    shell, python = (output for _, output in ran)
    assert '"allocations"' in shell and re.search(r"^n1 .*pool=a", shell, re.M), shell
    assert python.strip(), "the metric watch printed no sample"


async def test_the_getting_started_examples_run(deployment):
    ran = await run_page(DOCS / "getting-started.md", deployment)
    assert [block.language for block, _ in ran] == ["sh", "python"]
    shell, python = (output for _, output in ran)
    assert re.search(r"^berth-allocation|^t\w+-allocation", shell, re.M), shell  # berth status
    assert re.search(r"^n1 .*pool=a", shell, re.M), shell  # berth nodes --labels pool=a
    events = [line for line in shell.splitlines() if line.startswith('{"subject"')]
    kinds = [line.split('"')[3].rsplit(".", 1)[-1] for line in events]
    assert kinds == ["added", "added", "added", "allocated"], events  # one `added` per plugin
    assert "('n1', {'pool': 'a'})" in python


async def test_the_client_page_examples_run(deployment, prefix, nc, capsys):
    client = Client(nc, prefix=prefix, timeout=5.0)
    for node in ("n1", "n2"):  # the first walk's node, and another of its pool
        await client.allocation.add_node(nodename=node, labels={"pool": "a"},
                                         resource={"cpumem": {"cpu": 8, "memory": "16G"}})
    ran = await run_page(DOCS / "client.md", deployment)
    assert len(ran) == 7 and all(block.language == "python" for block, _ in ran)
    outputs = [output for _, output in ran]
    assert "insufficient_capacity 409" in outputs[3]
    assert "resource.n1.allocated" in outputs[5]

    # the whole script the page points to
    capsys.readouterr()
    await asyncio.wait_for(asyncio.to_thread(runpy.run_path, str(ROOT / "examples" / "quickstart.py"),
                                             run_name="__main__"), EXAMPLE_SECONDS)
    out = capsys.readouterr().out
    assert "placed:" in out and "released:" in out, out
