"""The catalog: the only commands the `process` operator and the agent run (issue 17, "no code from
requests").

A request's `param.image` is the name of an entry in an operator-side TOML file (broker and agent
option `--catalog PATH`, env `BERTH_CATALOG`). The entry, not the request, says what runs:

    [images.http-server]
    argv = ["python3", "$CATALOG_DIR/tests/http_server.py", "--port", "$PORT_HTTP"]
    env = { PYTHONDONTWRITEBYTECODE = "1" }  # given to every process of this image
    request_env = ["DELAY"]                   # variables a request's `param.env` may set
    user = "nobody"                           # run as this OS user (needs a broker running as root)
    group = "nogroup"                         # default: the user's primary group

`argv` is executed directly, never through a shell. A `$NAME` / `${NAME}` placeholder is replaced
inside its own item (a value never becomes several arguments); `$$` is a `$`. Placeholders are the
process's variables (below) and `CATALOG_DIR`, the folder of the catalog file.

The process's environment is built from nothing, in this order (a later one wins): `PATH`
(`DEFAULT_PATH`) and the broker's `LANG`, `LC_ALL`, `TZ`; `HOME`, `USER`, `LOGNAME` of `user`; the
entry's `env`; the request's `param.env` (only names in `request_env`); the operator's own:
`PORT_<NAME>`, `VOLUME_<NAME>`, `BERTH_INSTANCE`, `BERTH_INSTANCE_INDEX`, `BERTH_RESOURCE_ID`,
`BERTH_ADDRESS` (the address its ports are reached at: a program listens there) and
`BERTH_DEPLOYMENT` when the broker has it. Nothing else of the broker's environment (its
`REDIS_URL` and NATS credentials above all) reaches a launched process.

A param is anything with the four fields read here (`ProcessParam`): the broker's `ResourceParam`
and the agent's `InstanceParam` alike, so this module imports neither service.
"""

from __future__ import annotations

import functools
import grp
import os
import pwd
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Protocol

import msgspec

from bus.codec import decode_stored, encode
from schemas.errors import InvalidArgument
from services.processes.procfs import DEPLOYMENT

DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
PASSED = ("LANG", "LC_ALL", "TZ")  # harmless variables of the broker a process keeps
INSTANCE_VARIABLES = ("BERTH_INSTANCE", "BERTH_INSTANCE_INDEX", "BERTH_RESOURCE_ID", "BERTH_ADDRESS")
CATALOG_DIR = "CATALOG_DIR"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}")
# The operator's variables: an entry or a request that set them could fake another instance's marker.
RESERVED = re.compile(r"(BERTH_|PORT_|VOLUME_).*|CATALOG_DIR")


class HostVolume(Protocol):
    @property
    def host_dir(self) -> str: ...


class ProcessParam(Protocol):
    """What a request says about its process: the catalog entry, the variables it sets, the names of
    its ports and its volumes (whose host folders become `VOLUME_<NAME>`)."""

    @property
    def image(self) -> str: ...

    @property
    def env(self) -> Mapping[str, str]: ...

    @property
    def ports(self) -> Mapping[str, str]: ...

    @property
    def volumes(self) -> Mapping[str, HostVolume]: ...


class CatalogError(Exception):
    """The catalog file cannot be used (the message says where); the broker does not start."""


class Entry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    argv: list[str]
    env: dict[str, str] = {}
    request_env: list[str] = []
    user: str | None = None
    group: str | None = None


class CatalogFile(msgspec.Struct, forbid_unknown_fields=True):
    images: dict[str, Entry] = {}


def variable(kind: str, name: str) -> str:
    """`PORT_<NAME>` / `VOLUME_<NAME>` of a port or volume name (upper-cased, `-` -> `_`)."""
    return f"{kind}_{name.upper().replace('-', '_')}"


