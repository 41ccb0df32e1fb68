"""From a user's `--model` string to a Hugging Face directory, and from that to (config, weights,
tokenizer).

`resolve_model` accepts a local Hugging Face directory, a `.gguf` file (converted once into the
cache, keyed by the file's absolute path, size and mtime) or an offline pack name (`pull`ed once).
Everything downstream loads plain Hugging Face directories.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from dynaspec.models.config import ModelConfig
from dynaspec.models.gguf import SOURCE_RECORD, convert_gguf, source_record
from dynaspec.models.packs import PACKS, cache_root, pull
from dynaspec.models.tokenizer import Tokenizer


def resolve_model(spec: str, progress: bool = True) -> Path:
    """The Hugging Face directory that `spec` names (converting or downloading it first if needed)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model {spec!r} is a file but not a .gguf file")
        return gguf_cache_dir(path, progress)
    if spec in PACKS:
        return pull(spec, progress=progress)
    raise ValueError(
        f"unknown model {spec!r}: not a directory, a .gguf file, or a pack name (known: {', '.join(PACKS)})"
    )


def gguf_cache_dir(gguf_path: Path, progress: bool = True) -> Path:
    """The converted copy of a GGUF file in the cache, converting it when absent or stale."""
    record = source_record(gguf_path)
    key = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]
    out_dir = cache_root() / "gguf" / f"{gguf_path.stem}-{key}"
    source = out_dir / SOURCE_RECORD
    if source.is_file():
        try:
            cached = json.loads(source.read_text())
        except (OSError, json.JSONDecodeError):
            cached = None
        if cached is not None and all(cached.get(k) == v for k, v in record.items()):
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


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of all *.safetensors files in the directory (memory-mapped where possible)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = _check_dir(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors file")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors = load_file(str(file))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{file}: corrupt safetensors file ({first_line})") from None
        duplicate = weights.keys() & tensors.keys()
        if duplicate:
            raise ValueError(f"{file}: tensor {sorted(duplicate)[0]!r} also appears in another shard")
        weights.update(tensors)
    return weights


def load_hf_dir(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, weights (Hugging Face names) and tokenizer of a Hugging Face model directory."""
    config = load_config(path)
    tokenizer = load_tokenizer(path)
    weights = load_weights(path)
    return config, weights, tokenizer
