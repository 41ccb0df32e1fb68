"""Model loading without the real packs: tiny HF directories, tiny GGUF files, tokenizer, errors."""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest
import torch
from support.tiny import (
    IM_END,
    IM_START,
    dynaspec_logits,
    load_hf_dir,
    load_weights,
    make_tiny_gguf,
    make_tiny_model_dir,
    make_tiny_tokenizer,
)

from dynaspec.models import packs
from dynaspec.models.gguf import convert_gguf
from dynaspec.models.loader import load_config, load_tokenizer, resolve_model
from dynaspec.models.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

MULTIBYTE_TEXT = "héllo 🙂 wörld, 你好！ naïve ✓"


pytestmark = pytest.mark.usefixtures("private_cache")  # every test gets its own empty cache


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {
        "llama": make_tiny_model_dir(root / "llama", arch="llama"),
        "llama-tied": make_tiny_model_dir(root / "llama-tied", arch="llama", tie=True, seed=1),
        "qwen2": make_tiny_model_dir(root / "qwen2", arch="qwen2", tie=True, seed=2),
        "qwen3": make_tiny_model_dir(root / "qwen3", arch="qwen3", seed=3, head_dim=32),
    }


# --- Hugging Face directories -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "llama-tied", "qwen2", "qwen3"])
def test_hf_dir_round_trip(tiny_dirs, name):
    path = tiny_dirs[name]
    config, weights, tokenizer = load_hf_dir(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert config.architecture == hf.config.model_type
    assert config.vocab_size == tokenizer.vocab_size == hf.config.vocab_size
    assert config.tie_word_embeddings == (name.endswith("tied") or name == "qwen2")
    assert config.head_dim == hf.config.head_dim
    assert ("lm_head.weight" in weights) == (not config.tie_word_embeddings)
    state = hf.state_dict()
    for key, value in weights.items():
        assert value.dtype == torch.float32
        assert torch.equal(value, state[key]), key

    ids = tokenizer.apply_chat_template([{"role": "user", "content": "def fibonacci(n):"}])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = dynaspec_logits(config, weights, ids)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-4


def test_load_config_reads_generation_config_eos(tiny_dirs, tmp_path):
    path = tmp_path / "m"
    path.mkdir()
    for f in tiny_dirs["llama"].iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    config = load_config(path)
    assert config.eos_token_ids == [2, 0]
    assert load_tokenizer(path).eos_token_ids == [2, 0]


def _copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(path: Path, **changes) -> None:
    d = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            d.pop(key, None)
        else:
            d[key] = value
    (path / "config.json").write_text(json.dumps(d))


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("no_dir", "not a directory"),
        ("no_config", "config.json: file missing"),
        ("bad_json", "config.json: not valid JSON"),
        ("missing_field", "config.json: missing field 'hidden_size'"),
        ("unsupported_arch", "unsupported architecture 'gpt2'"),
        ("no_weights", "no *.safetensors file"),
        ("truncated_weights", "model.safetensors: corrupt safetensors file"),
        ("garbage_weights", "model.safetensors: corrupt safetensors file"),
        ("no_tokenizer", "no tokenizer"),
        ("bad_tokenizer", "cannot load tokenizer"),
    ],
)
def test_broken_hf_dir_errors(tiny_dirs, tmp_path, breakage, message):
    path = _copy_dir(tiny_dirs["llama"], tmp_path / "m")
    weights = path / "model.safetensors"
    if breakage == "no_dir":
        path = tmp_path / "does-not-exist"
    elif breakage == "no_config":
        (path / "config.json").unlink()
    elif breakage == "bad_json":
        (path / "config.json").write_text("{not json")
    elif breakage == "missing_field":
        _edit_config(path, hidden_size=None)
    elif breakage == "unsupported_arch":
        _edit_config(path, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    elif breakage == "no_weights":
        weights.unlink()
    elif breakage == "truncated_weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif breakage == "garbage_weights":
        weights.write_bytes(os.urandom(1000))
    elif breakage == "bad_tokenizer":
        (path / "tokenizer.json").write_text("{broken")
    elif breakage == "no_tokenizer":
        for f in path.glob("tokenizer*"):
            f.unlink()
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("(", r"\(")) as info:
        load_hf_dir(path)
    assert "\n" not in str(info.value)


