"""Our Llama-family forward equals Hugging Face transformers' on tiny random-weight configs."""

import pytest
import torch

from dynaspec.models.attention import build_attention_metadata
from dynaspec.models.build import from_state_dict
from dynaspec.models.config import ModelConfig
from dynaspec.models.llama import LlamaModel

transformers = pytest.importorskip("transformers")

BLOCK = 4


def _hf_model(arch: str, tie: bool):
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[arch]
    kwargs = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        initializer_range=0.2,
        rms_norm_eps=1e-6,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = 32  # differs from hidden/heads on purpose
    if arch == "llama":
        kwargs["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cls(**kwargs), torch_dtype=torch.float32).eval()
    if arch == "qwen2":  # random init zeroes biases: give them values so they are tested
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    return hf


def _ours(hf) -> LlamaModel:
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    return from_state_dict(config, hf.state_dict(), torch.float32, torch.device("cpu"))


def _kv(model: LlamaModel, num_blocks: int):
    c = model.config
    return [
        (
            torch.zeros(num_blocks * BLOCK, c.num_key_value_heads, c.head_dim),
            torch.zeros(num_blocks * BLOCK, c.num_key_value_heads, c.head_dim),
        )
        for _ in range(c.num_hidden_layers)
    ]


def _run(model, kv, ids, start, ctx, table):
    meta = build_attention_metadata([len(ids)], [ctx], [table], BLOCK, torch.device("cpu"))
    hidden = model(torch.tensor(ids), torch.arange(start, start + len(ids)), kv, meta)
    return model.compute_logits(hidden)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers(arch, tie):
    hf = _hf_model(arch, tie)
    ours = _ours(hf)
    ids = torch.randint(0, 97, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0].float()  # [23, vocab]
    table = [5, 2, 7, 0, 3, 1]  # scattered blocks on purpose
    kv = _kv(ours, 8)
    # prefill in two chunks, then decode token by token: all through the paged cache
    pieces = [
        _run(ours, kv, ids[0, :10].tolist(), 0, 10, table),
        _run(ours, kv, ids[0, 10:19].tolist(), 10, 19, table),
    ]
    for p in range(19, 23):
        pieces.append(_run(ours, kv, [ids[0, p].item()], p, p + 1, table))
    got = torch.cat(pieces)
    rel = (got - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, f"{arch}: relative error {rel:.2e}"


def test_batched_varlen_equals_single():
    hf = _hf_model("qwen2", False)
    ours = _ours(hf)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (3, 11, 20, 1)]
    tables = [[0, 1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13]]
    singles = []
    for s, t in zip(seqs, tables):
        singles.append(_run(ours, _kv(ours, 14), s, 0, len(s), t))
    kv = _kv(ours, 14)
    meta = build_attention_metadata(
        [len(s) for s in seqs], [len(s) for s in seqs], tables, BLOCK, torch.device("cpu")
    )
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    batched = ours.compute_logits(ours(ids, pos, kv, meta))
    torch.testing.assert_close(batched, torch.cat(singles), rtol=1e-4, atol=1e-4)


def test_unsupported_architecture_is_refused():
    with pytest.raises(ValueError, match="unsupported architecture 'mistral'"):
        ModelConfig.from_hf_dict(
            {
                "model_type": "mistral",
                "vocab_size": 4,
                "hidden_size": 4,
                "intermediate_size": 4,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
            }
        )


def test_lone_half_precision_row_runs_as_two_with_the_same_result():
    import torch.nn.functional as F

    from dynaspec.models.llama import Linear

    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        layer = Linear(64, 48, bias=True).to(dtype)
        x = torch.randn(1, 64, dtype=dtype)
        out = layer(x)
        assert out.shape == (1, 48)
        assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
        many = torch.randn(5, 64, dtype=dtype)
        assert torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))
