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
# 4. bench/megatron_gpu.py: the Megatron engine (TransformerEngine specs when they import):
#    parity with transformers, bf16 tokens/s tree vs flat, the alltoall MoE dispatcher;
#    megatron:t2 (sequence parallel) under torchrun on 2+ GPUs, megatron:d1 on one.
echo "== bench/megatron_gpu.py (Megatron engine: parity, bf16 tokens/s tree vs flat, alltoall MoE)"
gpus="$(nvidia-smi -L 2>/dev/null | wc -l || true)"
if [ "${gpus:-0}" -ge 2 ]; then
  "$py" -m torch.distributed.run --standalone --nproc-per-node 2 bench/megatron_gpu.py --out "$out/RESULTS.md"
else
  echo "one GPU: megatron:t2 needs two, running megatron:d1"
  "$py" bench/megatron_gpu.py --out "$out/RESULTS.md"
fi
echo "wrote $out/RESULTS.md"
