"""Build a `LlamaModel` from a checkpoint, one tensor at a time, in the requested quantization.

`quantization` (the `--quantization` flag):
- "auto": a GGUF's own blocks (each linear layer keeps the file's codes and scales: `QuantLinear`;
  the token embedding is looked up from its quantized rows in the memory-mapped file); a Hugging
  Face directory stays dense in the compute dtype.
- "none": every weight dense in the compute dtype (a GGUF is dequantized at load).
- "int8" / "int4": group-wise round-to-nearest at load (groups of 32), from the checkpoint's dense
  values (a GGUF's dequantized ones); lower quality than a GGUF's own K-quants, which search their
  scales. The embedding stays as the checkpoint has it (a GGUF's quantized rows, looked up in place
  as for "auto"; dense for a Hugging Face directory).
Off the CPU (CUDA), the quantized kernels do not run: "auto" means "none" there, "int8"/"int4" are
refused.

Fused layers (q/k/v, gate/up) stack their parts' rows into one `QuantLinear` when the parts share a
block layout; parts of different types (Q6_K v next to Q4_K q and k, as Q4_K_M files mix them) run
as consecutive layers whose outputs are concatenated.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import nn

from dynaspec.models.checkpoint import Checkpoint, StateDictCheckpoint
from dynaspec.models.config import ModelConfig
from dynaspec.models.gguf_blocks import GroupedWeight, concat_rows, decode_blocks, layout, select_rows
from dynaspec.models.hugepages import weight_arena
from dynaspec.models.llama import Linear, LlamaModel, RotaryEmbedding
from dynaspec.models.qlinear import QuantLinear, quantize_dense

QUANTIZATIONS = ("auto", "none", "int8", "int4")
DENSE_GROUP = 32  # group size of int8/int4 quantization at load
REQUANTIZE_ROWS = 4096  # output rows re-quantized at a time


def effective_quantization(quantization: str, is_gguf: bool, device: torch.device) -> str:
    """What `quantization` means for this source and device: "gguf" (the file's own blocks),
    "int8", "int4" or "none"."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if device.type != "cpu":
        if quantization in ("int8", "int4"):
            raise ValueError(
                f"quantization: {quantization} runs on the CPU kernels only; use auto or none on {device}"
            )
        return "none"
    if quantization == "auto":
        return "gguf" if is_gguf else "none"
    return quantization


class ConcatLinear(nn.Module):
    """Several linear layers over the same input whose outputs are concatenated."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


class QuantEmbedding(nn.Module):
    """Token embedding looked up from a GGUF tensor's quantized rows, in place in the memory-mapped
    file: only the rows a batch needs are decoded (exactly, as `gguf_blocks` decodes them).

    A decode step looks up one to a few tokens, and decoding even one row costs 0.1-0.5 ms of NumPy
    calls (up to 1% of a batch-1 step; twice that with an EAGLE head, which reads the same table).
    So the rows of small lookups are kept, decoded, least recently used first out, within
    ``cache_bytes``; a prefill's lookups (more than ``CACHE_LOOKUP_ROWS`` ids) decode directly."""

    CACHE_LOOKUP_ROWS = 64

    def __init__(
        self,
        rows: np.ndarray,
        qtype: int,
        shape: tuple[int, int],
        dtype: torch.dtype,
        cache_bytes: int = 16 << 20,
    ) -> None:
        super().__init__()
        self.rows, self.qtype, self.shape, self.dtype = rows, qtype, shape, dtype  # rows [out, bytes]
        self.cache_rows = cache_bytes // (shape[1] * torch.finfo(dtype).bits // 8)
        self.cache: OrderedDict[int, torch.Tensor] = OrderedDict()  # token id -> [hidden] on the CPU

    def _decode(self, ids: np.ndarray) -> torch.Tensor:  # [n] -> [n, hidden] in self.dtype, CPU
        picked = self.rows[ids]
        weight = decode_blocks(picked, self.qtype, (len(picked), self.shape[1]), "token embedding")
        dense = weight.dequantize() if isinstance(weight, GroupedWeight) else weight
        return dense.to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        flat = ids.cpu().numpy()
        if len(flat) > self.CACHE_LOOKUP_ROWS or self.cache_rows == 0:
            return self._decode(flat).to(ids.device)
        cache = self.cache
        missing = list(dict.fromkeys(int(i) for i in flat if int(i) not in cache))
        if missing:
            for i, row in zip(missing, self._decode(np.array(missing, dtype=np.int64))):
                cache[i] = row.clone()  # not a view that keeps the whole decode alive
        rows = []
        for i in flat.tolist():
            cache.move_to_end(i)
            rows.append(cache[i])
        while len(cache) > self.cache_rows:
            cache.popitem(last=False)
        return torch.stack(rows).to(ids.device)

    def extra_repr(self) -> str:
        return f"{self.shape[0]}, {self.shape[1]}, gguf type {self.qtype}"


def _convert(weight: GroupedWeight | torch.Tensor, mode: str, name: str) -> GroupedWeight | torch.Tensor:
    """One weight in the form `mode` keeps: dense, the file's blocks, or re-quantized at load."""
    if mode == "gguf":
        return weight
    if mode == "none":
        return weight.dequantize() if isinstance(weight, GroupedWeight) else weight
    n_out, n_in = weight.shape
    if n_in % DENSE_GROUP:
        raise ValueError(f"{name}: {mode} quantizes groups of {DENSE_GROUP}; in_features is {n_in}")
    # a slice of rows at a time, so that the float32 copies stay small beside the weight (a
    # drafter's whole 151936-row head is 545 MB in float32, and rounding it takes several copies)
    parts = []
    for start in range(0, n_out, REQUANTIZE_ROWS):
        rows = torch.arange(start, min(start + REQUANTIZE_ROWS, n_out))
        if isinstance(weight, GroupedWeight):
            dense = select_rows(weight, rows).dequantize()
        else:
            dense = weight[rows]
        parts.append(quantize_dense(dense, 8 if mode == "int8" else 4, DENSE_GROUP))
    return concat_rows(parts)


def build_linear(
    parts: list[tuple[str, GroupedWeight | torch.Tensor, torch.Tensor | None]],  # (name, weight, bias)
    mode: str,
    dtype: torch.dtype,
    device: torch.device,
) -> nn.Module:
    """One layer computing the concatenation of the parts' outputs."""
    converted = [(name, _convert(w, mode, name), b) for name, w, b in parts]
    runs: list[list[tuple]] = []
    for part in converted:
        key = layout(part[1]) if isinstance(part[1], GroupedWeight) else "dense"
        if runs and runs[-1][0][0] == key:
            runs[-1].append((key, *part))
        else:
            runs.append([(key, *part)])
    modules = []
    for run in runs:
        weights = [w for _, _, w, _ in run]
        biases = [b for _, _, _, b in run]
        bias = None if biases[0] is None else torch.cat(biases).float()
        if run[0][0] == "dense":
            w = torch.cat(weights)
            layer = Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
            layer.weight = nn.Parameter(w.to(device=device, dtype=dtype), requires_grad=False)
            if bias is not None:
                layer.bias = nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)
            modules.append(layer)
        else:
            modules.append(QuantLinear(concat_rows(weights), bias, dtype=dtype))
    return modules[0] if len(modules) == 1 else ConcatLinear(modules)


