#!/usr/bin/env bash
# The GPU figures of docs/strategies.md ("On a GPU"), in one script of under 10 minutes on one GPU:
#   1. configs/gpu.yaml in bf16 as ONE process, 10 + 100 steps: samples/s and MFU (mtl/tools/throughput.py);
#   2. the bench-strategies ratios on that GPU, one process (no all-reduce to overlap: the ratios of the
#      compute alone), a smaller batch to keep the eight trainers' memory and the time in bounds.
# Run from the repository root after `make install`; results go to $OUT (default runs/gpu_report).
# One process has no process group, so SyncBatchNorm (gpu.yaml's norm: sync) is replaced by plain BatchNorm,
# which is what SyncBatchNorm computes with one process.
set -euo pipefail
out=${OUT:-runs/gpu_report}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
date -u +%Y-%m-%dT%H:%MZ | tee -a "$out/gpu.txt"
timeout 360 "$py" -m mtl.tools.throughput --config configs/gpu.yaml --steps 100 --warmup 10 \
  --json "$out/throughput.json" model.backbone.norm=batch 2>&1 | tee "$out/throughput.txt"
timeout 200 "$py" -m mtl.tools.bench.strategies --config configs/gpu.yaml --nproc 1 --rounds 3 --steps 3 \
  --only detach,feature_leaf,task_grads,task_grads+mgda,feature_leaf+mgda --json "$out/bench_strategies.json" \
  model.backbone.norm=batch data.batch_size=32 2>&1 | tee "$out/bench_strategies.txt"
