"""EAGLE heads: one decoder layer that drafts from the target's own hidden states, and their loader.

A head at position p reads the target's hidden state at p (what the target computed after token
p) and the embedding of token p + 1, and predicts token p + 2; drafting on, it reads its own output
at the previous position instead of the target's (chain drafting, as both papers do).

- EAGLE (arXiv 2401.15077): ``fc`` fuses [embedding, target's last hidden state] (2H -> H, with a
  bias in the paper's checkpoints); the layer has no input norm; its output (no final norm) goes
  through the target's own LM head.
- EAGLE-3 (arXiv 2503.01840): ``fc`` fuses the hidden states entering three target layers (low,
  middle, high: 3H -> H); the layer's attention reads [input_layernorm(embedding),
  hidden_norm(fused)] (2H wide) and adds to the fused state; a final ``norm`` and the head's own
  ``lm_head`` over a cut draft vocabulary, whose id i is target id i + d2t[i]. The next position
  reads the state before ``norm``.

Checkpoints are directories in the layout vLLM and SpecForge read: config.json and
model.safetensors (EAGLE-3: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``;
EAGLE: ``fc`` and ``layers.0.*``). A checkpoint that does not fit the target is refused with the
field it disagrees on.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dynaspec.models.attention import AttentionMetadata
from dynaspec.models.build import build_linear, effective_quantization
from dynaspec.models.config import ModelConfig
from dynaspec.models.llama import MLP, Attention, Linear, RMSNorm, RotaryEmbedding

EAGLE = "eagle"
EAGLE3 = "eagle3"
WEIGHTS_FILE = "model.safetensors"


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The target layers an EAGLE-3 head reads when its config names none (vLLM's choice)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(frozen=True, slots=True)
class EagleHeadConfig:
    method: str  # EAGLE or EAGLE3
    layer: ModelConfig  # the decoder layer's shapes (num_hidden_layers 1)
    draft_vocab_size: int  # rows of the head's own lm_head (EAGLE3), else the target's vocabulary
    # the target layers whose entering hidden states the head reads, in fc's order; the target's
    # num_hidden_layers stands for its final norm's output (EAGLE's input)
    target_layers: tuple[int, ...]
    norm_before_residual: bool = False  # EAGLE3: the fused state is normed before it joins the residual
    fc_bias: bool = False

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


def _fail(path: Path, field: str, message: str) -> ValueError:
    return ValueError(f"{path}: {field}: {message}")


def read_head_config(path: Path, method: str, target: ModelConfig) -> EagleHeadConfig:
    """The head's config.json, checked against the target (hidden size, vocabulary, layers)."""
    file = path / "config.json"
    if not file.is_file():
        raise ValueError(f"{path}: no config.json (an {method} checkpoint is config.json + {WEIGHTS_FILE})")
    d = json.loads(file.read_text())
    for name in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(d.get(name), int):
            raise _fail(file, name, f"required (an integer), got {d.get(name)!r}")
    if d["hidden_size"] != target.hidden_size:
        raise _fail(
            file, "hidden_size", f"{d['hidden_size']} does not match the target's {target.hidden_size}"
        )
    target_hidden = d.get("target_hidden_size", target.hidden_size)
    if target_hidden != target.hidden_size:
        raise _fail(file, "target_hidden_size", f"{target_hidden} is not the target's {target.hidden_size}")
    if d["vocab_size"] != target.vocab_size:
        raise _fail(file, "vocab_size", f"{d['vocab_size']} does not match the target's {target.vocab_size}")
    layers = d.get("num_hidden_layers", 1)
    if layers != 1:
        raise _fail(file, "num_hidden_layers", f"dynaspec runs one-layer heads, got {layers}")
    draft_vocab = d.get("draft_vocab_size") or d["vocab_size"]
    if method == EAGLE3 and not 1 <= draft_vocab <= d["vocab_size"]:
        raise _fail(
            file, "draft_vocab_size", f"must be in [1, vocab_size {d['vocab_size']}], got {draft_vocab}"
        )
    layer = ModelConfig.from_hf_dict({**d, "model_type": "llama", "num_hidden_layers": 1})
    if method == EAGLE3:
        eagle_config = d.get("eagle_config") or {}
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids", d.get("eagle_aux_hidden_state_layer_ids"))
        field = "eagle_aux_hidden_state_layer_ids"
        if ids is None:
            ids, field = default_aux_layers(target.num_hidden_layers), "num_hidden_layers of the target"
        ids = tuple(ids) if isinstance(ids, (list, tuple)) else (ids,)
        bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < target.num_hidden_layers]
        if len(ids) != 3 or bad:
            raise _fail(
                file,
                field,
                f"an EAGLE-3 head reads 3 layers of the target's {target.num_hidden_layers}, "
                f"each in [0, {target.num_hidden_layers}); got {list(ids)}",
            )
        return EagleHeadConfig(
            EAGLE3, layer, draft_vocab, ids, bool(d.get("norm_before_residual", False)), False
        )
    return EagleHeadConfig(EAGLE, layer, d["vocab_size"], (target.num_hidden_layers,))


