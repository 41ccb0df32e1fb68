"""EAGLE heads for the tests: random weights in vLLM's and SpecForge's checkpoint layout."""

import json

import torch
from safetensors.torch import save_file

from dynaspec.models.config import ModelConfig

AUX_LAYERS = [0, 1, 1]  # the tiny target has 2 layers: vLLM's default (2, 1, -1) does not fit it


def target_config(path) -> ModelConfig:
    return ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))


def write_head(path, method, target: ModelConfig, seed=0, draft_vocab=None, std=0.3, **config):
    """A random-weight head in vLLM's and SpecForge's layout: config.json + model.safetensors."""
    h, heads, kv_heads, inter = target.hidden_size, 4, 2, 96
    d = target.hidden_size // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, mean=0.0):
        return (torch.randn(*shape, generator=g) * std + mean).contiguous()

    eagle3 = method == "eagle3"
    draft_vocab = draft_vocab or target.vocab_size
    layer = "midlayer." if eagle3 else "layers.0."
    qkv_in = 2 * h if eagle3 else h
    tensors = {
        "fc.weight": rand(h, 3 * h if eagle3 else 2 * h),
        f"{layer}self_attn.q_proj.weight": rand(heads * d, qkv_in),
        f"{layer}self_attn.k_proj.weight": rand(kv_heads * d, qkv_in),
        f"{layer}self_attn.v_proj.weight": rand(kv_heads * d, qkv_in),
        f"{layer}self_attn.o_proj.weight": rand(h, heads * d),
        f"{layer}mlp.gate_proj.weight": rand(inter, h),
        f"{layer}mlp.up_proj.weight": rand(inter, h),
        f"{layer}mlp.down_proj.weight": rand(h, inter),
        f"{layer}post_attention_layernorm.weight": rand(h, mean=1.0),
    }
    if eagle3:
        # draft ids: every other target id from 3 on (the special tokens, 0..2, never drafted), in
        # order, as SpecForge writes them
        targets = torch.arange(3, target.vocab_size, 2)[:draft_vocab]
        t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
        t2d[targets] = True
        tensors |= {
            f"{layer}input_layernorm.weight": rand(h, mean=1.0),
            f"{layer}hidden_norm.weight": rand(h, mean=1.0),
            "norm.weight": rand(h, mean=1.0),
            "lm_head.weight": rand(len(targets), h),
            "d2t": targets - torch.arange(len(targets)),
            "t2d": t2d,
        }
        draft_vocab = len(targets)
    else:
        tensors["fc.bias"] = rand(h)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLMEagle"],
        "model_type": "llama",
        "hidden_size": h,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "vocab_size": target.vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
    }
    if eagle3:
        cfg |= {
            "draft_vocab_size": draft_vocab,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS},
        }
    cfg |= config
    (path / "config.json").write_text(json.dumps(cfg))
    return path
