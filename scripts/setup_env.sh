#!/usr/bin/env bash
# Create (or reuse) .venv with the exact CPU stack. Idempotent: a second run only checks.
# Everything is installed --no-deps from a lock file, so no package can pull a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TIDE_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.tide-installed"
want=$(cat requirements/*.lock requirements/sglang.txt setup.py | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] installing the CPU stack into $VENV (first run takes a few minutes)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
for lock in requirements/*.lock; do
  "$VENV/bin/python" -m pip install -q --no-deps -r "$lock"
done
"$VENV/bin/python" -m pip install -q --no-deps -r requirements/sglang.txt
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -m tide_megatron.compat.install
echo "$want" > "$stamp"
echo "[setup] done"
