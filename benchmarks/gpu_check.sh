#!/usr/bin/env bash
# On a CUDA machine: install pyattr against the torch that is there, build pyattr._C with
# its CUDA kernels, run the CUDA tests (tests/test_cuda.py includes the paths added on the
# CPU since: sdpa_rows leaving CUDA calls to sdpa's own backward, and the edge values --
# NaN, inf, subnormals -- through the Triton and CUDA rule kernels against the CPU
# reference; the gated kernels with both rules off, the gated MLP's memory mount), the kernel microbenchmarks at the issue shapes and
# the end-to-end relevance run, the frozen-attention kernel against
# SDPA, and leave logs and JSON in OUTDIR. Budget: < 8 minutes.
#   usage: benchmarks/gpu_check.sh OUTDIR
set -uo pipefail
OUT="${1:?usage: benchmarks/gpu_check.sh OUTDIR}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/gpu_check.log"; }

log "device: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | head -1)"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  log "torch with CUDA is not importable with $PY; installing torch==2.14.1"
  "$PY" -m pip install -q "torch==2.14.1" >> "$OUT/install.log" 2>&1 || { log "torch install failed"; exit 1; }
fi
export MAX_JOBS="${MAX_JOBS:-16}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
log "building pyattr._C (CPU + CUDA, arch $TORCH_CUDA_ARCH_LIST)"
# --no-deps: the GPU machine has no package index; torch, transformers and triton are there
timeout 300 "$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/build.log" 2>&1 \
  || { log "build failed (see build.log)"; tail -30 "$OUT/build.log"; exit 1; }
"$PY" -c "import pyattr, json; print(json.dumps({k: [v.available, v.reason] for k, v in pyattr.available_backends().items()}))" \
  | tee -a "$OUT/gpu_check.log"

log "CUDA tests"
timeout 240 "$PY" -m pytest -q tests/test_cuda.py tests/test_backend_parity.py tests/test_vmap.py \
  tests/test_attention.py tests/test_attention_backward.py tests/test_compile.py > "$OUT/tests.log" 2>&1
log "tests exit $? — $(tail -1 "$OUT/tests.log")"

log "frozen attention backward against SDPA's, bf16 and fp32, seq 2048, head dims 64 and 128"
timeout 60 "$PY" -m pyattr bench --device cuda --dtypes bfloat16,float32 --ops attention --repeats 10 \
  --json "$OUT/attention_cuda.json" --markdown "$OUT/attention_cuda.md" > "$OUT/attention.log" 2>&1
log "attention exit $?"
grep -E "^\| attention" "$OUT/attention_cuda.md" | head -20 | tee -a "$OUT/gpu_check.log"

log "microbenchmarks, bf16, (16384, 14336) elementwise and (16384, 4096) norms"
timeout 150 "$PY" -m pyattr bench --device cuda --dtypes bfloat16 --shapes 16384x14336,16384x4096 \
  --ops identity,half,gated,layer_norm,rms_norm --repeats 20 \
  --json "$OUT/micro_cuda.json" --markdown "$OUT/micro_cuda.md" > "$OUT/micro.log" 2>&1
log "micro exit $?"
grep -E "fwd\+bwd|bwd \|" "$OUT/micro_cuda.md" | head -60 | tee -a "$OUT/gpu_check.log"

log "end-to-end relevance run (~1.1B Llama, bf16, seq 4096; with 8 targets in one call vs 8 calls)"
timeout 150 "$PY" -m pyattr bench --e2e --device cuda --dtypes bfloat16 --repeats 3 --targets 8 \
  --json "$OUT/e2e_cuda.json" --markdown "$OUT/e2e_cuda.md" > "$OUT/e2e.log" 2>&1
log "e2e exit $?"
cat "$OUT/e2e_cuda.md" 2>/dev/null | tee -a "$OUT/gpu_check.log"

log "dataset run (~1B Llama, bf16, 64 prompts of 128-1024 tokens; checkpointing; 2 ranks if 2 GPUs)"
timeout 120 "$PY" -m pyattr bench --dataset --device cuda \
  --json "$OUT/dataset_cuda.json" --markdown "$OUT/dataset_cuda.md" > "$OUT/dataset.log" 2>&1
log "dataset exit $? — $(tail -3 "$OUT/dataset.log" | head -1)"
cat "$OUT/dataset_cuda.md" 2>/dev/null | tee -a "$OUT/gpu_check.log"
log "done"
