#!/usr/bin/env bash
# The prepared run for a CUDA machine, in one command from the repository root:
#
#   bash benchmarks/cuda_check.sh            # log and results in ${OUT:-/tmp/twinserve-cuda}
#   SECTIONS="calibrate simulate" bash benchmarks/cuda_check.sh   # only some sections
#
# Sections, in the order they run (each under its own time limit, so one that hangs or fails
# leaves the others their time; a table of each one's status and seconds is printed last):
#   env        the GPU, torch and triton;
#   model      a random-weight Llama-3-8B-shaped model in bf16 (benchmarks/random_model.py);
#   tests      (beside `model`: tiny models, little GPU time) the CUDA tests: Triton kernels
#              (paged attention, multi-LoRA shrink/expand, quantized matvec, MoE; GGUF files on
#              CUDA against the CPU) against their torch references, and the engine's greedy
#              tokens on CUDA (every scheduling regime, CUDA graphs against eager) against HF
#              transformers (through the tensor-parallel layers at TP=1); speculative decoding's
#              verification batches (Triton attention, 1 + k queries per sequence) and greedy
#              tokens with drafts equal to those without, CUDA graphs on and off, and uniform
#              verifications (every sequence 1 + k queries) replaying their (batch, k) graphs;
#   calibrate  `twinserve calibrate --device cuda` on that model: the twin's profile of this GPU
#              ($OUT/gpu-calibrated.json, the CPU calibration's format) and its samples;
#   simulate   a simulation that loads that profile;
#   validate   (not in the default run: `SECTIONS="model validate"`, a second call) the twin
#              against real replays on this GPU, the fidelity study's error table: three short
#              workloads (chat lengths from the Azure conversation trace, long prompts, prefix
#              hits), each replayed 3 times for real and through the twin, on
#              $OUT/gpu-calibrated.json when present, else on a calibration of the step space
#              the workloads reach (`validate` without --profile);
#   profile    one 16-token prefill and one decode at context 512, op by op (torch.profiler):
#              host-bound launches against device time (benchmarks/kernel_profile.py);
#   kvtransfer (not in the default run: `SECTIONS=kvtransfer`) the Peer connector on CUDA:
#              two processes on the GPU sharing KV regions by CUDA IPC handles; transfers of
#              1-64 Llama-3-8B blocks at 1, 2, 4 at once (bandwidth, latency: the twin's
#              kv_link), and 1P1D / 2P1D greedy tokens on the bundled model equal one engine's
#              (tests/gpu/test_pd_engine.py, run on CUDA here);
#   offline    the offline benchmark (64 x 128 and batch 1 x 128 generated tokens) with CUDA
#              graphs next to HF transformers `generate`, then eager; and the H200 decode floor.
#
# The machine may be offline: it needs torch, triton, safetensors, tokenizers, numpy, scipy,
# pytest and transformers installed. The rest travels as wheels in .whl/ (installed to /tmp/site
# when present): simpy (the simulator), gguf (model loading) and llguidance (structured outputs),
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#       simpy==4.1.2 gguf==0.19.0 llguidance==1.9.1
set -uo pipefail
OUT=${OUT:-/tmp/twinserve-cuda}
ALL_SECTIONS="env model tests calibrate simulate profile offline validate kvtransfer"
SECTIONS=${SECTIONS:-env model tests calibrate simulate profile offline}
for s in $SECTIONS; do
    [[ " $ALL_SECTIONS " == *" $s "* ]] || { echo "unknown section '$s'; sections: $ALL_SECTIONS" >&2; exit 2; }
done
mkdir -p "$OUT"
exec > >(tee "$OUT/cuda_check.log") 2>&1
export PYTHONUNBUFFERED=1
ROOT=$(pwd)
MODEL=/tmp/llama-3-8b-random
SUMMARY=/tmp/twinserve-cuda-summary.txt
: > "$SUMMARY"
export OUT MODEL

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# import the checkout as `twinserve` without installing it (no build backend needed offline)
mkdir -p /tmp/twinserve-src && ln -sfn "$ROOT" /tmp/twinserve-src/twinserve
export PYTHONPATH=/tmp/twinserve-src${PYTHONPATH:+:$PYTHONPATH}

wanted() { [[ " $SECTIONS " == *" $1 "* ]]; }

# section NAME SECONDS COMMAND...: runs COMMAND (a function below or a program) under a time
# limit and adds its status and seconds to the summary
section() {
    local name=$1 limit=$2 rc; shift 2
    echo "== $name (limit ${limit} s)"
    local start=$SECONDS
    if declare -F "$1" >/dev/null; then
        timeout --kill-after=10 "$limit" bash -c "$*"
    else
        timeout --kill-after=10 "$limit" "$@"
    fi
    rc=$?
    local status="ok"
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status="TIMEOUT"; elif [ $rc -ne 0 ]; then status="rc=$rc"; fi
    printf '%-16s %-8s %5d s\n' "$name" "$status" $((SECONDS - start)) >> "$SUMMARY"
    return $rc
}

