"""From a user's `--model` string to a model source, and from that to (config, checkpoint, tokenizer).

`resolve_model` accepts a local Hugging Face directory, a `.gguf` file (its config and tokenizer
written once into the cache, keyed by the file's absolute path, size and mtime; the weights stay in
the file) or an offline pack name (`pull`ed once). `ModelSource.checkpoint()` reads the weights: the
GGUF file memory-mapped, or the directory's safetensors.

With `load_format="dummy"` (vLLM's `--load-format dummy`) no weight file is read: the model takes
its shape from the config (a directory's config.json, a GGUF's header, or a pack's built-in config,
so a pack needs no download) and small random weights (`DummyCheckpoint`), for profiling and
benchmarking a machine without the weights. Its tokenizer still comes from files: a Hugging Face
directory's, a GGUF's, or a pack's in the cache (a pack not pulled has none, and says so).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dynaspec.models.build import build_model, effective_quantization
from dynaspec.models.checkpoint import Checkpoint, DummyCheckpoint, GgufCheckpoint, SafetensorsCheckpoint
from dynaspec.models.config import ModelConfig
from dynaspec.models.gguf import FORMAT, SOURCE_RECORD, convert_gguf, source_record
from dynaspec.models.llama import LlamaModel
from dynaspec.models.packs import GGUF_NAME, HF_DIR_NAME, PACKS, cache_root, is_cached, pack_dir, pull
from dynaspec.models.tokenizer import Tokenizer

CPU = torch.device("cpu")
LOAD_FORMATS = ("auto", "dummy")  # auto: the source's weights; dummy: random ones, no weight file read


@dataclass(frozen=True, slots=True)
class ModelSource:
    # config.json, generation_config.json, tokenizer files (and safetensors if no GGUF); None for a
    # dummy pack that is not in the cache (its config is built in, its tokenizer absent)
    directory: Path | None
    gguf: Path | None  # the weights, read in place; None: *.safetensors in `directory`
    load_format: str = "auto"  # one of LOAD_FORMATS
    pack: str | None = None  # the pack name, when the model was given as one

    @property
    def is_dummy(self) -> bool:
        return self.load_format == "dummy"

    @property
    def is_gguf(self) -> bool:
        """Whether the weights are a GGUF file's blocks (a dummy model's are dense random values)."""
        return self.gguf is not None and not self.is_dummy

    def config(self) -> ModelConfig:
        if self.is_dummy and self.pack is not None:
            return ModelConfig.from_hf_dict(PACKS[self.pack].config)
        assert self.directory is not None, "only a dummy pack has no directory"
        return load_config(self.directory)

    def tokenizer(self) -> Tokenizer:
        if self.directory is None:
            raise ValueError(
                f"model {self.pack!r}: --load-format dummy builds the pack's shape without a download, "
                f"but its tokenizer is not in the cache ({pack_dir(self.pack)}): run "
                f"`dynaspec models pull {self.pack}` once, or give --model a Hugging Face directory "
                "holding config.json and the tokenizer files"
            )
        return load_tokenizer(self.directory)

    def checkpoint(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device = CPU
    ) -> Checkpoint:
        """The weights; a dummy source's are made on ``device`` in ``dtype``."""
        if self.is_dummy:
            return DummyCheckpoint(config, dtype, device)
        if self.gguf is not None:
            return GgufCheckpoint(self.gguf, config)
        assert self.directory is not None, "only a dummy pack has no directory"
        return SafetensorsCheckpoint(_check_dir(self.directory))

    def transformers_kwargs(self) -> dict[str, str]:
        """`from_pretrained` arguments that load the same weights in transformers (the reference)."""
        if self.gguf is None:
            return {"pretrained_model_name_or_path": str(self.directory)}
        return {"pretrained_model_name_or_path": str(self.gguf.parent), "gguf_file": self.gguf.name}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model(spec: str, progress: bool = True, load_format: str = "auto") -> ModelSource:
    """What `spec` names (writing a GGUF's metadata or downloading a pack first if needed; with
    ``load_format="dummy"`` a pack is never downloaded, and a GGUF's header alone is read)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}")
    path = Path(spec).expanduser()
    if path.is_dir():
        return ModelSource(path, None, load_format)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model {spec!r} is a file but not a .gguf file")
        return ModelSource(gguf_cache_dir(path, progress), path, load_format)
    if spec in PACKS and load_format == "dummy":
        directory = pack_dir(spec) / HF_DIR_NAME if is_cached(spec) else None
        return ModelSource(directory, None, load_format, pack=spec)
    if spec in PACKS:
        directory = pull(spec, progress=progress)
        return ModelSource(directory, directory.parent / GGUF_NAME, load_format, pack=spec)
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
    """The model of `source`, its weights read in place (or made up, for a dummy source) and built
    in the quantization asked for; on the CPU, held in 2 MiB pages (``hugepages``)."""
    config = source.config()
    mode = effective_quantization(quantization, source.is_gguf, device)
    # dummy weights re-quantized at load start from float32, as a checkpoint's dense values do
    made_in = dtype if mode == "none" else torch.float32
    checkpoint = source.checkpoint(config, made_in, device)
    model = build_model(config, checkpoint, mode, dtype, device, head_rows, progress)
    model.quantization = mode
    return model
