"""From a user's `--model` string to a model source, and from that to (config, checkpoint, tokenizer).

`resolve_model` accepts a local Hugging Face directory, a `.gguf` file (its config and tokenizer
written once into the cache, keyed by the file's absolute path, size and mtime; the weights stay in
the file) or an offline pack name (`pull`ed once). `ModelSource.checkpoint()` reads the weights: the
GGUF file memory-mapped, or the directory's safetensors.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dynaspec.models.build import build_model, effective_quantization
from dynaspec.models.checkpoint import Checkpoint, GgufCheckpoint, SafetensorsCheckpoint
from dynaspec.models.config import ModelConfig
from dynaspec.models.gguf import FORMAT, SOURCE_RECORD, convert_gguf, source_record
from dynaspec.models.llama import LlamaModel
from dynaspec.models.packs import GGUF_NAME, PACKS, cache_root, pull
from dynaspec.models.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class ModelSource:
    directory: Path  # config.json, generation_config.json, tokenizer files (and safetensors if no GGUF)
    gguf: Path | None  # the weights, read in place; None: *.safetensors in `directory`

    @property
    def is_gguf(self) -> bool:
        return self.gguf is not None

    def config(self) -> ModelConfig:
        return load_config(self.directory)

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.directory)

    def checkpoint(self, config: ModelConfig) -> Checkpoint:
        if self.gguf is not None:
            return GgufCheckpoint(self.gguf, config)
        return SafetensorsCheckpoint(_check_dir(self.directory))

    def transformers_kwargs(self) -> dict[str, str]:
        """`from_pretrained` arguments that load the same weights in transformers (the reference)."""
        if self.gguf is None:
            return {"pretrained_model_name_or_path": str(self.directory)}
        return {"pretrained_model_name_or_path": str(self.gguf.parent), "gguf_file": self.gguf.name}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model(spec: str, progress: bool = True) -> ModelSource:
    """What `spec` names (writing a GGUF's metadata or downloading a pack first if needed)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return ModelSource(path, None)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model {spec!r} is a file but not a .gguf file")
        return ModelSource(gguf_cache_dir(path, progress), path)
    if spec in PACKS:
        directory = pull(spec, progress=progress)
        return ModelSource(directory, directory.parent / GGUF_NAME)
    raise ValueError(
        f"unknown model {spec!r}: not a directory, a .gguf file, or a pack name (known: {', '.join(PACKS)})"
    )


def gguf_cache_dir(gguf_path: Path, progress: bool = True) -> Path:
    """The config and tokenizer of a GGUF file in the cache, written when absent or stale."""
    record = source_record(gguf_path)
    key = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]
    out_dir = cache_root() / "gguf" / f"{gguf_path.stem}-{key}"
    source = out_dir / SOURCE_RECORD
    if source.is_file():
        try:
            cached = json.loads(source.read_text())
        except (OSError, json.JSONDecodeError):
            cached = None
        fresh = cached is not None and cached.get("format") == FORMAT
        if fresh and all(cached.get(k) == v for k, v in record.items()):
            return out_dir
    return convert_gguf(gguf_path, out_dir, progress=progress)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"{path}: file missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _check_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    return path


def load_config(path: str | Path) -> ModelConfig:
    """ModelConfig from config.json, with end-of-sequence ids from generation_config.json merged in."""
    path = _check_dir(path)
    d = _read_json(path / "config.json")
    try:
        config = ModelConfig.from_hf_dict(d)
    except KeyError as e:
        raise ValueError(f"{path / 'config.json'}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path / 'config.json'}: {e}") from None
    generation_path = path / "generation_config.json"
    if generation_path.is_file():
        eos = _read_json(generation_path).get("eos_token_id")
        for token_id in [eos] if isinstance(eos, int) else (eos or []):
            if token_id not in config.eos_token_ids:
                config.eos_token_ids.append(int(token_id))
    return config


def load_tokenizer(path: str | Path) -> Tokenizer:
    return Tokenizer.from_dir(_check_dir(path))


def compute_dtypes(dtype: str, mode: str) -> tuple[torch.dtype, torch.dtype]:
    """(activations, KV cache) for `--dtype` under an effective quantization mode. "auto": float32
    activations around quantized layers (their kernels take and give float32, and elementwise float32
    is fast on a CPU, as in llama.cpp), bfloat16 for dense ones; the KV cache in bfloat16."""
    if dtype == "auto":
        return (torch.bfloat16 if mode == "none" else torch.float32), torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"dtype: must be auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype], DTYPES[dtype]


def load_model(
    source: ModelSource,
    quantization: str,
    dtype: torch.dtype,
    device: torch.device,
    head_rows: int | None = None,
    progress: bool = False,
) -> LlamaModel:
    """The model of `source`, its weights read in place and built in the quantization asked for."""
    config = source.config()
    mode = effective_quantization(quantization, source.is_gguf, device)
    model = build_model(config, source.checkpoint(config), mode, dtype, device, head_rows, progress)
    model.quantization = mode
    return model