class EagleHead(nn.Module):
    """One EAGLE or EAGLE-3 decoder layer with its fusion ``fc`` (and, for EAGLE-3, its norm,
    lm_head and draft-to-target id map). Parameter names follow the checkpoints'."""

    def __init__(self, config: EagleHeadConfig) -> None:
        super().__init__()
        self.config = config
        layer, h = config.layer, config.hidden_size
        eagle3 = config.method == EAGLE3
        self.fc = Linear(len(config.target_layers) * h if eagle3 else 2 * h, h, bias=config.fc_bias)
        self.self_attn = Attention(layer)
        if eagle3:  # q, k and v read [embedding, fused state]
            attn = self.self_attn
            self.self_attn.qkv_proj = Linear(2 * h, attn.q_size + 2 * attn.kv_size, bias=layer.attention_bias)
        self.mlp = MLP(layer)
        self.post_attention_layernorm = RMSNorm(h, layer.rms_norm_eps)
        self.rotary = RotaryEmbedding(layer)
        # EAGLE3's own parts (None for EAGLE, which has no input norm and uses the target's head)
        self.input_layernorm = RMSNorm(h, layer.rms_norm_eps) if eagle3 else None
        self.hidden_norm = RMSNorm(h, layer.rms_norm_eps) if eagle3 else None
        self.norm = RMSNorm(h, layer.rms_norm_eps) if eagle3 else None
        self.lm_head = Linear(h, config.draft_vocab_size, bias=False) if eagle3 else None
        # the target id of each draft id (EAGLE3): draft id i is target id i + d2t[i]
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=False)
        self.embed_tokens: nn.Embedding | None = None  # the checkpoint's own, where it has one
        self.cut = False  # its lm_head's ids are not the target's own (a cut vocabulary, d2t)

    @torch.inference_mode()
    def forward(
        self,
        embeds: torch.Tensor,  # [n, H] the embeddings of the tokens after each position
        hidden: torch.Tensor,  # [n, len(target_layers) * H] the target's, or [n, H] the head's own
        positions: torch.Tensor,  # [n]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # k, v [num_slots, kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> tuple[
        torch.Tensor, torch.Tensor
    ]:  # [n, H] each: what the LM head reads, what the next position reads
        cos, sin = self.rotary(positions)
        k_cache, v_cache = kv_cache
        if self.config.method == EAGLE:
            residual = self.fc(torch.cat([embeds, hidden], dim=-1))
            x = residual  # no input norm
        else:
            if hidden.shape[-1] != self.config.hidden_size:  # the target's states: fuse them
                hidden = self.fc(hidden)
            if self.config.norm_before_residual:
                residual = self.hidden_norm(hidden)
                normed = residual
            else:
                residual, normed = hidden, self.hidden_norm(hidden)
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = self.self_attn(x, cos, sin, k_cache, v_cache, meta)
        residual, x = self.post_attention_layernorm.add_forward(x, residual)
        x = self.mlp(x)
        if self.norm is None:
            out = x + residual
            return out, out
        state, out = self.norm.add_forward(x, residual)
        return out, state

    @torch.inference_mode()
    def draft_logits(
        self,
        out: torch.Tensor,
        target_logits: Callable[[torch.Tensor], torch.Tensor],
        vocab_size: int,
        full: bool = True,
    ) -> torch.Tensor:  # [n, vocab] float32: ids the head cannot propose at -inf
        """Logits over the target's vocabulary of the head's output ``out`` [n, H]; with ``full``
        False, a cut head's logits over its own ids (``draft_to_target`` maps them), not spread
        over the target's vocabulary (a greedy draw needs only their top)."""
        if self.lm_head is None:
            return target_logits(out)
        cut = self.lm_head(out).float()  # [n, draft_vocab]
        if not self.cut or not full:
            return cut
        spread = cut.new_full((cut.shape[0], vocab_size), float("-inf"))
        return spread.index_copy_(1, self.draft_to_target, cut)