_FUSED = {
    ("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"),
    ("self_attn", "o_proj"): ("o_proj",),
    ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"),
    ("mlp", "down_proj"): ("down_proj",),
}


def build_model(
    config: ModelConfig,
    checkpoint: Checkpoint,
    mode: str,  # from effective_quantization
    dtype: torch.dtype,
    device: torch.device,
    head_rows: int | None = None,  # keep only the first rows of the output head (a drafter's)
    progress: bool = False,
) -> LlamaModel:
    from tqdm import tqdm

    if head_rows is not None and not 0 < head_rows <= config.vocab_size:
        raise ValueError(f"draft_vocab_size: must be in [1, {config.vocab_size}], got {head_rows}")
    with torch.device("meta"):
        model = LlamaModel(config)
    # on a Linux CPU the weights go, as each layer is built, into one mapping of 2 MiB pages
    # (hugepages.py); each layer's own tensors are freed as the next is built
    arena = weight_arena(_weight_bytes_bound(config, mode, dtype, head_rows), device)
    missing = sorted(n for n in required_names(config) if n not in checkpoint.names)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[0]}")

    def get(name: str, shape: tuple[int, ...]) -> GroupedWeight | torch.Tensor:
        value = checkpoint.get(name)
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"tensor {name} has shape {tuple(value.shape)}, expected {tuple(shape)}")
        return value

    def dense_param(name: str, shape: tuple[int, ...]) -> nn.Parameter:
        value = get(name, shape)
        if isinstance(value, GroupedWeight):
            value = value.dequantize()
        return nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=False)

    hidden = config.hidden_size
    embed_name = "model.embed_tokens.weight"
    # a GGUF's quantized embedding is looked up from its rows in place (re-quantized layers too)
    raw = checkpoint.embedding_rows(embed_name) if mode != "none" else None
    if raw is not None:
        model.model.embed_tokens = QuantEmbedding(*raw, dtype=dtype)
    else:
        weight = torch.empty(config.vocab_size, hidden, device="meta")
        model.model.embed_tokens = nn.Embedding(config.vocab_size, hidden, _weight=weight)
        model.model.embed_tokens.weight = dense_param(embed_name, (config.vocab_size, hidden))

    head_name = embed_name if config.tie_word_embeddings else "lm_head.weight"
    rows = head_rows or config.vocab_size

    def build_head() -> None:
        if mode == "none" and config.tie_word_embeddings and rows == config.vocab_size:
            model.lm_head = Linear(hidden, rows, bias=False, device="meta")
            model.lm_head.weight = model.model.embed_tokens.weight  # shared, not copied
            return
        head = get(head_name, (config.vocab_size, hidden))
        if rows < config.vocab_size:
            keep = torch.arange(rows)
            head = select_rows(head, keep) if isinstance(head, GroupedWeight) else head[:rows].clone()
            if config.tie_word_embeddings:
                model.head_lookup = model.model.embed_tokens
            elif (raw_head := checkpoint.embedding_rows(head_name)) is not None:
                model.head_lookup = QuantEmbedding(*raw_head, dtype=dtype)
        model.lm_head = build_linear([(head_name, head, None)], mode, dtype, device)
        if arena is not None:
            arena.place([model.lm_head])

    def build_layer(i: int) -> None:
        layer = model.model.layers[i]
        prefix = f"model.layers.{i}."
        for (owner, fused), part_names in _FUSED.items():
            module = getattr(layer, owner)
            in_features = getattr(module, fused).in_features
            parts = []
            for p, out_features in zip(part_names, _split_sizes(config, fused)):
                name = f"{prefix}{owner}.{p}"
                bias = None
                if f"{name}.bias" in checkpoint.names:
                    bias = get(f"{name}.bias", (out_features,))
                    bias = bias.dequantize()[0] if isinstance(bias, GroupedWeight) else bias
                parts.append((f"{name}.weight", get(f"{name}.weight", (out_features, in_features)), bias))
            if config.attention_bias and fused == "qkv_proj" and any(b is None for _, _, b in parts):
                raise ValueError(f"checkpoint is missing {prefix}self_attn.q_proj.bias (or k/v)")
            setattr(module, fused, build_linear(parts, mode, dtype, device))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            getattr(layer, norm).weight = dense_param(f"{prefix}{norm}.weight", (hidden,))
        if config.qk_norm:
            for norm in ("q_norm", "k_norm"):
                getattr(layer.self_attn, norm).weight = dense_param(
                    f"{prefix}self_attn.{norm}.weight", (config.head_dim,)
                )
        if arena is not None:
            arena.place([layer])

    # decoding and packing are numpy/torch/C++ array work that releases the GIL: tensors in parallel,
    # the head (the largest) first, so its temporaries come before most layers are resident
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        futures = [pool.submit(build_head)]
        futures += [pool.submit(build_layer, i) for i in range(config.num_hidden_layers)]
        for future in tqdm(futures, desc="loading weights", unit="part", disable=not progress):
            future.result()
    model.model.norm.weight = dense_param("model.norm.weight", (hidden,))

    model.rotary = RotaryEmbedding(config).to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"build_model left {left[0]} unset")
    model.huge_pages = None
    if arena is not None:
        arena.place([model])  # what the layers and the head left: a dense embedding
        model.huge_pages = arena.finish()
    return model.eval()


