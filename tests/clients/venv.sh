#!/usr/bin/env bash
# Creates the virtual environment holding the pinned official `ollama` and `openai` Python
# clients (tests/clients/requirements.txt) that tests/clients.rs drives `serve` with; prints
# its python. Idempotent: an environment built from the same requirements is reused.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-$here/../../target/clients-venv}"
stamp="$venv/.requirements.sha256"
want="$(sha256sum "$here/requirements.txt" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$here/requirements.txt" >&2
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
