"""GGUF -> Hugging Face directory conversion.

A GGUF file (llama.cpp's format) holds quantized weights under llama.cpp's tensor names, the model
hyperparameters and the tokenizer as metadata. `convert_gguf` turns one into a plain Hugging Face
directory (config.json, generation_config.json, float32 safetensors, tokenizer files with the chat
template), so that every later load is an ordinary directory load that needs no dequantization.

Two details matter for getting the same model back:
- llama.cpp's converter permutes the rows of the Q and K projections of `llama`-architecture
  models (it pairs rotary dimensions (i, i + d/2) as adjacent rows, the GPT-J layout that its RoPE
  kernel wants). Qwen2/Qwen3 files are written without that permutation. We undo it for `llama`.
- A file without `output.weight` ties the output head to the token embedding.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from dynaspec.models.config import ModelConfig

# GGUF `general.architecture` -> Hugging Face architecture class name
SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_BLOCK_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Metadata arrays too long to be worth reading into Python lists (the tokenizer reads them itself).
_LARGE_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
)

# Largest safetensors shard written, in bytes: bounds the memory held while a shard is serialized.
SHARD_BYTES = 2 * 1024**3

SOURCE_RECORD = "dynaspec_source.json"


def hf_tensor_name(gguf_name: str) -> str:
    """Hugging Face parameter name for a llama.cpp tensor name (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    if stem in _GLOBAL_TENSOR_NAMES:
        return f"{_GLOBAL_TENSOR_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_TENSOR_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_TENSOR_NAMES[parts[2]]}.{suffix}"
    if stem == "rope_freqs":
        raise ValueError(
            "GGUF tensor 'rope_freqs.weight' (llama3-style RoPE scaling stored as frequency factors) "
            "is not supported: convert the Hugging Face checkpoint instead"
        )
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def read_metadata(reader: Any) -> dict[str, Any]:
    """All metadata fields as Python values, except the long tokenizer arrays (given as lengths)."""
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if key in _LARGE_ARRAYS:
            metadata[key] = len(field.data)
        else:
            metadata[key] = field.contents()
    return metadata


def unpermute_qk(
    weight: np.ndarray,  # [num_heads * head_dim, hidden] or [num_heads * head_dim]
    num_heads: int,
) -> np.ndarray:  # same shape
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp writes `w.reshape(h, 2, d // 2, ...).swapaxes(1, 2)` for each head's d rows; this is
    the inverse, `reshape(h, d // 2, 2, ...).swapaxes(1, 2)`. Works for weights [h*d, in] and
    biases [h*d].
    """
    head_dim = weight.shape[0] // num_heads
    w = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def dequantize_tensor(tensor: Any) -> np.ndarray:  # float32, [rows, cols] or [n]
    """A GGUF tensor as float32, in PyTorch's shape order (GGUF lists dims innermost first)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        data = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        name = GGMLQuantizationType(tensor.tensor_type).name
        raise ValueError(f"GGUF tensor {tensor.name!r} has unsupported type {name}") from None
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    data = np.ascontiguousarray(data, dtype=np.float32).reshape(shape)
    # F32 tensors come back as views of the read-only memory map: copy those
    return data if data.flags.writeable else data.copy()


def hf_config_from_gguf(
    metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]
) -> dict[str, Any]:
    """A Hugging Face config.json dictionary from GGUF metadata and the file's tensor shapes."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}: dynaspec converts "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        full = f"{arch}.{key}"
        if full not in metadata:
            if required:
                raise ValueError(f"GGUF metadata lacks {full!r}")
            return default
        return metadata[full]

    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = get("attention.key_length") or (get("rope.dimension_count") if arch == "llama" else None)
    vocab_rows = tensor_shapes["model.embed_tokens.weight"][0]
    config: dict[str, Any] = {
        "architectures": [SUPPORTED_GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab_rows),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(head_dim or hidden // heads),
        "rms_norm_eps": _shortest_float32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "lm_head.weight" not in tensor_shapes,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensor_shapes,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    scaling_type = get("rope.scaling.type")
    if scaling_type not in (None, "none"):
        config["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": float(get("rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length", 0)),
        }
    if "tokenizer.ggml.bos_token_id" in metadata:
        config["bos_token_id"] = int(metadata["tokenizer.ggml.bos_token_id"])
    eos_ids = [
        int(metadata[key])
        for key in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        )
        if key in metadata
    ]
    eos_ids = list(dict.fromkeys(eos_ids))
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    return config


def _shortest_float32(value: float) -> float:
    """GGUF stores float32: 1e-6 reads back as 9.99999997e-07. Give back the shortest decimal that
    rounds to the same float32, which is the value the original config.json held."""
    return float(str(np.float32(value)))


def _plan_shards(sizes: list[tuple[str, int]]) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for gguf_name, nbytes in sizes:
        if shards[-1] and used + nbytes > SHARD_BYTES:
            shards.append([])
            used = 0
        shards[-1].append(gguf_name)
        used += nbytes
    return shards


def _shard_file_name(index: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def source_record(gguf_path: Path) -> dict[str, Any]:
    """What identifies a GGUF file for caching: absolute path, size and modification time."""
    stat = gguf_path.stat()
    return {"source": str(gguf_path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # transformers raises many types for tokenizers it cannot rebuild
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{gguf_path}: cannot build the tokenizer from GGUF metadata: {first_line}"
        ) from None
    tokenizer.save_pretrained(str(out_dir))


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Convert a GGUF file into a Hugging Face directory at out_dir (replaced if present).

    Writes into a temporary sibling first and renames it into place, so out_dir is either absent
    or complete. Returns out_dir.
    """
    from gguf import GGMLQuantizationType, GGUFReader
    from tqdm import tqdm

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    try:
        reader = GGUFReader(str(gguf_path))
    except FileNotFoundError:
        raise ValueError(f"{gguf_path}: no such file") from None
    except Exception as e:  # the reader raises ValueError/struct errors/... on a malformed file
        raise ValueError(f"{gguf_path}: not a readable GGUF file ({type(e).__name__}: {e})") from None

    metadata = read_metadata(reader)
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}: dynaspec converts "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    names = {t.name: hf_tensor_name(t.name) for t in reader.tensors}
    shapes = {names[t.name]: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    config = hf_config_from_gguf(metadata, shapes)
    ModelConfig.from_hf_dict(config)  # fail now, not after minutes of dequantizing

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    try:
        _write_tokenizer(gguf_path, tmp_dir)
        tensors = {t.name: t for t in reader.tensors}
        shards = _plan_shards([(t.name, 4 * int(t.n_elements)) for t in reader.tensors])
        weight_map: dict[str, str] = {}
        bar = tqdm(
            total=len(reader.tensors),
            desc=f"converting {gguf_path.name}",
            unit="tensor",
            disable=not progress,
        )
        for index, shard in enumerate(shards):
            file_name = _shard_file_name(index, len(shards))
            state: dict[str, torch.Tensor] = {}
            for gguf_name in shard:
                weight = dequantize_tensor(tensors[gguf_name])
                if arch == "llama" and ".attn_q." in gguf_name:
                    weight = unpermute_qk(weight, config["num_attention_heads"])
                elif arch == "llama" and ".attn_k." in gguf_name:
                    weight = unpermute_qk(weight, config["num_key_value_heads"])
                state[names[gguf_name]] = torch.from_numpy(np.ascontiguousarray(weight))
                weight_map[names[gguf_name]] = file_name
                bar.update(1)
            save_file(state, str(tmp_dir / file_name), metadata={"format": "pt"})
            del state
        bar.close()
        if len(shards) > 1:
            index_json = {
                "metadata": {"total_size": sum(4 * int(t.n_elements) for t in reader.tensors)},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (tmp_dir / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
        (tmp_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
        (tmp_dir / "generation_config.json").write_text(
            json.dumps({k: v for k, v in generation.items() if v is not None}, indent=2) + "\n"
        )
        types = Counter(GGMLQuantizationType(t.tensor_type).name for t in reader.tensors)
        record = source_record(gguf_path) | {
            "name": metadata.get("general.name"),
            "architecture": arch,
            "tensor_types": dict(sorted(types.items())),
        }
        (tmp_dir / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp_dir.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir
