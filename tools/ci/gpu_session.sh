#!/usr/bin/env bash
# One prepared GPU session (issue 36): on a CUDA machine without network, in the repo root.
#
#   bash tools/ci/gpu_session.sh            # logs, JSON and the gate's evidence under $OUT
#   bash tools/ci/gpu_session.sh profile    # only the decode step by kernel + nano-vllm
#   bash tools/ci/gpu_session.sh sweep      # only the split-KV target sweep of the decode step
#   bash tools/ci/gpu_session.sh probe      # the decode tile sweep with gaps, the gate's step test
#   bash tools/ci/gpu_session.sh verify     # the graph tests and the nano-vllm profiles, no gate
#
# 1. installs the wheels carried in .whl/ (the runtime's dependencies the machine lacks, and the
#    minisgl / pytest-cardgate wheels, and minisgl-bench's if carried, for their entry points
#    only: they import from the tree, minisgl.benchmark and minisgl.testing from
#    packages/minisgl-bench/src, which the runtime's minisgl extends its path over)
# 2. the card gate of P2-001 (its gpu tests, the launch budget, the speed gates)
# 3. the other `gpu` tests
# 4. decode step per arm (fused Triton layer, torch ops) and the nano-vllm profile on Qwen3-0.6B
#    and Qwen2.5-0.5B (dummy weights, bf16), JSON per run
# Each step has its own time limit, cut to what is left of $GPU_BUDGET_S (a step with under 30 s
# left is not started); a failed step is reported and the next one still runs. Logs and JSON go
# to a work folder, packed into $OUT/results.tgz after every step (what finished comes back).
set -u
OUT=${OUT:-gpu-out}
WORK=${GPU_WORK:-/tmp/gpu-run}
BUDGET=${GPU_BUDGET_S:-570}
mkdir -p "$OUT" "$WORK"
ROOT=$(pwd)
SITE=${GPU_SITE:-/tmp/site}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
status=0
pack() {
    tar czf "$OUT/results.tgz.tmp" -C "$WORK" . && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"
}
step() {  # step NAME LIMIT_S CMD...: output to $WORK/NAME.log, rc recorded
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - SECONDS - 10))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 30 ]; then
        echo "=== $name: not run ($left s left)" | tee "$WORK/$name.log"
        status=1
        return 0
    fi
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s)"
    timeout -k 5 "$limit" "$@" >"$WORK/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - t0)) s"
    tail -n 12 "$WORK/$name.log"
    [ "$rc" = 0 ] || status=1
    pack
    return 0
}

