#!/usr/bin/env bash
# The prepared run for a CUDA machine, in one command from the repository root:
#
#   bash benchmarks/cuda_check.sh            # log and results in ${OUT:-/tmp/twinserve-cuda}
#
# 1. the environment (GPU, torch, triton);
# 2. the CUDA tests: Triton kernels (paged attention, multi-LoRA shrink/expand, quantized matvec;
#    GGUF files run on CUDA against the CPU) against their torch
#    references, and the engine's greedy tokens
#    on CUDA (every scheduling regime, CUDA graphs against eager) against HF transformers (they run
#    through the tensor-parallel layers at TP=1; TP>1 needs one GPU per rank: simulated only);
# 3. a random-weight Llama-3-8B-shaped model in bf16 (benchmarks/random_model.py), then the
#    offline benchmark on it: 64 x 128 and batch 1 x 128 generated tokens, with CUDA graphs and
#    eager, next to HF transformers `generate`, and the batch-1 decode floor of an H200;
# 4. `twinserve calibrate --device cuda` on that model: the twin's profile of this GPU
#    ($OUT/gpu-calibrated.json, the CPU calibration's format), then a simulation that loads it.
#
# The machine may be offline: it needs torch, triton, safetensors, tokenizers, numpy, pytest and
# transformers installed. Other packages travel as wheels in .whl/ (installed to /tmp/site when
# present); the decode-floor line imports the simulator, so it needs simpy and scipy (printed
# after the figures, so a missing wheel costs only that line):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       simpy==4.1.2 scipy==1.17.1
set -uo pipefail
OUT=${OUT:-/tmp/twinserve-cuda}
mkdir -p "$OUT"
exec > >(tee "$OUT/cuda_check.log") 2>&1
export PYTHONUNBUFFERED=1
ROOT=$(pwd)

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# import the checkout as `twinserve` without installing it (no build backend needed offline)
mkdir -p /tmp/twinserve-src && ln -sfn "$ROOT" /tmp/twinserve-src/twinserve
export PYTHONPATH=/tmp/twinserve-src${PYTHONPATH:+:$PYTHONPATH}

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.version.cuda, torch.cuda.get_device_name())" || exit 1

echo "== CUDA tests"
python3 -m pytest -q -p no:cacheprovider -m cuda --junitxml="$OUT/cuda_tests.xml" \
    tests/test_triton_attention.py tests/test_triton_lora.py tests/test_engine_equivalence.py \
    tests/test_triton_quant.py tests/test_triton_moe.py tests/test_quant_torch_dequant.py
tests_rc=$?

echo "== random-weight Llama-3-8B (bf16)"
MODEL=/tmp/llama-3-8b-random
start=$(date +%s)
python3 -m twinserve.benchmarks.random_model --config llama-3-8b --dtype bfloat16 --device cuda \
    --out "$MODEL" || exit 1
echo "written in $(( $(date +%s) - start )) s"

echo "== offline throughput, CUDA graphs"
python3 -m twinserve.benchmarks.offline_throughput --model "$MODEL" --device cuda --dtype bfloat16 \
    --workloads batch single --repeats 3 --hardware h200
echo "== offline throughput, eager (no HF rerun)"
python3 -m twinserve.benchmarks.offline_throughput --model "$MODEL" --device cuda --dtype bfloat16 \
    --workloads batch single --repeats 3 --enforce-eager --skip-hf

echo "== GPU calibration: the twin's profile of this GPU for Llama-3-8B (twinserve calibrate)"
python3 -m twinserve.entrypoints.cli calibrate --device cuda --dtype bfloat16 --model "$MODEL" \
    --profile-model llama-3-8b --quick --max-model-len 8192 --max-num-batched-tokens 8192 \
    --out "$OUT/gpu-calibrated.json" --samples-out "$OUT/gpu-calibration-samples.csv"
python3 -m twinserve.entrypoints.cli simulate --hardware "$OUT/gpu-calibrated.json" \
    --model llama-3-8b --num-requests 200 --disable-tqdm --out "$OUT/sim-gpu-calibrated" | tail -3

echo "== CUDA tests exit status: $tests_rc"
exit $tests_rc