def test_resolve_model_choices(tiny_dirs, tmp_path):
    assert resolve_model(str(tiny_dirs["llama"])).directory == tiny_dirs["llama"]
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(not_gguf))
    with pytest.raises(
        ValueError, match=r"unknown model 'no-such-model'.*known: qwen2.5-coder-1.5b-instruct"
    ):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match="unknown pack 'nope'.*smollm2-135m-instruct"):
        packs.pull("nope")


# --- tokenizer ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_dirs) -> Tokenizer:
    return load_tokenizer(tiny_dirs["llama"])


def test_tokenizer_basics(tokenizer):
    ids = tokenizer.encode(MULTIBYTE_TEXT)
    assert tokenizer.decode(ids) == MULTIBYTE_TEXT
    assert tokenizer.hf_tokenizer.encode(MULTIBYTE_TEXT) == ids  # the transformers default (no BOS here)
    eos = tokenizer.hf_tokenizer.convert_tokens_to_ids(IM_END)
    assert tokenizer.eos_token_ids == [eos]
    assert tokenizer.decode(ids + [eos]) == MULTIBYTE_TEXT  # special tokens skipped


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    ids = tokenizer.apply_chat_template(messages)
    text = tokenizer.hf_tokenizer.decode(ids)
    assert text == f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n"
    assert ids.count(tokenizer.hf_tokenizer.convert_tokens_to_ids(IM_START)) == 3  # whole special tokens


