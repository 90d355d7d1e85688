"""examples/serve_deepseek_tp8.py under vLLM 0.33, on a DeepSeek-V3-shaped config (no weights, no GPU): what
--dry-run resolves, and what the example refuses (one line per reason, exit status 2).

One test runs the script as a user does; the others call its main() in this process (vLLM is imported once).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import tiny_deepseek
from vllm_engine import engine_config

from vllm.config import set_current_vllm_config
from vllm.platforms.interface import DeviceCapability

from mla_backend.integrations.vllm.backend import CuteMLAFP8Backend

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "serve_deepseek_tp8.py")
_spec = importlib.util.spec_from_file_location("serve_deepseek_tp8", EXAMPLE)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def deepseek_v3_config(path, **overrides):
    """DeepSeek-V3's attention shape and MTP layer: 128 heads, latent 512 + rope 64 (no weights)."""
    tiny_deepseek.write_config(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_attention_heads=128,
                  num_key_value_heads=128, num_nextn_predict_layers=1, **overrides)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return deepseek_v3_config(str(tmp_path_factory.mktemp("ds3")))


def parse(out):
    config = json.loads(out[:out.index("command: ")])
    return config, out[out.index("command: "):].strip()


def dry_run(capsys, model, *flags):
    rc = example.main([model, "--dry-run", *flags])
    out, err = capsys.readouterr()
    if rc != 0:
        return rc, out, err
    return rc, *parse(out)


def test_the_script_resolves_backend_block_size_and_graph_mode(model):
    proc = subprocess.run([sys.executable, EXAMPLE, model, "--dry-run"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    config, command = parse(proc.stdout)
    assert config["backend"] == "mla_backend.integrations.vllm.backend.CuteMLAFP8Backend"
    assert config["block_size"] == 64 and config["head_size"] == 576 and config["heads_per_gpu"] == 16
    assert config["speculative"] is None and config["decode_q_lens"] == [1] and config["p_precision"] == "fp8"
    # vLLM's resolver, for a builder with UNIFORM_BATCH support under Model Runner V2
    assert config["model_runner"] == "V2"
    assert config["cudagraph_mode_requested"] == config["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert config["decode_graphs"] == "FULL CUDA graphs for uniform decode batches of q_len 1 (builder support " \
                                      "UNIFORM_BATCH)"
    assert "--attention-backend CUTE_MLA_FP8" in command and "--kv-cache-dtype fp8" in command
    assert "--tensor-parallel-size 8" in command and "--additional-config" not in command


def test_dry_run_with_mtp_and_pages_of_32(capsys, model):
    rc, config, command = dry_run(capsys, model, "--num-speculative-tokens", "3", "--block-size", "32",
                                  "--port", "8001")
    assert rc == 0, config
    assert config["block_size"] == 32 and config["decode_q_lens"] == [1, 2, 3, 4]
    assert config["speculative"] == {"method": "mtp", "num_speculative_tokens": 3}
    assert config["cudagraph_mode"] == "FULL_AND_PIECEWISE" and "q_len 4" in config["decode_graphs"]
    assert '"method": "mtp"' in command and command.endswith("--port 8001")


@pytest.mark.parametrize("flags, requested, resolved", [
    (["--enforce-eager"], "NONE", "NONE"),
    (["-O0"], "NONE", "NONE"),
    (["-O", "1"], "PIECEWISE", "PIECEWISE"),
    (["--optimization-level=3"], "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE"),
])
def test_dry_run_resolves_the_graph_mode_the_passed_flags_ask_for(capsys, model, flags, requested, resolved):
    rc, config, command = dry_run(capsys, model, *flags)
    assert rc == 0, config
    assert (config["cudagraph_mode_requested"], config["cudagraph_mode"]) == (requested, resolved)
    assert command.endswith(" ".join(flags))


def test_dry_run_passes_the_p_precision_to_vllm(capsys, model):
    rc, config, command = dry_run(capsys, model, "--num-speculative-tokens", "1", "--p-precision", "fp8x2")
    assert rc == 0, config
    assert config["p_precision"] == "fp8x2"
    assert """--additional-config '{"cute_mla_fp8": {"p_precision": "fp8x2"}}'""" in command


def backend_reasons(tmp_path, **engine):
    """What the backend itself says, inside the engine configuration, as vLLM's selector asks it."""
    with set_current_vllm_config(engine_config(tmp_path, **engine)):
        return CuteMLAFP8Backend.validate_configuration(
            head_size=576, dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=64, use_mla=True, has_sink=False,
            use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
            device_capability=DeviceCapability(*example.TARGET_CAPABILITY), attn_type="decoder")


def test_more_than_seven_draft_tokens_are_refused_with_the_backends_words(capsys, model, tmp_path):
    rc, out, err = dry_run(capsys, model, "--num-speculative-tokens", "8")
    (reason,) = backend_reasons(tmp_path, num_speculative_tokens=8)
    assert (rc, out, err) == (2, "", f"serve_deepseek_tp8.py: {reason}\n")
    assert "num_speculative_tokens <= 7" in reason


@pytest.mark.parametrize("flags, config, message", [
    (["--block-size", "16"], {}, "block size 16 is not supported: CUTE_MLA_FP8 pages hold 32 or 64 tokens "
                                 "(--block-size)"),
    (["--tensor-parallel-size", "32"], {}, "4 attention heads per GPU (128 over --tensor-parallel-size 32): the "
                                           "kernels take 8 to 128 heads per GPU"),
    (["--tensor-parallel-size", "3"], {}, "--tensor-parallel-size 3 does not divide the model's 128 attention heads"),
    ([], {"torch_dtype": "float16"}, "dtype float16 is not supported: CUTE_MLA_FP8 returns its decode output in "
                                     "bfloat16, which vLLM's MLA layer multiplies into an output of the model dtype; "
                                     "serve with --dtype bfloat16"),
])
def test_what_cannot_run_is_refused_in_one_line_with_exit_status_2(capsys, tmp_path, flags, config, message):
    model = deepseek_v3_config(str(tmp_path / "ds3"), **config)
    assert dry_run(capsys, model, *flags) == (2, "", f"serve_deepseek_tp8.py: {message}\n")
    # the real run refuses the same way, before it hands over to `vllm serve`
    assert example.main([model, *flags]) == 2
