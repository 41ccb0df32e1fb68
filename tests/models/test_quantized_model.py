"""Models built from a GGUF file's own quantized blocks (`--quantization auto`), on tiny models.

Checks the quantized model against the same file dequantized, the llama Q/K row order on quantized
rows, the embedding looked up in place, batch invariance of the whole forward pass (a token's
logits do not depend on what shares the pass), and lossless greedy speculation end to end.
"""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from support.tiny import make_tiny_gguf, make_tiny_model_dir

from dynaspec import SamplingParams
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.engine.kv_cache import allocate_kv_cache
from dynaspec.engine.runner import TokenRun
from dynaspec.models.attention import build_attention_metadata
from dynaspec.models.build import ConcatLinear, QuantEmbedding
from dynaspec.models.loader import load_model, resolve_model
from dynaspec.models.qlinear import QuantLinear, kernel_error

CPU = torch.device("cpu")
# the types a Q4_K_M-style file mixes, in the group sizes gguf-py can write: q and k share a layout
# (fused into one layer), v differs (a second layer), gate/up 5-bit, the head and embedding 8-bit
TYPES = {
    "embed_tokens.weight": "Q8_0",
    "q_proj.weight": "Q4_0",
    "k_proj.weight": "Q4_0",
    "v_proj.weight": "Q8_0",
    "o_proj.weight": "Q4_1",
    "gate_proj.weight": "Q5_0",
    "up_proj.weight": "Q5_0",
    "down_proj.weight": "Q8_0",
    "lm_head.weight": "Q8_0",
}


pytestmark = pytest.mark.usefixtures("private_cache")  # every test gets its own empty cache


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for name, kwargs in {
        "llama": dict(arch="llama", seed=4),
        "qwen2": dict(arch="qwen2", seed=5, tie=True),
        "qwen3": dict(arch="qwen3", seed=6, head_dim=32),
        "draft": dict(arch="qwen2", seed=7, num_layers=1, tie=True),
    }.items():
        hf_dir = make_tiny_model_dir(root / name, **kwargs)
        path = root / f"{name}.gguf"
        make_tiny_gguf(hf_dir, path, TYPES)
        out[name] = str(path)
    return out


def _logits(model, ids: list[int]) -> torch.Tensor:  # one prefill, logits at every position
    kv = allocate_kv_cache(model.config, 64, torch.float32, CPU)
    meta = build_attention_metadata([len(ids)], [len(ids)], [[0, 1, 2, 3]], 16, CPU)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), kv, meta))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_quantized_model_matches_dequantized(ggufs, arch):
    source = resolve_model(ggufs[arch], progress=False)
    quantized = load_model(source, "auto", torch.float32, CPU)
    dense = load_model(source, "none", torch.float32, CPU)
    assert quantized.quantization == "gguf" and dense.quantization == "none"
    qkv = quantized.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, ConcatLinear) and len(qkv.parts) == 2  # Q4_0 q+k, then the Q8_0 v
    assert isinstance(quantized.model.layers[0].mlp.gate_up_proj, QuantLinear)  # Q5_0 gate+up: one layer
    assert isinstance(quantized.model.embed_tokens, QuantEmbedding)
    ids = list(range(3, 40))
    # the embedding is looked up from the quantized rows exactly
    assert torch.equal(
        quantized.model.embed_tokens(torch.tensor(ids)), dense.model.embed_tokens(torch.tensor(ids))
    )
    # re-quantized at load, the embedding is still the file's rows, not a dense copy of them
    requantized = load_model(source, "int4", torch.float32, CPU)
    assert isinstance(requantized.model.embed_tokens, QuantEmbedding)
    assert torch.equal(
        requantized.model.embed_tokens(torch.tensor(ids)), dense.model.embed_tokens(torch.tensor(ids))
    )
    q, d = _logits(quantized, ids), _logits(dense, ids)
    # the only difference: activations rounded to int8 per group of 32 inside each quantized layer
    # (as llama.cpp does); random tiny models with large activations amplify it to a few percent
    mean_rel = ((q - d).abs().mean() / d.abs().mean()).item()
    assert mean_rel < 0.06, mean_rel
    assert (q.argmax(-1) == d.argmax(-1)).float().mean() >= 0.9


def test_embedding_rows_kept_decoded_are_the_file_s_and_their_cache_is_bounded(ggufs):
    source = resolve_model(ggufs["qwen2"], progress=False)
    embed = load_model(source, "auto", torch.float32, CPU).model.embed_tokens
    dense = load_model(source, "none", torch.float32, CPU).model.embed_tokens
    hidden = embed.shape[1]
    small = QuantEmbedding(embed.rows, embed.qtype, embed.shape, torch.float32, cache_bytes=5 * hidden * 4)
    assert small.cache_rows == 5
    rng = np.random.default_rng(0)
    for n in [1, 2, 1, 3, 7, 1, 1, 4, 2, 1]:  # decode-sized lookups, repeats and ids beyond the cache
        ids = torch.tensor(rng.integers(0, 12, size=n))
        assert torch.equal(small(ids), dense(ids))
        assert len(small.cache) <= 5
    assert len(small.cache) > 0
    last = int(ids[-1])
    assert next(reversed(small.cache)) == last  # the most recent id is the last one out
    prefill = torch.arange(3, 3 + QuantEmbedding.CACHE_LOOKUP_ROWS + 1)
    kept = dict(small.cache)
    assert torch.equal(small(prefill), dense(prefill))
    assert small.cache.keys() == kept.keys()  # a prefill's lookup decodes directly


