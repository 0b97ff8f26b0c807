#!/usr/bin/env bash
# The CUDA check of issue 14 (scripts/gpu_check.py), unattended, bounded to 8 minutes.
# On a machine with an NVIDIA GPU: installs what it needs (make install), then runs the check.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi || echo "nvidia-smi: not found (no NVIDIA driver here)"
[ -x .venv/bin/python ] || make install
timeout 480 .venv/bin/python scripts/gpu_check.py "$@"
