"""GGUF metadata -> a small Hugging Face directory (config, generation config, tokenizer).

A GGUF file (llama.cpp's format) holds quantized weights under llama.cpp's tensor names, the model
hyperparameters and the tokenizer as metadata. `convert_gguf` writes the metadata once into a
directory beside the cache (kilobytes to a few megabytes, no weights); the weights are read from
the GGUF file itself every time, memory-mapped and kept in their own blocks (`checkpoint.py`).
A file without `output.weight` ties the output head to the token embedding.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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


SOURCE_RECORD = "dynaspec_source.json"
FORMAT = 2  # of the directory convert_gguf writes; 1 held float32 safetensors


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


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str  # llama.cpp's name
    shape: tuple[int, ...]  # PyTorch order (GGUF lists dims innermost first)
    qtype: int  # GGMLQuantizationType
    offset: int  # of the data, from the start of the file
    n_bytes: int


_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_SHORT_ARRAY = 64  # longer metadata arrays (the tokenizer's) are skipped, not read


def read_gguf_index(path: str | Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """A GGUF file's metadata (arrays longer than a few dozen items given as their length) and its
    tensor table, read straight from the header: `gguf.GGUFReader` builds Python objects for every
    vocabulary entry and takes seconds where this takes milliseconds."""
    import mmap

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None
    pos = 0

    def take(fmt: str):
        nonlocal pos
        value = struct.unpack_from(fmt, buf, pos)[0]
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        pos += n
        return bytes(buf[pos - n : pos]).decode("utf-8", errors="replace")

    def value(kind: int):
        nonlocal pos
        if kind in _SCALARS:
            return take(_SCALARS[kind])
        if kind == _STRING:
            return string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata type {kind}")
        inner, count = take("<I"), take("<Q")
        if count <= _SHORT_ARRAY:
            return [value(inner) for _ in range(count)]
        if inner in _SCALARS:
            pos += count * struct.calcsize(_SCALARS[inner])
        elif inner == _STRING:  # the vocabulary: skip each length-prefixed string, no decoding
            unpack, p = struct.Struct("<Q").unpack_from, pos
            for _ in range(count):
                p += 8 + unpack(buf, p)[0]
            pos = p
        else:
            for _ in range(count):
                value(inner)
        return count

    try:
        with buf:
            if bytes(buf[:4]) != b"GGUF":
                raise ValueError("bad magic")
            pos = 4
            version, n_tensors, n_kv = take("<I"), take("<Q"), take("<Q")
            if version < 2:
                raise ValueError(f"GGUF version {version} is not supported")
            metadata = {}
            for _ in range(n_kv):
                key = string()
                metadata[key] = value(take("<I"))
            raw_infos = []
            for _ in range(n_tensors):
                name = string()
                dims = [take("<Q") for _ in range(take("<I"))]
                raw_infos.append((name, dims, take("<I"), take("<Q")))
            align = int(metadata.get("general.alignment", 32))
            start = pos + (-pos % align)
            size = len(buf)
    except (struct.error, ValueError, UnicodeDecodeError, OverflowError, IndexError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None
    tensors = []
    for name, dims, qtype, offset in raw_infos:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name} has unknown type {qtype}") from None
        n_elements = int(np.prod(dims)) if dims else 1
        n_bytes = n_elements // block * type_size
        if start + offset + n_bytes > size:
            raise ValueError(f"{path}: tensor {name} lies past the end of the file")
        tensors.append(TensorInfo(name, tuple(reversed(dims)), qtype, start + offset, n_bytes))
    return metadata, tensors


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Write a GGUF file's config, generation config and tokenizer as a Hugging Face directory at
    out_dir (replaced if present); the weights stay in the GGUF file.

    Writes into a temporary sibling first and renames it into place, so out_dir is either absent
    or complete. Checks every tensor's name now, so an unsupported file fails before any loading.
    Returns out_dir.
    """
    from gguf import GGMLQuantizationType

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    metadata, tensors = read_gguf_index(gguf_path)
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}: dynaspec converts "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    shapes = {hf_tensor_name(t.name): t.shape for t in tensors}
    config = hf_config_from_gguf(metadata, shapes)
    ModelConfig.from_hf_dict(config)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    try:
        _write_tokenizer(gguf_path, tmp_dir)
        (tmp_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
        (tmp_dir / "generation_config.json").write_text(
            json.dumps({k: v for k, v in generation.items() if v is not None}, indent=2) + "\n"
        )
        types = Counter(GGMLQuantizationType(t.qtype).name for t in tensors)
        record = source_record(gguf_path) | {
            "format": FORMAT,
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
