"""examples/serve_deepseek_tp8.py --engine trtllm --dry-run: the trtllm-serve configuration it would use."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve_deepseek_tp8.py"


def test_trtllm_dry_run_prints_the_switch_and_the_yaml():
    result = subprocess.run([sys.executable, str(EXAMPLE), "deepseek-ai/DeepSeek-V3", "--engine", "trtllm", "--dry-run",
                             "--num-speculative-tokens", "2", "--block-size", "32"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "TLLM_FMHA_LIBS=+cute_mla_fp8 trtllm-serve deepseek-ai/DeepSeek-V3" in text
    assert "--tp_size 8" in text and "--backend pytorch" in text
    assert "dtype: fp8" in text and "tokens_per_block: 32" in text
    assert "num_nextn_predict_layers: 2" in text


def test_trtllm_dry_run_passes_the_p_planes_choice_to_the_ranks():
    result = subprocess.run([sys.executable, str(EXAMPLE), "deepseek-ai/DeepSeek-V3", "--engine", "trtllm", "--dry-run",
                             "--num-speculative-tokens", "3", "--p-planes", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "CUTE_MLA_P_PLANES=1" in result.stdout and "TLLM_FMHA_LIBS=+cute_mla_fp8" in result.stdout
    plain = subprocess.run([sys.executable, str(EXAMPLE), "deepseek-ai/DeepSeek-V3", "--engine", "trtllm", "--dry-run"],
                           capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and "CUTE_MLA_P_PLANES" not in plain.stdout
