"""One Llama-family decoder covering the llama, qwen2 (q/k/v bias) and qwen3 (q/k RMSNorm) layouts.

The forward pass takes a flat varlen batch (every scheduled token of every sequence, back to back),
writes each layer's new K/V into a paged cache and returns hidden states; logits are computed only
for the rows the caller asks for.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dynaspec.models import fused_ops
from dynaspec.models.attention import SINK_TOKENS, AttentionMetadata, DecodeMetadata, paged_attention
from dynaspec.models.config import ModelConfig
from dynaspec.models.qlinear import QuantLinear, kernel_error


class Linear(nn.Linear):
    """nn.Linear that runs a lone bf16/fp16 row on CPU as two identical rows.

    oneDNN's one-row half-precision path is much slower than its two-row one on CPU (1.6-1.9x for
    o_proj and down_proj, the results diary), and the row's result is bitwise the same. float32
    keeps the one-row path (faster there) and CUDA is untouched.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and x.dim() == 2 and x.device.type == "cpu" and x.dtype in _HALF:
            return super().forward(x.expand(2, -1))[:1]
        return super().forward(x)


_HALF = (torch.bfloat16, torch.float16)


def _fused(x: torch.Tensor) -> bool:
    """Whether the C++ per-row ops (csrc/fused.cpp) take this tensor: float32 on a CPU that built them.
    They are batch invariant and replace several small torch ops each."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and kernel_error() is None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused(x) and self.weight.dtype == torch.float32:
            return torch.ops.dynaspec.rms_norm(x.contiguous(), self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # elementwise bf16 ops are ~100x slower than float32 on CPU: multiply in float32
        return (self.weight.float() * x32).to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, the norm of that): a residual add and the next norm, fused where possible."""
        if _fused(x) and self.weight.dtype == torch.float32:
            fused = torch.ops.dynaspec.add_rms_norm
            return fused(x.contiguous(), residual.contiguous(), self.weight, self.eps)
        total = x + residual
        return total, self.forward(total)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (Hugging Face layout) with optional llama3 frequency scaling."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim = config.head_dim
        # on the CPU even inside a meta-device build (a meta arange imports torch._dynamo: seconds)
        steps = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu")
        inv_freq = 1.0 / (config.rope_theta ** (steps / dim))
        if config.rope_scaling is not None:
            inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim / 2]

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [num_tokens, 1, head_dim]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos(), emb.sin()


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one matmul (loaded from Hugging Face's separate q/k/v_proj tensors)
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim]
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        n = x.shape[0]
        q, k, v = self._qkv(x)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if _fused(q):
            q, k = q.contiguous(), k.contiguous()
            torch.ops.dynaspec.rope_qk_(q, k, cos, sin)
        else:
            q = _rotate(q, cos, sin)
            k = _rotate(k, cos, sin)
        out = paged_attention(q, k, v, k_cache, v_cache, meta)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))

    def _qkv(
        self,
        x: torch.Tensor,  # [n, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [n, heads, d], k and v [n, kv_heads, d]
        return self._split_qkv(self.qkv_proj(x))

    def _split_qkv(
        self,
        qkv: torch.Tensor,  # [n, (heads + 2 * kv_heads) * head_dim]: the q/k/v projection
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [n, heads, d], k and v [n, kv_heads, d]
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        return q, k, v.reshape(n, self.num_kv_heads, self.head_dim)

    def decode(
        self,
        qkv: torch.Tensor,  # [b * query_len, (heads + 2 * kv_heads) * head_dim]: the q/k/v projection
        cos: torch.Tensor,  # [b * query_len, head_dim] float32
        sin: torch.Tensor,  # [b * query_len, head_dim] float32
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        meta: DecodeMetadata,
    ) -> torch.Tensor:  # [b * query_len, heads * head_dim]: attention's output, before o_proj
        """``forward``'s attention for a step of fixed shape, through the fused ops, from the q/k/v
        projection (which ``LlamaModel.forward_decode`` fuses with the norm before it)."""
        n = qkv.shape[0]
        q, k, v = self._split_qkv(qkv)
        if self.q_norm is not None:
            q = fused_ops.rms_norm(q.reshape(-1, self.head_dim), self.q_norm.weight, self.q_norm.eps)
            k = fused_ops.rms_norm(k.reshape(-1, self.head_dim), self.k_norm.weight, self.k_norm.eps)
            q = q.view(n, self.num_heads, self.head_dim)
            k = k.view(n, self.num_kv_heads, self.head_dim)
        q = fused_ops.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)[0]
        out = fused_ops.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_table,
            meta.seq_lens,
            meta.query_len,
            meta.block_size,
            self.head_dim**-0.5,
            window=meta.window,
            sink_tokens=SINK_TOKENS,
        )
        return out.reshape(n, self.q_size)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # gate and up in one matmul (loaded from Hugging Face's gate_proj and up_proj)
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if _fused(gate_up):
            return self.down_proj(torch.ops.dynaspec.silu_mul(gate_up.contiguous()))
        gate, up = gate_up.float().chunk(2, dim=-1)  # float32: see RMSNorm
        return self.down_proj((F.silu(gate) * up).to(x.dtype))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta):
        """x: the previous layer's output, residual: the stream it adds to (None for the first
        layer, whose input is the embedding). Returns (this layer's output, the stream)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, sin, k_cache, v_cache, meta)
        residual, h = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # given a weight, nn.Embedding skips its random init (on the meta device that init imports
        # torch._dynamo: 2 s of start-up)
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    """Decoder with a language-model head; parameter names follow Hugging Face's."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._stack = None  # DecoderStack, False (not possible) or None (not built yet)
        # a head cut to its first rows (a drafter's) keeps the rest readable here, row by row, where
        # that costs no memory: ids -> [n, hidden] (the tied embedding, or the file's rows in place)
        self.head_lookup: nn.Module | None = None

    # run the decoder stack as one C++ call where it can (`_decoder_stack`); False: always the modules
    use_stack = True

    def _decoder_stack(self):
        """The layers as one `torch.classes.dynaspec.DecoderStack` (csrc/layer.cpp: the same operators
        in the same order, bitwise the same hidden states, without ~11 Python calls and dispatches a
        layer), or None where the model is not all float32 norms and VNNI projections. Built on first
        use, rebuilt after the weights move (`_apply`)."""
        if self._stack is None:
            stack = _build_stack(self)
            self._stack = False if stack is None else stack
        return None if self._stack is False else self._stack

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._stack = None
        return out

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: k, v [num_slots, kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        plan = meta.rowwise
        stack = self._decoder_stack() if self.use_stack and plan is not None and _fused(x) else None
        if stack is not None:
            k_caches, v_caches = [k for k, _ in kv_caches], [v for _, v in kv_caches]
            return stack.forward(
                x,
                cos,
                sin,
                k_caches,
                v_caches,
                meta.slot_mapping,
                plan.slot_table,
                plan.row_seq,
                plan.row_len,
            )
        residual = None
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, k_cache, v_cache, meta)
        return self.model.norm.add_forward(x, residual)[1]

    @torch.inference_mode()
    def forward_capture(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: k, v [num_slots, kv_heads, head_dim]
        meta: AttentionMetadata,
        layer_ids: tuple[int, ...],  # each in 0..num_hidden_layers
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, hidden], [num_tokens, len(layer_ids) * hidden]
        """``forward``, also returning the hidden states entering each layer of ``layer_ids`` side
        by side: the residual stream before that layer (the embeddings for layer 0), and for
        ``num_hidden_layers`` the final norm's output (what the head reads). The same operators in
        the same order as ``forward``, so the states returned first are bitwise ``forward``'s."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        plan = meta.rowwise
        stack = self._decoder_stack() if self.use_stack and plan is not None and _fused(x) else None
        inner = tuple(i for i in layer_ids if i < len(self.model.layers))
        entering: dict[int, torch.Tensor] = {}
        if stack is not None:
            k_caches, v_caches = [k for k, _ in kv_caches], [v for _, v in kv_caches]
            out, *captured = stack.forward_capture(
                x,
                cos,
                sin,
                k_caches,
                v_caches,
                meta.slot_mapping,
                plan.slot_table,
                plan.row_seq,
                plan.row_len,
                list(inner),
            )
            entering = dict(zip(inner, captured))
        else:
            residual = None
            for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.model.layers, kv_caches)):
                if i in inner:
                    entering[i] = x if residual is None else x + residual
                x, residual = layer(x, residual, cos, sin, k_cache, v_cache, meta)
            out = self.model.norm.add_forward(x, residual)[1]
        hidden = [out if i == len(self.model.layers) else entering[i] for i in layer_ids]
        return out, torch.cat(hidden, dim=-1)

    @torch.inference_mode()
    def forward_decode(
        self,
        input_ids: torch.Tensor,  # [b * query_len]
        positions: torch.Tensor,  # [b * query_len]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: k, v [num_slots, kv_heads, head_dim]
        meta: DecodeMetadata,
    ) -> torch.Tensor:  # [b * query_len, hidden]
        """The pass over a step of fixed shape (``DecodeMetadata``) through the fused ops
        (models/fused_ops.py: Triton kernels on CUDA, their torch twins elsewhere): about ten
        kernels a layer, no host sync, every shape fixed by (b, query_len), so it can be captured."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        cos, sin = cos[:, 0], sin[:, 0]  # [n, head_dim]
        residual = None
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches):
            attn, mlp = layer.self_attn, layer.mlp
            residual, qkv = _norm_project(x, residual, layer.input_layernorm, attn.qkv_proj)
            x = _project(attn.decode(qkv, cos, sin, k_cache, v_cache, meta), attn.o_proj)
            residual, gate_up = _norm_project(x, residual, layer.post_attention_layernorm, mlp.gate_up_proj)
            x = _silu_project(gate_up, mlp.down_proj)
        norm = self.model.norm
        return fused_ops.add_rms_norm(x, residual, norm.weight, norm.eps)[1]

    def decode_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] the head's dtype
        """The head over a fixed-shape pass's rows, in the head's dtype (``fused_ops.linear``: with
        batch invariance, rows that do not depend on each other)."""
        return _project(hidden, self.lm_head)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32
        return self.lm_head(hidden).float()


