"""Joining a host: a bundle that gives a new host's agent everything it needs, or a one-time token
that fetches that bundle over the network.

On a machine of the control plane, `berth user bundle NAME` writes the bundle of node agent
identity NAME (made with `berth user add NAME --role agent --node NODE`): the running
deployment's server URLs (as `berth up --listen` wrote them in `up.env`), the identity's NATS user
and password and its Redis user in the Redis URL, the deployment's CA, the prefix and the node.
On the host, `berth agent --bundle FILE` unpacks it into a private folder beside it and runs the
agent of that node with it. The bundle holds secrets: it is written readable by its owner only,
and is to be moved as such (scp). `berth user remove NAME` revokes it at once: its NATS
connections are closed and its Redis user deleted, whoever holds the file.

A join token (`berth user join-token NODE`, kubeadm's idea) spares moving the file: `ID.SECRET`,
valid once, for a short time (10 minutes by default). On the host, `berth agent --join URL --token
ID.SECRET` connects as the public `join` user (account `JOIN`, which may do nothing but ask
`P.join.redeem`), sends the token's id and a proof that it holds the secret (an HMAC), never the
secret, and gets the bundle sealed with a key derived from the secret (AES-GCM): the join service of `berth up` (`serve`) unseals nothing for anyone else, a used
or expired token is refused saying which, and the bundle, CA included, is authentic because only a
holder of the secret could have sealed it, so the first TLS connection need not trust a CA yet.
Tokens are kept in `<state>/credentials/tokens.json` (owner only).
"""

from __future__ import annotations

import asyncio
import base64
import fcntl
import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from contextlib import contextmanager
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from berth.credentials import Credentials, write_private

VERSION = 1
TOKEN_SECONDS = 600.0
# The public user of account JOIN (berth/accounts.py): it may only ask to redeem a token.
JOIN_USER = JOIN_PASSWORD = "join"
JOIN_SERVICE_WAIT = 30.0  # seconds a joining host waits for a deployment that is still starting
log = logging.getLogger("berth.join")


def make(creds: Credentials, name: str, up: dict[str, str]) -> dict:
    """The bundle of agent identity `name`, for the deployment whose `up.env` values are `up`."""
    identity = creds.identities.get(name)
    if identity is None or not identity.is_agent:
        raise ValueError(f"{name!r} is not a node agent's identity (berth user add {name} --role agent --node NODE)")
    if not up.get("NATS_URL") or not up.get("REDIS_URL"):
        raise ValueError("the deployment is not running (no up.env with its URLs): start `berth up` first")
    ca = up.get("BERTH_TLS_CA")
    return {
        "version": VERSION, "prefix": creds.prefix, "node": identity.node, "user": name,
        "password": identity.password, "nats_url": up["NATS_URL"],
        "redis_url": creds.redis_url(name, up["REDIS_URL"]), "js_domain": creds.prefix,
        "tls_ca": Path(ca).read_text() if ca else None,
    }


def write(path: Path, bundle: dict) -> None:
    write_private(path, json.dumps(bundle, indent=1) + "\n")


