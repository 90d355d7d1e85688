"""examples/serve_deepseek_tp8.py --dry-run under vLLM 0.33, on a DeepSeek-V3-shaped config (no weights, no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import tiny_deepseek

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "serve_deepseek_tp8.py")


def dry_run(model, *flags):
    proc = subprocess.run([sys.executable, EXAMPLE, model, "--dry-run", *flags], capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout
    config = json.loads(out[:out.index("command: ")])
    command = out[out.index("command: "):].strip()
    return proc.returncode, config, command


def deepseek_v3_config(path):
    """DeepSeek-V3's attention shape: 128 heads, latent 512 + rope 64 (the layers themselves are not loaded)."""
    tiny_deepseek.write_config(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(num_attention_heads=128, num_key_value_heads=128)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def test_dry_run_resolves_backend_block_size_and_graph_mode(tmp_path):
    model = deepseek_v3_config(str(tmp_path / "ds3"))
    rc, config, command = dry_run(model)
    assert rc == 0, config
    assert config["backend"] == "mla_backend.integrations.vllm.backend.CuteMLAFP8Backend"
    assert config["block_size"] == 64 and config["head_size"] == 576 and config["heads_per_gpu"] == 16
    assert config["valid_on_sm90"] and config["speculative"] is None
    assert "q_len 1" in config["decode_graphs"] and "UNIFORM_BATCH" in config["decode_graphs"]
    assert "--attention-backend CUTE_MLA_FP8" in command and "--kv-cache-dtype fp8" in command
    assert "--tensor-parallel-size 8" in command


def test_dry_run_with_mtp_and_pages_of_32(tmp_path):
    model = deepseek_v3_config(str(tmp_path / "ds3"))
    rc, config, command = dry_run(model, "--num-speculative-tokens", "3", "--block-size", "32",
                                  "--port", "8001")
    assert rc == 0, config
    assert config["block_size"] == 32
    assert config["speculative"] == {"method": "mtp", "num_speculative_tokens": 3}
    assert "q_len 4" in config["decode_graphs"]
    assert '"method": "mtp"' in command and command.endswith("--port 8001")


def test_dry_run_passes_the_p_planes_choice_to_vllm(tmp_path):
    model = deepseek_v3_config(str(tmp_path / "ds3"))
    rc, config, command = dry_run(model, "--num-speculative-tokens", "1", "--p-planes", "1")
    assert rc == 0, config
    assert command.startswith("command: CUTE_MLA_P_PLANES=1 vllm serve ")
    rc, config, command = dry_run(model)
    assert rc == 0 and "CUTE_MLA_P_PLANES" not in command
