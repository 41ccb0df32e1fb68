"""Where a model's tensors come from: a GGUF file read in place, a Hugging Face directory, or
random values made on the device (a dummy model's).

Both are read lazily by Hugging Face parameter name, so a model is built one tensor at a time and
never holds a second full copy of its weights. A GGUF tensor comes back as its own quantized blocks
(`GroupedWeight`: codes and per-group scales, exact) or as float32 for the file's dense types; a
safetensors tensor comes back memory-mapped in its stored dtype.

llama.cpp's converter permutes the rows of the Q and K projections of `llama`-architecture models
(it pairs rotary dimensions (i, i + d/2) as adjacent rows, the layout its RoPE kernel wants); Qwen
files are written without it. `GgufCheckpoint` undoes it, on the quantized rows as on dense ones.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dynaspec.models.config import ModelConfig
from dynaspec.models.gguf import TensorInfo, hf_tensor_name, read_gguf_index
from dynaspec.models.gguf_blocks import DENSE_TYPES, GroupedWeight, decode_blocks, select_rows

Tensor = GroupedWeight | torch.Tensor


class Checkpoint:
    """Tensors by Hugging Face name; `names` lists what the source holds."""

    names: frozenset[str]

    def get(self, name: str) -> Tensor:
        raise NotImplementedError

    def embedding_rows(self, name: str) -> tuple[np.ndarray, int, tuple[int, int]] | None:
        """(raw rows [out, bytes per row] uint8, GGUF type, (out, in)) for an embedding that can be
        looked up from its quantized rows in place; None when the tensor is dense."""
        return None


class StateDictCheckpoint(Checkpoint):
    """Tensors already in memory (a Hugging Face state dict)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights
        self.names = frozenset(weights)

    def get(self, name: str) -> Tensor:
        return self.weights[name]


DUMMY_STD = 0.02  # a dummy weight's standard deviation (as models are initialized for training)


class DummyCheckpoint(Checkpoint):
    """Random tensors of a config's shapes, made on ``device`` in ``dtype`` when asked for: weights
    and biases normal(0, DUMMY_STD), norm weights one (so activations keep their scale and the logits
    are not degenerate). Each tensor's values depend only on its name and ``seed``, so a model is
    the same whatever order it is built in."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        self.shapes = hf_tensor_shapes(config)
        self.names = frozenset(self.shapes)
        self.dtype, self.device, self.seed = dtype, device, seed

    def get(self, name: str) -> Tensor:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(self.seed * 2**32 + zlib.crc32(name.encode()))
        value = torch.empty(shape, dtype=self.dtype, device=self.device)
        return value.normal_(0.0, DUMMY_STD, generator=generator)


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint of this config: Hugging Face name -> shape."""
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (q, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, q),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    if config.attention_bias:
        per_layer |= {
            "self_attn.q_proj.bias": (q,),
            "self_attn.k_proj.bias": (kv,),
            "self_attn.v_proj.bias": (kv,),
        }
    if config.qk_norm:
        per_layer |= {"self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,)}
    shapes = {
        f"model.layers.{i}.{name}": shape
        for i in range(config.num_hidden_layers)
        for name, shape in per_layer.items()
    }
    shapes["model.embed_tokens.weight"] = (config.vocab_size, hidden)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


class GgufCheckpoint(Checkpoint):
    def __init__(self, path: str | Path, config: ModelConfig) -> None:
        self.path = Path(path)
        _, tensors = read_gguf_index(self.path)
        self.tensors = {hf_tensor_name(t.name): t for t in tensors}
        self.names = frozenset(self.tensors)
        self.config = config

    def _rows_order(self, name: str, rows: int) -> np.ndarray | None:
        """The un-permuting row order for llama's Q/K projections, None for every other tensor."""
        if self.config.architecture != "llama":
            return None
        if ".self_attn.q_proj." in name:
            heads = self.config.num_attention_heads
        elif ".self_attn.k_proj." in name:
            heads = self.config.num_key_value_heads
        else:
            return None
        return unpermute_qk(np.arange(rows), heads)

    def _read(self, tensor: TensorInfo) -> np.ndarray:
        """A tensor's raw bytes, read from the file (not through the memory map: a tensor read once
        to be repacked would otherwise stay resident as mapped file pages)."""
        data = np.empty(tensor.n_bytes, dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(tensor.offset)
            if f.readinto(memoryview(data)) != data.size:
                raise ValueError(f"{self.path}: tensor {tensor.name} is cut short")
        return data

    def get(self, name: str) -> Tensor:
        tensor = self.tensors[name]
        shape = tensor.shape
        data = self._read(tensor)
        if len(shape) == 1:
            value: Tensor = decode_blocks(data, tensor.qtype, (1, shape[0]), name)[0]
        else:
            value = decode_blocks(data, tensor.qtype, shape, name)
        order = self._rows_order(name, shape[0])
        if order is None:
            return value
        index = torch.from_numpy(order)
        return select_rows(value, index) if isinstance(value, GroupedWeight) else value[index]

    def embedding_rows(self, name: str) -> tuple[np.ndarray, int, tuple[int, int]] | None:
        tensor = self.tensors[name]
        if len(tensor.shape) != 2 or tensor.qtype in DENSE_TYPES:
            return None
        rows = np.memmap(
            self.path, np.uint8, "r", tensor.offset, (tensor.shape[0], tensor.n_bytes // tensor.shape[0])
        )
        return rows, tensor.qtype, tensor.shape

    def dense_state(self) -> dict[str, torch.Tensor]:
        """Every tensor dequantized to float32 (the reference the quantized layers are checked against)."""
        out = {}
        for name in sorted(self.names):
            value = self.get(name)
            out[name] = value.dequantize() if isinstance(value, GroupedWeight) else value.float()
        return out


class SafetensorsCheckpoint(Checkpoint):
    def __init__(self, directory: str | Path) -> None:
        from safetensors import SafetensorError, safe_open

        directory = Path(directory)
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{directory}: no *.safetensors file")
        self.handles: dict[str, Any] = {}
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")
                keys = list(handle.keys())
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ValueError(f"{file}: corrupt safetensors file ({first_line})") from None
            for key in keys:
                if key in self.handles:
                    raise ValueError(f"{file}: tensor {key!r} also appears in another shard")
                self.handles[key] = handle
        self.names = frozenset(self.handles)

    def get(self, name: str) -> Tensor:
        try:
            return self.handles[name].get_tensor(name)
        except Exception as e:  # a truncated file fails here, not at open
            raise ValueError(f"tensor {name}: cannot be read ({type(e).__name__}: {e})") from None


def unpermute_qk(
    weight: np.ndarray,  # [num_heads * head_dim, ...]
    num_heads: int,
) -> np.ndarray:  # same shape
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp writes `w.reshape(h, 2, d // 2, ...).swapaxes(1, 2)` for each head's d rows; this is
    the inverse, `reshape(h, d // 2, 2, ...).swapaxes(1, 2)`. Works for weights [h*d, in], biases
    [h*d] and row indices.
    """
    head_dim = weight.shape[0] // num_heads
    w = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)