"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${GPU_WHEELS:-.whl}"/*.whl || exit 1
rm -rf "$SITE/minisgl" "$SITE/cardgate"  # their dist-info stays: entry points, versions
SRC="$ROOT/packages/minisgl/src:$ROOT/packages/minisgl-bench/src:$ROOT/packages/cardgate/src"
export PYTHONPATH="$SRC:$SITE"
"$PY" - <<'EOF' || exit 1
import cardgate, minisgl, minisgl.benchmark, minisgl.testing, torch, triton
print("minisgl", minisgl.__file__, "| bench", minisgl.benchmark.__file__,
      "| cardgate", cardgate.__file__)
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
EOF
# a copied checkout: another owner, maybe other file modes, maybe no .git or one at an older
# commit (the device tool's own checkout); a carried copy of this machine's .git (.gitcopy/,
# excluded from git's view) replaces it, so the gate sees the commit that is checked out here
if [ -d .gitcopy ]; then rm -rf .git && cp -a .gitcopy .git; fi
git config --global --add safe.directory '*'
git config core.fileMode false
git rev-parse HEAD && git status --short | head -n 5
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$WORK/gpu.txt"

QWEN25=worklog/models/Qwen2.5-0.5B-Instruct
QWEN3=worklog/models/Qwen3-0.6B
offline() {  # offline NAME MODEL PROFILE [args]: the harness on dummy weights, bf16, triton
    local name=$1 model=$2 profile=$3
    shift 3
    step "$name" 100 "$PY" -m minisgl.benchmark.harness offline --no-progress \
        --model-path "$model" --dummy-weights --dtype bfloat16 --profile "$profile" \
        --set llm.attention_backend=triton --set llm.device=cuda --out "$WORK/$name.json" "$@"
}

if [ "${1:-}" = profile ]; then  # the decode step by kernel, and the nano-vllm profile fused
    step profile-qwen25-b64 80 "$PY" -m minisgl.benchmark.decode_step --model-path "$QWEN25" \
        --dummy-weights --batch 64 --context 512 --arms fused,torch --profile-steps 20 \
        --out "$WORK/profile-qwen25-b64.json"
    offline nano-vllm-qwen25 "$QWEN25" nano-vllm
    step profile-qwen3-b256 60 "$PY" -m minisgl.benchmark.decode_step --model-path "$QWEN3" \
        --dummy-weights --batch 256 --context 600 --arms fused --profile-steps 10 \
        --out "$WORK/profile-qwen3-b256.json"
    pack
    echo "gpu session (profile): status=$status"
    exit $status
fi
if [ "${1:-}" = probe ]; then  # the decode step's tile sweep, gaps, and the gate's own test
    step probe-qwen25-b64 150 "$PY" -m minisgl.benchmark.decode_step --model-path "$QWEN25" \
        --dummy-weights --batch 64 --context 512 --arms fused --decode-tiles 64x4,128x4,128x8 \
        --profile-steps 10 --profile-top 30 --out "$WORK/probe-qwen25-b64.json"
    step probe-gate-test 90 "$PY" -m pytest -p no:randomly -p no:cacheprovider -q -s -n 0 \
        tests/test_gpu_fast_path.py -k "decode_step_batch_64"
    pack
    echo "gpu session (probe): status=$status"
    exit $status
fi
if [ "${1:-}" = verify ]; then  # the graph tests and the nano-vllm profiles, no gate
    step verify-tests 110 "$PY" -m pytest -p no:randomly -p no:cacheprovider -q -s -n 0 \
        tests/test_gpu_fast_path.py -k "sync_debug_error or padding_isolation or nano_vllm"
    offline nano-vllm-qwen3 "$QWEN3" nano-vllm
    pack
    echo "gpu session (verify): status=$status"
    exit $status
fi
if [ "${1:-}" = sweep ]; then  # the split-KV target of the triton decode, fused layer
    step sweep-qwen25-b64 90 "$PY" -m minisgl.benchmark.decode_step --model-path "$QWEN25" \
        --dummy-weights --batch 64 --context 512 --arms fused --kv-programs-per-sm 2,4,8,16 \
        --profile-steps 10 --profile-top 6 --out "$WORK/sweep-qwen25-b64.json"
    step sweep-qwen3-b64 80 "$PY" -m minisgl.benchmark.decode_step --model-path "$QWEN3" \
        --dummy-weights --batch 64 --context 512 --arms fused --kv-programs-per-sm 2,4,8 \
        --profile-steps 10 --profile-top 6 --out "$WORK/sweep-qwen3-b64.json"
    pack
    echo "gpu session (sweep): status=$status"
    exit $status
fi
step gate-P2-001 330 "$PY" -m cardgate gate P2-001
tar czf "$WORK/evidence.tgz" worklog/evidence/P2-001 kanban 2>/dev/null
git status --short >"$WORK/git-status-after-gate.txt"
step gpu-tests 120 "$PY" -m pytest -m gpu -p no:randomly -p no:cacheprovider -rs -q -n 0 \
    tests/test_gpu.py packages/minisgl/tests/test_fused_decode_layer.py \
    packages/minisgl/tests/test_triton_attention.py
step decode-step-qwen25-b64 90 "$PY" -m minisgl.benchmark.decode_step --model-path "$QWEN25" \
    --dummy-weights --batch 64 --context 512 --arms fused,torch --out "$WORK/decode-step-qwen25-b64.json"
offline nano-vllm-qwen3 "$QWEN3" nano-vllm
MINISGL_FUSED_OPS=off offline nano-vllm-qwen25-torch-ops "$QWEN25" nano-vllm
step decode-step-qwen3-b256 90 "$PY" -m minisgl.benchmark.decode_step --model-path "$QWEN3" \
    --dummy-weights --batch 256 --context 600 --arms fused,torch \
    --out "$WORK/decode-step-qwen3-b256.json"

nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1
pack
echo "gpu session: status=$status"
exit $status