@pytest.mark.skipif(kernel_error() is not None, reason="the C++ kernels do not build here")
def test_forward_is_batch_invariant(ggufs):
    """A sequence's logits are bitwise the same prefilled at once, decoded token by token, or
    sharing every pass with other sequences (the property lossless greedy speculation needs)."""
    engine = Engine(EngineConfig(model=ggufs["qwen2"], progress=False, kv_cache_memory_gb=0.01))
    assert engine.quantization == "gguf" and engine.runner.rowwise
    run = engine.runner.run
    ids = list(range(5, 35))
    other = list(range(50, 90))
    alloc = engine.allocator

    def blocks(n: int) -> list[int]:
        b: list[int] = []
        assert alloc.grow(b, n)
        return b

    a = blocks(len(ids))
    whole = run([TokenRun(ids, 0, a, list(range(len(ids))))])
    b = blocks(len(ids))
    run([TokenRun(ids[:10], 0, b, [])])
    one_by_one = [run([TokenRun([t], 10 + i, b, [0])]) for i, t in enumerate(ids[10:])]
    c, o = blocks(len(ids)), blocks(len(other))
    run([TokenRun(other[:20], 0, o, []), TokenRun(ids[:10], 0, c, [])])  # chunks of another size
    mixed = run([TokenRun(ids[10:], 10, c, list(range(20))), TokenRun(other[20:], 20, o, [0, 5])])
    assert torch.equal(torch.cat(one_by_one), whole[10:])
    assert torch.equal(mixed[:20], whole[10:])


