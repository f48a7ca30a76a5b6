#!/usr/bin/env bash
# The prepared run for a lent GPU machine (docs/benchmarks-and-parity.md, "GPU benchmark mode"):
# `dualrl bench --gpu` on the 1b shape, the most wanted rows first, each stage under its own limit
# inside one total, so that a stage cut short still leaves every row it measured (--json appends
# each row as it is measured) and the next stage is not lost with it.
#
#   on the GPU machine, from the repository root:  bash tools/gpu_session.sh [TOTAL_SECONDS]
#
# TOTAL_SECONDS (default 540) should leave the call's own limit room for the machine's start and
# the transfers.  Rows and logs go to $OUT (the device tool's folder), else runs/gpu-session.
# Ray and pydantic travel as shared/gpu/README.md says, in the ignored folder .gpu (name it in the
# call's carry list): .gpu/raysite.zip with .gpu/unpack_ray_site.sh, and .gpu/whl/*.whl.
set -u
total=${1:-540}
out=${OUT:-runs/gpu-session}
mkdir -p "$out"
start=$(date +%s)
backends=(jax_pjit torch_dtensor-compiled torch_dtensor torch_fsdp)
read -r -a mbs <<<"${MBS:-4 8}"  # micro batches of the 1b size's batch of 8 (a CPU smoke: MBS=2)
python=${PYTHON:-python3}        # the GPU image's python holds torch and JAX; elsewhere e.g. PYTHON=.venv/bin/python

if ! "$python" -c "import ray" 2>/dev/null && [ -f .gpu/raysite.zip ]; then
    # shellcheck disable=SC1091
    source .gpu/unpack_ray_site.sh .gpu/raysite.zip
fi
if ! "$python" -c "import pydantic" 2>/dev/null && compgen -G ".gpu/whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit,driver_version --format=csv >"$out/gpu.txt" 2>&1

# stage NAME LIMIT_SECONDS ARGS...: one `dualrl bench --gpu` run under min(LIMIT, what is left).
stage() {
    local name=$1 limit=$2 left
    shift 2
    left=$((total - ($(date +%s) - start)))
    if [ "$left" -lt 60 ]; then
        echo "$name: skipped, ${left}s left"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "$name: up to ${limit}s, from $(date -u +%T)"
    # the model is built once (about a minute at 1b) and reused by the next stage
    timeout "$limit" "$python" -m dualrl bench --gpu --model-dir /tmp/dualrl-gpu-1b --json "$out/$name.jsonl" "$@" \
        >"$out/$name.log" 2>&1
    echo "$name: rc $? at $(date -u +%T)"
    grep -E "^(\||roof:|copy:|ERROR|SKIPPED)" "$out/$name.log"
}

# throughput and refit of every backend beside HF eager, with the roofline; then the fp32 loss check
stage throughput 420 --sections throughput refit --mbs "${mbs[@]}" --backends "${backends[@]}"
stage loss 600 --sections loss --check-steps 3 --backends "${backends[@]}"