run_tests() {
    local workers=""
    python3 -c "import xdist" 2>/dev/null && workers="-n 4"
    # shellcheck disable=SC2086
    python3 -m pytest -q -p no:cacheprovider -m cuda $workers --junitxml="$OUT/cuda_tests.xml" \
        tests/gpu/test_triton_attention.py tests/gpu/test_triton_lora.py tests/gpu/test_engine_equivalence.py \
        tests/gpu/test_triton_quant.py tests/gpu/test_triton_moe.py tests/gpu/test_quant_torch_dequant.py \
        tests/gpu/test_spec_decode_triton.py tests/gpu/test_spec_decode.py \
        > "$OUT/cuda_tests.log" 2>&1
}

make_model() {
    python3 -m twinserve.benchmarks.random_model --config llama-3-8b --dtype bfloat16 \
        --device cuda --out "$MODEL"
}

calibrate() {  # extra flags (--enforce-eager) pass through
    python3 -m twinserve.entrypoints.cli.main calibrate --device cuda --dtype bfloat16 --model "$MODEL" \
        --profile-model llama-3-8b --max-model-len 8192 --max-num-batched-tokens 8192 \
        --out "$OUT/gpu-calibrated.json" --samples-out "$OUT/gpu-calibration-samples.csv" "$@"
}

simulate() {
    python3 -m twinserve.entrypoints.cli.main simulate --hardware "$OUT/gpu-calibrated.json" \
        --model llama-3-8b --num-requests 200 --disable-tqdm --out /tmp/sim-gpu-calibrated | tail -3
}

kv_transfer() {  # Llama-3-8B's block: 32 layers, 8 KV heads, head dim 128, block 16, bf16 (2 MiB)
    python3 - <<'PY' || return 1
from twinserve.gpu.kv_transfer.region import KVLayout
from twinserve.gpu.measurement.kv_transfer import aggregate_bandwidth, measure_link
if __name__ == "__main__":
    layout = KVLayout(32, 16, 8, 128, "bfloat16", 256)
    fit, samples = measure_link(layout, log=print, device="cuda")
    print(f"kv_link on CUDA IPC: {fit.to_kv_link()}; aggregate by concurrency: "
          f"{aggregate_bandwidth(samples)}")
PY
    python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_pd_engine.py
}

validate_workload() {  # NAME, then the workload's flags
    local name=$1; shift
    local profile=()
    [ -f "$OUT/gpu-calibrated.json" ] && profile=(--profile "$OUT/gpu-calibrated.json")
    python3 -m twinserve.entrypoints.cli.main validate --device cuda --dtype bfloat16 \
        --model "$MODEL" --max-model-len 4096 --max-num-batched-tokens 4096 --real-repeats 3 \
        --profile-cache "$OUT/profile-cache" "${profile[@]}" --quiet --out "$OUT/validate-$name" "$@"
}

kernel_profile() {
    python3 -m twinserve.benchmarks.kernel_profile --model "$MODEL" --device cuda --dtype bfloat16 \
        --max-model-len 8192 --step prefill:16 --step prefill:1024 --step decode:1x512 \
        --step decode:64x512 --top 12
}

offline() {
    section "offline graphs" 150 python3 -m twinserve.benchmarks.offline_throughput \
        --model "$MODEL" --device cuda --dtype bfloat16 --workloads batch single --repeats 3 \
        --hardware h200
    section "offline eager" 80 python3 -m twinserve.benchmarks.offline_throughput \
        --model "$MODEL" --device cuda --dtype bfloat16 --workloads batch single --repeats 3 \
        --enforce-eager --skip-hf
}

export -f run_tests make_model calibrate simulate kernel_profile validate_workload

if wanted env; then
    echo "== env"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.version.cuda, torch.cuda.get_device_name())" || exit 1
fi

# The tests use tiny models and little of the GPU: they run while the 8B model is drawn and written.
tests_pid=""
if wanted tests; then
    section tests 240 run_tests &
    tests_pid=$!
fi
if wanted model; then
    section model 150 make_model
fi
tests_rc=0
if [ -n "$tests_pid" ]; then
    wait "$tests_pid"; tests_rc=$?
    tail -25 "$OUT/cuda_tests.log"
fi
if wanted calibrate; then
    section calibrate 240 calibrate
    rc=$?  # a failure (not a time-out) with CUDA graphs: the profile of the eager engine instead
    if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $rc -ne 137 ]; then
        section "calibrate eager" 200 calibrate --enforce-eager
    fi
fi
if wanted simulate; then section simulate 45 simulate; fi
if wanted profile; then section profile 90 kernel_profile; fi
if wanted validate; then
    section "validate chat" 150 validate_workload chat --trace azure-conv --num-requests 48 \
        --time-scale 0.5 --max-output-tokens 128
    section "validate long" 120 validate_workload long --trace synthetic --num-requests 16 \
        --request-rate 2 --input-len 3000 --output-len 64
    section "validate prefix" 120 validate_workload prefix --trace synthetic --num-requests 48 \
        --request-rate 8 --input-len 1024 --output-len 64 --prefix-len 768 --prefix-share 0.9
fi
if wanted offline; then offline; fi
if wanted kvtransfer; then section kvtransfer 240 kv_transfer; fi

echo "== summary (section, status, seconds)"
cat "$SUMMARY"
exit $tests_rc