@pytest.mark.skipif(kernel_error() is not None, reason="the C++ kernels do not build here")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain, q/k/v bias, q/k norms
def test_decoder_stack_matches_the_modules(ggufs, arch):
    """The stack as one C++ call (csrc/layer.cpp) gives bitwise the module path's logits and K/V
    cache, for a prefill and a ragged pass (a verify window beside a decode row), with a q/k/v
    projection split in two parts (ConcatLinear) and a bfloat16 cache."""
    engine = Engine(EngineConfig(model=ggufs[arch], progress=False, kv_cache_memory_gb=0.01))
    model, runner = engine.runner.model, engine.runner
    assert runner.rowwise and runner.kv_caches[0][0].dtype == torch.bfloat16
    alloc = engine.allocator
    outputs, caches = {}, {}
    for use in (False, True):
        model.use_stack = use
        a, b = [], []
        assert alloc.grow(a, 40) and alloc.grow(b, 40)
        first = runner.run(
            [TokenRun(list(range(5, 30)), 0, a, [24]), TokenRun(list(range(40, 52)), 0, b, [11])]
        )
        ragged = runner.run([TokenRun([7, 8, 9, 10], 25, a, [0, 1, 2, 3]), TokenRun([60], 12, b, [0])])
        outputs[use] = torch.cat([first, ragged])
        size = alloc.block_size
        slots = torch.tensor(
            [a[p // size] * size + p % size for p in range(29)]
            + [b[p // size] * size + p % size for p in range(13)]
        )
        caches[use] = [torch.cat([k[slots], v[slots]]) for k, v in runner.kv_caches]
        alloc.free(a)
        alloc.free(b)
    assert isinstance(model._stack, torch.ScriptObject)  # the stack did run
    assert torch.equal(outputs[True], outputs[False])
    assert all(torch.equal(x, y) for x, y in zip(caches[True], caches[False]))
    model.float()  # moving the weights drops the stack; it is rebuilt on the next pass
    assert model._stack is None


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_quantized_greedy_speculation_is_lossless(ggufs, method):
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = ggufs["qwen2"]  # the target drafting for itself: most drafts accepted
    prompts = [list(range(3 + i, 12 + i)) * 3 for i in range(5)]  # repeats: material for n-gram lookup
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    for name, config in {"plain": None, "spec": spec}.items():
        engine = Engine(
            EngineConfig(model=ggufs["qwen2"], speculative_config=config, max_num_seqs=4, progress=False)
        )
        assert engine.quantization == "gguf"
        requests = [engine.add_request(prompts[0], params)]
        for p in prompts[1:]:  # staggered arrivals: prefills share passes with verification
            engine.step()
            requests.append(engine.add_request(p, params))
        while engine.has_unfinished():
            engine.step()
        outputs[name] = [r.output_token_ids for r in requests]
        if config:
            assert engine.stats()["spec"]["num_accepted_tokens"] > 0
            if method == "draft_model":  # the drafter's default on the CPU: 4 bits at load
                assert engine.proposer.model.quantization == "int4"
    assert outputs["spec"] == outputs["plain"]


def test_quantization_at_load_of_a_dense_checkpoint(target_dir):
    source = resolve_model(str(target_dir))
    for mode in ("int8", "int4"):
        model = load_model(source, mode, torch.float32, CPU)
        assert model.quantization == mode
        assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
    assert load_model(source, "auto", torch.float32, CPU).quantization == "none"  # HF directories stay dense
    with pytest.raises(ValueError, match="quantization: must be one of"):
        EngineConfig(model=str(target_dir), quantization="int3")


@pytest.mark.parametrize(("key", "drafter"), [("int8", "int8"), ("auto", "gguf"), (None, "int4")])
def test_draft_quantization_key(ggufs, key, drafter):
    """draft_quantization picks the drafter's form; without it a CPU drafter runs in 4 bits."""
    spec = {"method": "draft_model", "model": ggufs["draft"], "num_speculative_tokens": 2}
    if key is not None:
        spec["draft_quantization"] = key
    engine = Engine(EngineConfig(model=ggufs["qwen2"], speculative_config=spec, progress=False))
    assert engine.quantization == "gguf" and engine.proposer.model.quantization == drafter


def test_unsupported_block_type_names_tensor_and_type(ggufs, tmp_path):
    """A file whose tensor is of a type the decoder lacks fails at load, naming both."""
    reader = gguf.GGUFReader(ggufs["qwen2"])
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, value, vtype)
    for t in reader.tensors:
        data = np.asarray(t.data)
        qtype = t.tensor_type
        if t.name == "blk.0.ffn_down.weight":  # same bytes per row as its Q8_0 blocks would not do:
            qtype = gguf.GGMLQuantizationType.IQ4_NL  # IQ4_NL rows of the right length, all zero
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            data = np.zeros((int(t.shape[1]), int(t.shape[0]) // block * size), dtype=np.uint8)
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*IQ4_NL"):
        Engine(EngineConfig(model=str(path), progress=False))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_cut_head_keeps_its_other_rows_readable(ggufs, arch):
    """A drafter's head cut to its first rows still reads any other row exactly (the file's rows in
    place for llama's own head, the embedding for qwen2's tied one): what a cut drafter scores a
    request's own rare ids with."""
    source = resolve_model(ggufs[arch], progress=False)
    dense = load_model(source, "none", torch.float32, CPU)
    vocab = dense.config.vocab_size
    cut = load_model(source, "auto", torch.float32, CPU, head_rows=vocab // 2)
    assert cut.lm_head(torch.zeros(1, dense.config.hidden_size)).shape[-1] == vocab // 2
    assert dense.head_lookup is None  # a whole head has nothing to look up
    ids = torch.tensor([vocab // 2, vocab - 1, vocab // 2 + 7])
    expected = dense.lm_head.weight[ids].float()
    torch.testing.assert_close(cut.head_lookup(ids).float(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_requantizing_a_slice_of_rows_at_a_time_changes_nothing(monkeypatch, mode):
    """Re-quantizing at load goes a few rows at a time (so a whole LM head is never float32 at
    once); every row's codes and scale are those of quantizing the whole weight."""
    from dynaspec.models import build
    from dynaspec.models.qlinear import quantize_dense

    dense = torch.randn(10, 64, generator=torch.Generator().manual_seed(7))
    blocks = quantize_dense(dense, 8)  # a GGUF-like source: codes and scales
    bits = 4 if mode == "int4" else 8
    monkeypatch.setattr(build, "REQUANTIZE_ROWS", 3)  # 10 rows: slices of 3, 3, 3 and 1
    for source, values in ((dense, dense), (blocks, blocks.dequantize())):
        sliced, whole = build._convert(source, mode, "w"), quantize_dense(values, bits)
        assert torch.equal(sliced.codes, whole.codes) and torch.equal(sliced.scales, whole.scales)
        assert sliced.offsets is None and sliced.bits == bits


@pytest.mark.skipif(kernel_error() is not None, reason="this file runs the built-in paths already")
def test_this_file_passes_on_the_built_in_paths():
    """DYNASPEC_KERNELS=0, as on a CPU the C++ kernels do not build for: the grouped attention and
    PyTorch's int4/int8 kernels load and run these models too (a float32 query over a bfloat16 cache
    once crashed there, unseen while every test machine built the kernels)."""
    env = os.environ | {"DYNASPEC_KERNELS": "0"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    cmd += ["-k", "not built_in_paths"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:]
    assert " passed" in done.stdout and "skipped" in done.stdout  # the kernel-only tests skipped