def unpack(path: Path) -> tuple[list[str], dict[str, str]]:
    """The agent's arguments and environment from bundle `path`: its creds file and CA go into
    `<path>.d/`, readable by the owner only; the Redis URL (with its password) into the environment."""
    try:
        bundle = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"--bundle {path}: {error}") from None
    if bundle.get("version") != VERSION:
        raise ValueError(f"--bundle {path}: not a berth bundle of version {VERSION}")
    folder = Path(f"{path}.d")
    folder.mkdir(mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    creds = folder / f"{bundle['user']}.nats"
    write_private(creds, f"user={bundle['user']}\npassword={bundle['password']}\nnode={bundle['node']}\n")
    env = {"REDIS_URL": bundle["redis_url"]}
    if bundle.get("tls_ca"):
        write_private(folder / "ca.pem", bundle["tls_ca"])
        env["BERTH_TLS_CA"] = str(folder / "ca.pem")
    argv = ["--node", bundle["node"], "--prefix", bundle["prefix"], "--nats", bundle["nats_url"],
            "--nats-creds", str(creds), "--js-domain", bundle["js_domain"]]
    return argv, env


# -- one-time join tokens ----------------------------------------------------------------------------


class TokenRefused(ValueError):
    """A token that is unknown, used or expired; the message says which."""


def _tokens_path(creds: Credentials) -> Path:
    return creds.directory / "tokens.json"


@contextmanager
def _tokens(creds: Credentials):
    """The token table, locked while changed (the join service and `berth user` share it)."""
    path = _tokens_path(creds)
    with open(creds.directory / "tokens.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        table = json.loads(path.read_text()) if path.exists() else {}
        yield table
        write_private(path, json.dumps(table, indent=1) + "\n")


def issue(creds: Credentials, name: str, seconds: float = TOKEN_SECONDS) -> str:
    """A new one-time token for agent identity `name`: `ID.SECRET`."""
    identity = creds.identities.get(name)
    if identity is None or not identity.is_agent:
        raise ValueError(f"{name!r} is not a node agent's identity (berth user add {name} --role agent --node NODE)")
    token_id, secret = secrets.token_hex(4), secrets.token_urlsafe(24)
    with _tokens(creds) as table:
        now = time.time()
        for old in [k for k, v in table.items() if v["expires"] < now - 86400]:  # a day after: forgotten
            del table[old]
        table[token_id] = {"identity": name, "secret": secret, "expires": now + seconds, "used": None}
    return f"{token_id}.{secret}"


def redeem(creds: Credentials, token_id: str, proof: str, up: dict[str, str]) -> dict:
    """The sealed bundle of a token, which is used from then on; `TokenRefused` says why not.
    `proof` shows that the caller holds the secret (so that a token's id alone cannot use it up)."""
    with _tokens(creds) as table:
        entry = table.get(token_id)
        if entry is None or not hmac.compare_digest(proof, _proof(entry["secret"], token_id)):
            raise TokenRefused(f"join token {token_id} is unknown (or its secret wrong): ask for a new one "
                               "(berth user join-token)")
        if entry["used"] is not None:
            raise TokenRefused(f"join token {token_id} was used already, at {time.ctime(entry['used'])}: a token "
                               "works once; ask for a new one")
        if entry["expires"] < time.time():
            raise TokenRefused(f"join token {token_id} expired at {time.ctime(entry['expires'])}: ask for a new one")
        bundle = make(creds, entry["identity"], up)
        entry["used"] = time.time()
    nonce = os.urandom(12)
    sealed = AESGCM(_key(entry["secret"], token_id)).encrypt(nonce, json.dumps(bundle).encode(), token_id.encode())
    return {"nonce": base64.b64encode(nonce).decode(), "sealed": base64.b64encode(sealed).decode()}


def unseal(token: str, reply: dict) -> dict:
    """The bundle a join service sealed for `token` (`ID.SECRET`)."""
    token_id, _, secret = token.partition(".")
    try:
        plain = AESGCM(_key(secret, token_id)).decrypt(
            base64.b64decode(reply["nonce"]), base64.b64decode(reply["sealed"]), token_id.encode())
    except Exception:
        raise TokenRefused("the join service's answer does not open with this token (a wrong secret, or not "
                           "berth's join service)") from None
    return json.loads(plain)


async def _redeem(nc, subject: str, asked: bytes, wait: float = JOIN_SERVICE_WAIT):
    """Ask the join service; while none answers (the deployment is starting, as at a fleet's boot),
    ask again for up to `wait` seconds."""
    import nats

    deadline = time.monotonic() + wait
    while True:
        try:
            return await nc.request(subject, asked, timeout=10)
        except nats.errors.NoRespondersError:
            if time.monotonic() > deadline:
                raise TokenRefused(f"no join service answered {subject} within {wait:g} s: is `berth up` "
                                   "running there?") from None
            log.info("no join service answers %s yet; asking again in 1 s", subject)
            await asyncio.sleep(1.0)


def _proof(secret: str, token_id: str) -> str:
    return hmac.new(_key(secret, token_id), b"redeem", hashlib.sha256).hexdigest()


def _key(secret: str, token_id: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=token_id.encode(), info=b"berth join").derive(secret.encode())


async def serve(nc, creds_directory: Path, state: Path, prefix: str) -> None:
    """Answer `P.join.redeem` until cancelled (`berth up` runs it, as the `join-service` user)."""
    from berth.commands.connection import UP_ENV, read_up_env
    from berth.credentials import load

    async def answer(msg) -> None:
        try:
            asked = json.loads(msg.data)
            token_id, proof = str(asked["token"]), str(asked["proof"])
            creds = load(creds_directory)  # identities added since it started count too
            reply = redeem(creds, token_id, proof, read_up_env(state / UP_ENV) or {})
            log.info("join token %s redeemed", token_id)
        except (TokenRefused, ValueError, KeyError, TypeError) as error:
            reply = {"error": str(error) if isinstance(error, ValueError) else 'expected {"token": ID, "proof": HMAC}'}
        await msg.respond(json.dumps(reply).encode())

    await nc.subscribe(f"{prefix}.join.redeem", queue="join", cb=answer)


async def fetch(url: str, prefix: str, token: str) -> dict:
    """The bundle of `token`, fetched from the join service at `url` (see the module docstring:
    the server's certificate is not checked; the sealed answer is what is trusted)."""
    import ssl

    import nats

    if "." not in token:
        raise TokenRefused("a join token is ID.SECRET, as `berth user join-token` prints it")
    context = None
    if url.startswith("tls://"):
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    nc = await nats.connect(url, user=JOIN_USER, password=JOIN_PASSWORD, tls=context, max_reconnect_attempts=2,
                            connect_timeout=5)
    try:
        token_id, _, secret = token.partition(".")
        asked = {"token": token_id, "proof": _proof(secret, token_id)}  # the secret itself never leaves
        msg = await _redeem(nc, f"{prefix}.join.redeem", json.dumps(asked).encode())
    finally:
        await nc.close()
    reply = json.loads(msg.data)
    if "error" in reply:
        raise TokenRefused(reply["error"])
    return unseal(token, reply)