def test_no_chat_template_is_an_error(tmp_path):
    make_tiny_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    with pytest.raises(ValueError, match="model has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_same_vocabulary(tiny_dirs, tmp_path):
    a = load_tokenizer(tiny_dirs["llama"])
    assert a.same_vocabulary(load_tokenizer(tiny_dirs["qwen3"]))
    make_tiny_tokenizer(tmp_path)
    raw = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = raw["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    assert not a.same_vocabulary(Tokenizer.from_dir(tmp_path))


def test_incremental_detokenizer_multibyte(tokenizer):
    prompt = tokenizer.encode("Say:")
    out_ids = tokenizer.encode(" " + MULTIBYTE_TEXT)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add([i]) for i in out_ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == detok.text == " " + MULTIBYTE_TEXT
    assert pieces.count("") >= 3  # the emoji and CJK characters span several byte tokens: held back
    # several ids at once, and a trailing incomplete character that only flush() releases
    detok = IncrementalDetokenizer(tokenizer, prompt)
    emoji = tokenizer.encode("🙂")
    assert len(emoji) > 1
    assert detok.add(out_ids[:5]) == tokenizer.decode(out_ids[:5])
    assert detok.add(emoji[:-1]) == ""
    assert detok.flush().endswith("\ufffd")


# --- GGUF ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "llama-tied", "qwen2", "qwen3"])
def test_gguf_converts_back_to_hf_weights(tiny_dirs, tmp_path, name):
    hf_dir = tiny_dirs[name]
    gguf_path = tmp_path / f"{name}.gguf"
    expected = make_tiny_gguf(hf_dir, gguf_path)
    out = convert_gguf(gguf_path, tmp_path / "converted", progress=False)
    assert not list(out.glob("*.safetensors"))  # the weights stay in the GGUF file

    config, tokenizer = load_config(out), load_tokenizer(out)
    weights = load_weights(gguf_path)
    original_config, original_weights, original_tokenizer = load_hf_dir(hf_dir)
    assert config == original_config
    assert set(weights) == set(expected) == set(original_weights)
    for key, value in weights.items():
        assert torch.equal(value, expected[key]), key  # exact: dequantized and un-permuted
        scale = original_weights[key].abs().max()
        assert (value - original_weights[key]).abs().max() <= 0.15 * scale, key  # quantization error only

    assert tokenizer.same_vocabulary(original_tokenizer)
    assert tokenizer.encode(MULTIBYTE_TEXT) == original_tokenizer.encode(MULTIBYTE_TEXT)
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages) == original_tokenizer.apply_chat_template(messages)
    assert tokenizer.eos_token_ids == original_tokenizer.eos_token_ids
    source = json.loads((out / "dynaspec_source.json").read_text())
    assert source["size"] == gguf_path.stat().st_size and source["architecture"] == config.architecture


# Not qwen3: transformers' GGUF loader ignores `qwen3.attention.key_length` and takes Qwen3Config's
# default head_dim of 128, which a tiny model does not have.
@pytest.mark.parametrize("name", ["llama", "llama-tied", "qwen2"])
def test_gguf_conversion_matches_transformers_gguf_loader(tiny_dirs, tmp_path, name):
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF file
    gguf_path = tmp_path / f"{name}.gguf"
    make_tiny_gguf(tiny_dirs[name], gguf_path)
    weights = load_weights(gguf_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=gguf_path.name, dtype=torch.float32
    )
    state = ref.state_dict()
    for key, value in weights.items():
        assert torch.equal(value, state[key]), key


def test_gguf_types_and_cache(tiny_dirs, tmp_path):
    """F32/F16/Q8_0 everywhere, and resolve_model writes a .gguf's metadata once, again when it changes."""
    gguf_path = tmp_path / "m.gguf"
    types = {
        "embed_tokens.weight": "F32",
        "q_proj.weight": "F16",
        "k_proj.weight": "Q8_0",
        "v_proj.weight": "Q8_0",
        "o_proj.weight": "F16",
        "mlp": "Q8_0",
        "lm_head.weight": "F16",
    }
    expected = make_tiny_gguf(tiny_dirs["llama"], gguf_path, types)
    source = resolve_model(str(gguf_path), progress=False)
    first = source.directory
    assert first.is_relative_to(packs.cache_root()) and source.gguf == gguf_path
    weights = load_weights(gguf_path)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    stamp = (first / "config.json").stat().st_mtime_ns
    assert resolve_model(str(gguf_path), progress=False).directory == first
    assert (first / "config.json").stat().st_mtime_ns == stamp  # not converted again
    os.utime(gguf_path, ns=(stamp, stamp + 10**9))
    second = resolve_model(str(gguf_path), progress=False).directory
    assert second != first and (second / "config.json").is_file()


def test_gguf_unsupported_architecture(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_gguf_corrupt_file(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ValueError, match="broken.gguf"):
        resolve_model(str(path), progress=False)


# --- packs, without the network -----------------------------------------------------------------


def _fake_wheel(path: Path, member: str, payload: bytes, recorded: bytes | None = None) -> Path:
    digest = base64.urlsafe_b64encode(hashlib.sha256(recorded or payload).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(member, payload)
        wheel.writestr(
            "pkg-0.1.dist-info/RECORD",
            f"{member},sha256={digest},{len(payload)}\npkg-0.1.dist-info/RECORD,,\n",
        )
    return path


def test_wheel_member_is_checked_against_record(tmp_path):
    good = _fake_wheel(tmp_path / "good.whl", "pkg/data/part01.bin", b"abc" * 1000)
    assert packs._extract_verified(good, ".bin", tmp_path / "out.bin") == 3000
    assert (tmp_path / "out.bin").read_bytes() == b"abc" * 1000
    bad = _fake_wheel(tmp_path / "bad.whl", "pkg/data/part01.bin", b"abc" * 1000, recorded=b"abd" * 1000)
    with pytest.raises(packs.PackDownloadError, match="does not match"):
        packs._extract_verified(bad, ".bin", tmp_path / "out2.bin")


def test_failed_pull_leaves_nothing_cached(monkeypatch):
    calls = []

    def fail_on_third(requirement, suffix, work, out_path):
        calls.append(requirement)
        if len(calls) == 3:
            raise packs.PackDownloadError("simulated network failure")
        out_path.write_bytes(b"\0" * 10)
        return 10

    monkeypatch.setattr(packs, "_download_part", fail_on_third)
    with pytest.raises(packs.PackDownloadError, match="simulated"):
        packs.pull("qwen2.5-coder-0.5b-instruct", progress=False)
    assert not packs.is_cached("qwen2.5-coder-0.5b-instruct")
    assert not any((packs.cache_root() / "packs").iterdir())  # no partial directory left behind
    assert [p.cached for p in packs.list_packs()] == [False, False, False]


def test_cli_models(capsys):
    from dynaspec.cli import models as cli_models

    parser = argparse.ArgumentParser(prog="dynaspec")
    cli_models.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["models", "list"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in packs.PACKS) and "1.12 GB" in out
    args = parser.parse_args(["models", "pull", "nope", "--quiet"])
    assert args.func(args) == 1
    assert "unknown pack 'nope'" in capsys.readouterr().err
