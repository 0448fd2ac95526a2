#!/usr/bin/env bash
# All GPU checks and benchmarks in one run, for a machine with an NVIDIA GPU:
#   bench/gpu.sh [OUT_DIR]        (default: bench/)
# 1. the fused tree-attention tests on CUDA (flex and triton forward+backward vs dense, fp32);
# 2. bench/attention.py in bf16: every backend vs dense (tolerances in the table), then
#    tokens/s and speedup over plain causal attention on the bench/workloads.py shapes;
# 3. bench/archon_gpu.py: the Archon model in bf16 (compiled), parity and tokens/s per backend;
# Writes OUT_DIR/RESULTS.md (dated, with the GPU model) and OUT_DIR/gpu-pytest.log.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench}"
mkdir -p "$out"
py="${PYTHON:-.venv/bin/python}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "== fused attention tests on CUDA"
TREETRAIN_TEST_DEVICE=cuda "$py" -m pytest -q -p no:cacheprovider tests/unit/test_attention_fused.py 2>&1 | tee "$out/gpu-pytest.log"
echo "== bench/attention.py (bf16)"
"$py" bench/attention.py --device cuda --dtype bfloat16 --out "$out/RESULTS.md"
echo "== bench/archon_gpu.py (Archon model: bf16 parity, tokens/s with flex and triton, compiled)"
"$py" bench/archon_gpu.py --device cuda --backends flex triton --out "$out/RESULTS.md"
echo "wrote $out/RESULTS.md"
