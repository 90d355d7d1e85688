"""examples/serve_deepseek_tp8.py --engine trtllm --dry-run: the trtllm-serve configuration it would use, and what
it refuses (one line per reason, exit status 2)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve_deepseek_tp8.py"


def dry_run(model, *flags):
    return subprocess.run([sys.executable, str(EXAMPLE), model, "--engine", "trtllm", "--dry-run", *flags],
                          capture_output=True, text=True, timeout=120)


def test_trtllm_dry_run_prints_the_switch_and_the_yaml():
    result = dry_run("deepseek-ai/DeepSeek-V3", "--num-speculative-tokens", "2", "--block-size", "32")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "TLLM_FMHA_LIBS=+cute_mla_fp8 trtllm-serve deepseek-ai/DeepSeek-V3" in text
    assert "--tp_size 8" in text and "--backend pytorch" in text
    assert "dtype: fp8" in text and "tokens_per_block: 32" in text
    assert "num_nextn_predict_layers: 2" in text


def test_trtllm_dry_run_passes_the_p_precision_to_the_ranks():
    result = dry_run("deepseek-ai/DeepSeek-V3", "--num-speculative-tokens", "3", "--p-precision", "fp8x2")
    assert result.returncode == 0, result.stderr
    assert "TLLM_FMHA_LIBS=+cute_mla_fp8 CUTE_MLA_P_PRECISION=fp8x2 trtllm-serve" in result.stdout
    assert "  CUTE_MLA_P_PRECISION: fp8x2" in result.stdout  # env_overrides too
    plain = dry_run("deepseek-ai/DeepSeek-V3")
    assert plain.returncode == 0 and "CUTE_MLA_P_PRECISION" not in plain.stdout


def deepseek_checkpoint(path, heads):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "num_attention_heads": heads}))
    return str(path)


@pytest.mark.parametrize("flags, heads, message", [
    (["--block-size", "16"], None, "tokens_per_block 16 is not supported: cute_mla_fp8 pages hold 32 or 64 tokens"),
    (["--num-speculative-tokens", "8"], None, "8 MTP layers make generation queries of 9 tokens: cute_mla_fp8 "
                                              "decodes at most 8 query tokens per request (at most 7 MTP layers)"),
    (["--tensor-parallel-size", "3"], 128, "--tensor-parallel-size 3 does not divide the model's 128 attention heads"),
    (["--tensor-parallel-size", "32"], 128, "4 attention heads per GPU (128 over --tensor-parallel-size 32): the "
                                            "kernels take 8 to 128 heads per GPU"),
])
def test_trtllm_dry_run_refuses_what_the_library_cannot_run(tmp_path, flags, heads, message):
    model = deepseek_checkpoint(tmp_path / "ds3", heads) if heads else "deepseek-ai/DeepSeek-V3"
    result = dry_run(model, *flags)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"serve_deepseek_tp8.py: {message}\n"