def _weight_bytes_bound(config: ModelConfig, mode: str, dtype: torch.dtype, head_rows: int | None) -> int:
    """More bytes than the built model's weights take: an arena's capacity (only what is used is
    ever resident). Quantized layers take at most a byte a code plus their scales (f32 scale and
    offset per group of 16 at worst) and 32-column padding."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
    weights = (
        config.num_hidden_layers * per_layer + ((head_rows or config.vocab_size) + config.vocab_size) * hidden
    )
    per_weight = torch.finfo(dtype).bits / 8 if mode == "none" else 1.5
    return int(weights * per_weight) + (64 << 20)


def required_names(config: ModelConfig) -> list[str]:
    """The weight tensors (Hugging Face names) a checkpoint of this config must hold."""
    per_layer = [f"{m}.{p}" for (m, _), parts in _FUSED.items() for p in parts]
    per_layer += ["input_layernorm", "post_attention_layernorm"]
    if config.qk_norm:
        per_layer += ["self_attn.q_norm", "self_attn.k_norm"]
    names = [f"model.layers.{i}.{n}.weight" for i in range(config.num_hidden_layers) for n in per_layer]
    names += ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _split_sizes(config: ModelConfig, fused: str) -> tuple[int, ...]:
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {
        "qkv_proj": (q, kv, kv),
        "o_proj": (config.hidden_size,),
        "gate_up_proj": (config.intermediate_size, config.intermediate_size),
        "down_proj": (config.hidden_size,),
    }[fused]


def from_state_dict(
    config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> LlamaModel:
    """A dense model from Hugging Face-named tensors in memory (tests, references)."""
    return build_model(config, StateDictCheckpoint(weights), "none", dtype, device)