def _expected(config: EagleHeadConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors (file names, after ``prefix`` for the layer) and their shapes."""
    layer, h = config.layer, config.hidden_size
    q, kv = layer.num_attention_heads * layer.head_dim, layer.num_key_value_heads * layer.head_dim
    inter = layer.intermediate_size
    qkv_in = 2 * h if config.method == EAGLE3 else h
    shapes = {
        "fc.weight": (h, len(config.target_layers) * h if config.method == EAGLE3 else 2 * h),
        f"{prefix}self_attn.q_proj.weight": (q, qkv_in),
        f"{prefix}self_attn.k_proj.weight": (kv, qkv_in),
        f"{prefix}self_attn.v_proj.weight": (kv, qkv_in),
        f"{prefix}self_attn.o_proj.weight": (h, q),
        f"{prefix}mlp.gate_proj.weight": (inter, h),
        f"{prefix}mlp.up_proj.weight": (inter, h),
        f"{prefix}mlp.down_proj.weight": (h, inter),
        f"{prefix}post_attention_layernorm.weight": (h,),
    }
    if layer.attention_bias:
        shapes |= {f"{prefix}self_attn.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv))}
    if config.method == EAGLE3:
        shapes |= {
            f"{prefix}input_layernorm.weight": (h,),
            f"{prefix}hidden_norm.weight": (h,),
            "norm.weight": (h,),
            "lm_head.weight": (config.draft_vocab_size, h),
        }
    return shapes


def quantize_head(head: EagleHead, quantization: str | None) -> EagleHead:
    """The head with its linears (fc, the layer's four projections, its own lm_head) held
    group-wise quantized (``quantization`` int8 or int4, as ``--quantization`` quantizes a dense
    checkpoint at load: ``build.build_linear``, the CPU kernels only) in place; None, "none" or
    "auto": as stored. Drafts only: lossless whatever it does to acceptance."""
    if quantization in (None, "none", "auto"):
        return head
    if quantization not in ("int8", "int4"):
        raise ValueError(f"speculative_config.draft_quantization: {quantization!r} is not int8, int4 or none")
    device = head.fc.weight.device
    mode = effective_quantization(quantization, False, device)  # refuses int8/int4 off the CPU
    attn, mlp = head.self_attn, head.mlp
    owners = [(head, "fc"), (attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")]
    if head.lm_head is not None:
        owners.append((head, "lm_head"))
    for owner, name in owners:
        linear = getattr(owner, name)
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach()
        setattr(owner, name, build_linear([(name, weight, bias)], mode, weight.dtype, device))
    return head


def load_eagle_head(
    path: str | Path, method: str, target: ModelConfig, dtype: torch.dtype, device: torch.device
) -> EagleHead:
    """An EAGLE (``method`` "eagle") or EAGLE-3 ("eagle3") head from a checkpoint directory, in
    ``dtype`` on ``device``; ValueError naming the field or tensor that does not fit ``target``."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"speculative_config.model: {method} needs a checkpoint directory, got {str(path)!r}"
        )
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"{path}: no {WEIGHTS_FILE}")
    with safe_open(str(weights), framework="pt") as f:
        tensors = {name.removeprefix("model."): f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (a safe_open handle)
    config = read_head_config(path, method, target)
    if "fc.bias" in tensors:
        config = replace(config, fc_bias=True)
    prefix = "midlayer." if any(n.startswith("midlayer.") for n in tensors) else "layers.0."
    expected = _expected(config, prefix)
    if config.fc_bias:
        expected["fc.bias"] = (config.hidden_size,)
    for name, shape in expected.items():
        if name not in tensors:
            raise ValueError(f"{weights}: tensor {name} is missing")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"{weights}: tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}"
            )
    head = EagleHead(config)
    attn, mlp = f"{prefix}self_attn.", f"{prefix}mlp."
    state = {
        "self_attn.qkv_proj.weight": torch.cat([tensors[f"{attn}{p}_proj.weight"] for p in "qkv"]),
        "self_attn.o_proj.weight": tensors[f"{attn}o_proj.weight"],
        "mlp.gate_up_proj.weight": torch.cat(
            [tensors[f"{mlp}gate_proj.weight"], tensors[f"{mlp}up_proj.weight"]]
        ),
        "mlp.down_proj.weight": tensors[f"{mlp}down_proj.weight"],
        "post_attention_layernorm.weight": tensors[f"{prefix}post_attention_layernorm.weight"],
        "fc.weight": tensors["fc.weight"],
    }
    if config.fc_bias:
        state["fc.bias"] = tensors["fc.bias"]
    if config.layer.attention_bias:
        state["self_attn.qkv_proj.bias"] = torch.cat([tensors[f"{attn}{p}_proj.bias"] for p in "qkv"])
    if config.method == EAGLE3:
        for name in ("input_layernorm.weight", "hidden_norm.weight"):
            state[name] = tensors[f"{prefix}{name}"]
        state["norm.weight"], state["lm_head.weight"] = tensors["norm.weight"], tensors["lm_head.weight"]
        head.draft_to_target.copy_(_draft_to_target(tensors, config, target, weights))
    head.load_state_dict(state, strict=False)
    embed = tensors.get("embed_tokens.weight")
    if config.method == EAGLE3 and embed is not None:
        if tuple(embed.shape) != (target.vocab_size, config.hidden_size):
            raise ValueError(f"{weights}: tensor embed_tokens.weight has shape {tuple(embed.shape)}")
        head.embed_tokens = nn.Embedding(target.vocab_size, config.hidden_size, _weight=embed.clone())
    head.cut = config.method == EAGLE3 and not torch.equal(
        head.draft_to_target, torch.arange(target.vocab_size)
    )
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)  # the id map stays int64


def _draft_to_target(
    tensors: dict[str, torch.Tensor], config: EagleHeadConfig, target: ModelConfig, weights: Path
) -> torch.Tensor:  # [draft_vocab] int64 target ids
    """Each draft id's target id (vLLM's rule: draft id i is target id i + d2t[i]); without ``d2t``
    the cut head keeps the target's first ids."""
    base = torch.arange(config.draft_vocab_size)
    d2t = tensors.get("d2t")
    if d2t is None:
        return base
    if tuple(d2t.shape) != (config.draft_vocab_size,):
        raise ValueError(
            f"{weights}: tensor d2t has shape {tuple(d2t.shape)}, expected ({config.draft_vocab_size},)"
        )
    ids = base + d2t.long()
    if bool(((ids < 0) | (ids >= target.vocab_size)).any()):
        raise ValueError(
            f"{weights}: tensor d2t maps draft ids outside the target's vocabulary of {target.vocab_size}"
        )
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"{weights}: tensor d2t maps two draft ids to one target id")
    return ids