def _plain(projection: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of a projection that is a plain matrix (fused_ops' projections take it), else
    None (quantized or concatenated layers run as their modules)."""
    if type(projection) in (Linear, nn.Linear):
        return projection.weight, projection.bias
    return None


def _project(x: torch.Tensor, projection: nn.Module) -> torch.Tensor:
    plain = _plain(projection)
    return projection(x) if plain is None else fused_ops.linear(x, *plain)


def _norm_project(
    x: torch.Tensor,  # [n, d]
    residual: torch.Tensor | None,  # [n, d]; None: x is the embedding
    norm: RMSNorm,
    projection: nn.Module,
) -> tuple[torch.Tensor, torch.Tensor]:  # (the residual stream, the projection of its norm)
    if residual is None:
        return x, _project(fused_ops.rms_norm(x, norm.weight, norm.eps), projection)
    residual, h = fused_ops.add_rms_norm(x, residual, norm.weight, norm.eps)
    return residual, _project(h, projection)


def _silu_project(gate_up: torch.Tensor, projection: nn.Module) -> torch.Tensor:
    return _project(fused_ops.silu_mul(gate_up), projection)


def _build_stack(model: LlamaModel):
    """A DecoderStack holding the model's weights (references, no copies), or None when a layer has a
    projection off the VNNI path or a norm weight that is not float32."""
    config, layers = model.config, model.model.layers
    norms = [model.model.norm] + [n for layer in layers for n in _layer_norms(layer) if n is not None]
    projections = [p for layer in layers for p in _layer_projections(layer)]
    if any(n.weight.dtype != torch.float32 or n.weight.device.type != "cpu" for n in norms):
        return None
    if any(not isinstance(q, QuantLinear) or q._vnni is None for p in projections for q in _parts(p)):
        return None
    stack = torch.classes.dynaspec.DecoderStack(
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.rms_norm_eps,
        model.model.norm.weight.detach(),
    )
    empty = torch.empty(0)
    for layer in layers:
        tensors = [empty if n is None else n.weight.detach() for n in _layer_norms(layer)]
        ints = []
        for p in _layer_projections(layer):
            parts = _parts(p)
            ints.append(len(parts))
            for q in parts:
                packed, f32, sub, *args = q._vnni
                tensors += [packed, f32, sub, empty if q._bias is None else q._bias]
                ints += args
        stack.add_layer(tensors, ints)
    return stack


def _parts(projection: nn.Module) -> list[nn.Module]:
    """A projection's linear layers: build.py's ConcatLinear concatenates the outputs of its parts."""
    parts = getattr(projection, "parts", None)
    return list(parts) if isinstance(parts, nn.ModuleList) else [projection]


def _layer_norms(layer: DecoderLayer) -> list[RMSNorm | None]:
    attn = layer.self_attn
    return [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]


def _layer_projections(layer: DecoderLayer) -> list[nn.Module]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
