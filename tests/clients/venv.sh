#!/usr/bin/env bash
# Creates a virtual environment holding pinned Python clients that tests/clients.rs drives
# `serve` with, and prints its python: by default the official `ollama`, `openai` and
# `anthropic` packages (tests/clients/requirements.txt) in target/clients-venv; or
# `venv.sh DIR REQUIREMENTS`. Idempotent: an environment built from the same requirements is
# reused.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-$here/../../target/clients-venv}"
requirements="${2:-$here/requirements.txt}"
stamp="$venv/.requirements.sha256"
want="$(sha256sum "$requirements" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements" >&2
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