@dataclass(frozen=True, eq=False)  # hashed by identity: validation results are cached per catalog
class Catalog:
    entries: Mapping[str, Entry]
    directory: str = ""

    @classmethod
    def load(cls, path: str | Path | None) -> Catalog:
        """The catalog in `path`; an empty one (every image refused) for None."""
        if path is None:
            return cls({})
        path = Path(path).resolve()
        try:
            parsed = msgspec.toml.decode(path.read_bytes(), type=CatalogFile)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as error:
            raise CatalogError(f"catalog {path}: {error}") from None
        for name, entry in parsed.images.items():
            _check_entry(f"catalog {path}, images.{name}", name, entry)
        return cls(parsed.images, str(path.parent))

    def entry(self, image: str) -> Entry:
        """The entry named `image`, or `invalid_argument` on `param.image`."""
        found = self.entries.get(image)
        if found is not None:
            return found
        if not self.entries:
            raise InvalidArgument("param.image", "no image can run: there is no catalog (--catalog)")
        known = ", ".join(sorted(self.entries)[:20])
        raise InvalidArgument("param.image", f"{image[:80]!r} is not in the catalog (known: {known})")

    def check(self, param: ProcessParam) -> None:
        """`param` names an entry, sets only variables it takes, and fills every placeholder."""
        entry = self.entry(param.image)
        for name, value in param.env.items():
            if name not in entry.request_env:
                raise InvalidArgument(
                    f"param.env.{name}", f"image {param.image!r} takes no such variable "
                    f"(it takes: {', '.join(entry.request_env) or 'none'})"
                )
            if "\0" in value:
                raise InvalidArgument(f"param.env.{name}", "must not contain a NUL character")
        known = set(self.environment(entry, param, operator=_placeholder_values(param)))
        unknown = sorted(_placeholders(entry) - known - {CATALOG_DIR})
        if unknown:
            raise _missing(param.image, unknown[0])

    def command(
        self, param: ProcessParam, operator: Mapping[str, str]
    ) -> tuple[list[str], dict[str, str], Entry]:
        """The argv, the environment and the entry of one process of `param` (already checked)."""
        entry = self.entry(param.image)
        env = self.environment(entry, param, operator)
        argv = [Template(item).substitute(env, CATALOG_DIR=self.directory) for item in entry.argv]
        return argv, env, entry

    @staticmethod
    def environment(entry: Entry, param: ProcessParam, operator: Mapping[str, str]) -> dict[str, str]:
        env = {"PATH": DEFAULT_PATH, **{k: os.environ[k] for k in PASSED if k in os.environ}}
        if entry.user is not None:
            account = pwd.getpwnam(entry.user)
            env |= {"HOME": account.pw_dir, "USER": account.pw_name, "LOGNAME": account.pw_name}
        env |= entry.env
        env |= {k: v for k, v in param.env.items() if k in entry.request_env}
        if DEPLOYMENT in os.environ:  # `berth up` stops its deployment's processes by this marker
            env[DEPLOYMENT] = os.environ[DEPLOYMENT]
        return env | dict(operator)


def check_command(param: ProcessParam, catalog: Catalog) -> None:
    """The `image` names a catalog entry whose placeholders `param` fills; its ports and volumes
    give distinct variables. Raises `invalid_argument` naming the field."""
    _check_command(catalog, type(param), encode(param))


@functools.lru_cache(maxsize=1024)
def _check_command(catalog: Catalog, kind: type, encoded: bytes) -> None:
    # Cached by the encoded param: the broker's `apply` checks the same few params over and over.
    param = decode_stored(encoded, kind)
    for prefix, names in (("PORT", param.ports), ("VOLUME", param.volumes)):
        variables = {variable(prefix, name) for name in names}
        if len(variables) != len(names):
            raise InvalidArgument(
                f"param.{prefix.lower()}s", f"two names map to the same {prefix}_<NAME> variable"
            )
    catalog.check(param)


def _placeholder_values(param: ProcessParam) -> dict[str, str]:
    """The operator's variables of `param`, with dummy values: only their names matter to a check."""
    names = [variable("PORT", n) for n in param.ports] + [variable("VOLUME", n) for n in param.volumes]
    return dict.fromkeys([*names, *INSTANCE_VARIABLES], "")


def _placeholders(entry: Entry) -> set[str]:
    return {name for item in entry.argv for name in Template(item).get_identifiers()}


def _missing(image: str, name: str) -> InvalidArgument:
    """The request lacks what the placeholder `name` of `image` needs; the field that would give it."""
    for kind, field in (("PORT_", "param.ports"), ("VOLUME_", "param.volumes")):
        if name.startswith(kind):
            return InvalidArgument(field, f"image {image!r} uses ${name}: declare that {field[6:-1]}")
    return InvalidArgument("param.env", f"image {image!r} uses ${name}: set it in param.env")


def _check_entry(where: str, name: str, entry: Entry) -> None:
    """An entry the operator can run: a refusal here names the file and the entry."""
    if not NAME.fullmatch(name):
        raise CatalogError(f"{where}: a name is 1 to 128 of [A-Za-z0-9_.:/-], first a letter or digit")
    if not entry.argv or not entry.argv[0]:
        raise CatalogError(f"{where}: argv must name a program")
    for item in entry.argv:
        if not Template(item).is_valid():
            raise CatalogError(f"{where}: malformed $ placeholder in {item!r} (write $$ for $)")
    for key in [*entry.env, *entry.request_env]:
        if RESERVED.fullmatch(key):
            raise CatalogError(f"{where}: {key} is the operator's variable")
    # A placeholder nothing can fill would refuse every request: a typo, said when the broker starts.
    fillable = {*entry.env, *entry.request_env, *INSTANCE_VARIABLES, "PATH", CATALOG_DIR}
    fillable |= {"HOME", "USER", "LOGNAME"} if entry.user is not None else set()
    for placeholder in sorted(_placeholders(entry) - fillable):
        if not placeholder.startswith(("PORT_", "VOLUME_")):  # those come with the request's ports and volumes
            raise CatalogError(
                f"{where}: nothing gives ${placeholder} (env, request_env, the operator's variables)"
            )
    _account(where, entry)


def _account(where: str, entry: Entry) -> None:
    """The OS user and group of `entry` exist."""
    try:
        if entry.user is not None:
            pwd.getpwnam(entry.user)
        if entry.group is not None:
            grp.getgrnam(entry.group)
    except KeyError as error:
        raise CatalogError(f"{where}: {error.args[0]}") from None
    if entry.group is not None and entry.user is None:
        raise CatalogError(f"{where}: group needs user")
