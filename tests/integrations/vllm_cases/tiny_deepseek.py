"""A tiny DeepSeek-V2-style model (MLA with the real latent sizes: kv_lora_rank 512, rope 64), made from a seed.

`write_config` writes only config.json (enough for vLLM's ModelConfig and for engine-configuration tests);
`write_checkpoint` also saves random weights with transformers, for end-to-end generation. Nothing is
downloaded and nothing is committed: each test writes its own copy into a temporary folder.
"""

from __future__ import annotations

import json
import os

NUM_HEADS = 16
CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": NUM_HEADS,
    "num_key_value_heads": NUM_HEADS,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    # Every layer dense: keeps the model small and avoids the MoE kernels, which are not under test.
    "first_k_dense_replace": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "initializer_range": 0.02,
}


def write_config(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=1)
    return path


def write_checkpoint(path: str, seed: int = 0) -> str:
    """Random weights (init std 0.02) saved as a real checkpoint: a broken attention changes the tokens."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    write_config_dtype = json.load(open(os.path.join(path, "config.json")))
    write_config_dtype["torch_dtype"] = "bfloat16"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(write_config_dtype, f, indent=1)
    return path
