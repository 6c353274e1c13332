#!/usr/bin/env bash
# Creates .venv-peer with the peers the benchmarks compare against: Python MLX (the same
# pinned version our build links), mlx-lm, and mlx-vlm (gemma4's vision and audio towers on
# MLX). Idempotent; everything comes from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-peer/bin/python ]; then
  python3 -m venv .venv-peer
fi
.venv-peer/bin/pip install -q "mlx[cpu]==0.32.4" "mlx-lm==0.32.2" "mlx-vlm==0.7.10" numpy
.venv-peer/bin/python -c "import mlx.core as mx; print('peer mlx', mx.__version__)"
