"""`--load-format dummy`: a model of the source's shape with random weights, no weight file read."""

from __future__ import annotations

import shutil

import pytest
import torch
from support.tiny import make_tiny_gguf

from dynaspec.kpolicy.config import SpeculativeConfig
from dynaspec.models import packs
from dynaspec.models.build import required_names
from dynaspec.models.checkpoint import DUMMY_STD, hf_tensor_shapes
from dynaspec.models.config import ModelConfig
from dynaspec.models.loader import load_config, load_model, resolve_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def config_only_dir(target_dir, tmp_path_factory):
    """The tiny target's directory without its weights: config.json and tokenizer files only."""
    out = tmp_path_factory.mktemp("config_only")
    for path in target_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    return out


def _state(model) -> dict[str, torch.Tensor]:
    return {n: t for n, t in model.state_dict().items() if t.is_floating_point()}


def test_dummy_hf_dir_has_the_model_shapes_without_weight_files(config_only_dir, target_dir):
    assert not list(config_only_dir.glob("*.safetensors"))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(resolve_model(str(config_only_dir)), "auto", torch.float32, CPU)
    source = resolve_model(str(config_only_dir), load_format="dummy")
    dummy = load_model(source, "auto", torch.float32, CPU)
    real = load_model(resolve_model(str(target_dir)), "auto", torch.float32, CPU)
    assert dummy.quantization == "none"  # "auto" for a Hugging Face directory: dense
    assert {n: t.shape for n, t in _state(dummy).items()} == {n: t.shape for n, t in _state(real).items()}
    weight = dummy.model.layers[0].mlp.down_proj.weight
    assert weight.dtype == torch.float32 and abs(float(weight.std()) - DUMMY_STD) < 0.2 * DUMMY_STD
    assert torch.equal(dummy.model.norm.weight, torch.ones_like(dummy.model.norm.weight))
    assert source.tokenizer().eos_token_ids  # the tokenizer still comes from the directory's files


def test_dummy_weights_are_deterministic_and_distinct(config_only_dir):
    source = resolve_model(str(config_only_dir), load_format="dummy")
    a = _state(load_model(source, "auto", torch.bfloat16, CPU))
    b = _state(load_model(source, "auto", torch.bfloat16, CPU))
    assert all(t.dtype == torch.bfloat16 for t in a.values())
    assert all(torch.equal(a[n], b[n]) for n in a)
    q, k = (
        a["model.layers.0.self_attn.qkv_proj.weight"][:64],
        a["model.layers.1.self_attn.qkv_proj.weight"][:64],
    )
    assert not torch.equal(q, k)  # each tensor draws its own values


def test_dummy_keeps_the_quantization_asked_for_on_cpu(config_only_dir):
    source = resolve_model(str(config_only_dir), load_format="dummy")
    assert load_model(source, "int4", torch.float32, CPU).quantization == "int4"
    assert load_model(source, "int8", torch.float32, CPU, head_rows=100).lm_head.out_features == 100


def test_dummy_gguf_reads_only_its_header(target_dir, tmp_path, private_cache):
    gguf = tmp_path / "tiny.gguf"
    make_tiny_gguf(target_dir, gguf)
    source = resolve_model(str(gguf), progress=False, load_format="dummy")
    assert not source.is_gguf  # random dense weights, not the file's blocks
    gguf.write_bytes(b"")  # the weights are gone: a dummy load must not need them
    model = load_model(source, "auto", torch.float32, CPU)
    assert model.quantization == "none"
    assert model.config.num_hidden_layers == load_config(target_dir).num_hidden_layers


def test_dummy_pack_needs_no_download(private_cache, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a dummy pack was downloaded")

    monkeypatch.setattr(packs, "pull", forbidden)
    name = "smollm2-135m-instruct"
    source = resolve_model(name, load_format="dummy")
    model = load_model(source, "auto", torch.bfloat16, CPU)
    expected = ModelConfig.from_hf_dict(packs.PACKS[name].config)
    assert model.config == expected
    assert model.model.embed_tokens.weight.shape == (expected.vocab_size, expected.hidden_size)
    assert not packs.cache_root().exists()  # nothing was written or read in the cache
    with pytest.raises(ValueError, match=f"{name}.*dynaspec models pull {name}"):
        source.tokenizer()


@pytest.mark.parametrize("name", list(packs.PACKS))
def test_every_pack_config_is_valid(name):
    config = ModelConfig.from_hf_dict(packs.PACKS[name].config)
    assert set(required_names(config)) <= set(hf_tensor_shapes(config))


def test_load_format_errors(config_only_dir):
    with pytest.raises(ValueError, match="load_format: must be one of auto, dummy"):
        resolve_model(str(config_only_dir), load_format="random")
    with pytest.raises(ValueError, match="speculative_config.load_format"):
        SpeculativeConfig.parse(
            {"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "load_format": "x"}
        )
    with pytest.raises(
        ValueError, match="speculative_config.load_format: only applies to method draft_model"
    ):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "load_format": "dummy"})


def test_drafter_load_format_defaults_to_the_target_s():
    spec = SpeculativeConfig.parse({"method": "draft_model", "model": "x", "num_speculative_tokens": 2})
    assert spec.load_format is None
    assert spec.for_target("dummy").load_format == "dummy"
    own = SpeculativeConfig.parse(
        {"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "load_format": "auto"}
    )
    assert own.for_target("dummy").load_format == "auto"
    ngram = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    assert ngram.for_target("dummy") is ngram


def test_dummy_engine_with_dummy_drafter(config_only_dir):
    """Target and drafter from a directory without weights: the drafter takes the target's format."""
    from dynaspec.engine.engine import Engine, EngineConfig
    from dynaspec.sampling_params import SamplingParams

    spec = {"method": "draft_model", "model": str(config_only_dir), "num_speculative_tokens": 3}
    engine = Engine(
        EngineConfig(
            model=str(config_only_dir),
            load_format="dummy",
            dtype="float32",
            device="cpu",
            speculative_config=spec,
            kv_cache_memory_gb=0.01,
            progress=False,
        )
    )
    request = engine.add_request("def f(x):", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(request.output_token_ids) == 12


@pytest.mark.packs
@pytest.mark.parametrize("name", list(packs.PACKS))
def test_pack_config_matches_its_gguf(name):
    """The built-in config a dummy pack uses is the one its GGUF's header gives."""
    converted = load_config(packs.pull(name, progress=False))
    built_in = ModelConfig.from_hf_dict(packs.PACKS[name].config)
    for field in ("bos_token_id", "eos_token_ids"):
        setattr(converted, field, getattr(built_in, field))
    assert built_in == converted
