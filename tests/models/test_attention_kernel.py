"""The row-wise paged attention operator (csrc/attention.cpp): against a float64 reference, and each
row's output bitwise the same whatever else shares the call (which keeps greedy speculation
lossless): alone, among its own sequence's verified window or prefill chunk, or among others'."""

import pytest
import torch

from dynaspec.models.kernels import kernel_error

pytestmark = pytest.mark.skipif(kernel_error() is not None, reason=f"no C++ kernels: {kernel_error()}")

# (context already cached, new rows) per sequence: a decode, a verified window of 6, a prefill chunk
# longer than a block of 16 rows, a short window, a long context, a first token
SEQUENCES = [(300, 1), (500, 6), (0, 40), (120, 3), (1000, 20), (7, 1)]


def _case(heads: int, kv_heads: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    total = sum(c + n for c, n in SEQUENCES) + 5
    k_cache = torch.randn(total, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(total, kv_heads, d, generator=g).to(dtype)
    slots = torch.randperm(total, generator=g)  # a sequence's positions scattered over the cache
    table = torch.zeros(len(SEQUENCES), max(c + n for c, n in SEQUENCES), dtype=torch.long)
    row_seq, row_len, at = [], [], 0
    for i, (c, n) in enumerate(SEQUENCES):
        table[i, : c + n] = slots[at : at + c + n]
        at += c + n
        row_seq += [i] * n
        row_len += list(range(c + 1, c + n + 1))
    q = torch.randn(len(row_seq), heads, d, generator=g)
    return q, k_cache, v_cache, table, torch.tensor(row_seq), torch.tensor(row_len)


def _attend(q, k_cache, v_cache, table, row_seq, row_len):
    scale = q.shape[-1] ** -0.5
    return torch.ops.dynaspec.paged_attention_rows(q, k_cache, v_cache, table, row_seq, row_len, scale)


def _reference(q, k_cache, v_cache, table, row_seq, row_len):
    heads, kv_heads, d = q.shape[1], k_cache.shape[1], q.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        keys = table[row_seq[t], : row_len[t]]
        k = k_cache[keys].double().repeat_interleave(heads // kv_heads, dim=1)  # [n, heads, d]
        v = v_cache[keys].double().repeat_interleave(heads // kv_heads, dim=1)
        w = torch.einsum("hd,nhd->hn", q[t].double(), k) * d**-0.5
        out[t] = torch.einsum("hn,nhd->hd", w.softmax(-1), v)
    return out


# head sizes: 128 and 64 (the AVX-512 path, 8 and 4 chunks of 16; with AVX2, 16 and 8 chunks of 8),
# 24 (the scalar path with AVX-512, AVX2's with 3 chunks), 20 (the scalar path); groups of 6 and 7
# query heads per KV head (the 1.5B and 0.5B Qwen models: values in tiles of 6 heads by 4 chunks,
# and 7 by 4; with AVX2 6 by 2 and 7 by 2), 8 (tiles of 8 by 2; 7 and 1 by 2) and 10 (8 and 2, by 2;
# 7 and 3 by 2)
SHAPES = [(12, 2, 128), (14, 2, 64), (16, 2, 128), (20, 2, 64), (4, 2, 24), (4, 2, 20)]


@pytest.mark.parametrize("heads,kv_heads,d", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_a_float64_reference(heads, kv_heads, d, dtype):
    case = _case(heads, kv_heads, d, dtype)
    torch.testing.assert_close(_attend(*case).double(), _reference(*case), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("heads,kv_heads,d", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_bitwise_the_same_alone_or_shared(heads, kv_heads, d, dtype):
    q, k_cache, v_cache, table, row_seq, row_len = _case(heads, kv_heads, d, dtype)
    together = _attend(q, k_cache, v_cache, table, row_seq, row_len)
    for t in range(q.shape[0]):
        alone = _attend(q[t : t + 1], k_cache, v_cache, table, row_seq[t : t + 1], row_len[t : t + 1])
        assert torch.equal(alone[0], together[t]), f"row {t} differs alone"
    # one sequence's rows without the others, and in a different order of sequences
    order = torch.argsort(row_seq, descending=True, stable=True)
    shuffled = _attend(q[order].contiguous(), k_cache, v_cache, table, row_seq[order], row_len[order])
    assert torch.equal(shuffled, together[order])


@pytest.mark.parametrize("rowwise", [True, False])
def test_a_sliding_window_sees_the_sinks_and_the_last_keys(rowwise):
    """``window``: each row attends to the first SINK_TOKENS positions and the `window` up to its own
    (a drafter's draft_context_window), in both attention paths, for decodes, a verified window, a
    long run the window cuts row by row and a sequence shorter than the window."""
    import numpy as np

    from dynaspec.models.attention import SINK_TOKENS, build_attention_metadata, paged_attention

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, d, block, window = 4, 2, 64, 8, 8
    q_lens, ctx_lens = [1, 3, 20, 2], [30, 50, 70, 5]
    tables = [[i * 10 + j for j in range(10)] for i in range(len(q_lens))]
    k_cache, v_cache = (torch.randn(400, kv_heads, d, generator=gen) for _ in range(2))
    n = sum(q_lens)
    q = torch.randn(n, heads, d, generator=gen)
    k, v = (torch.randn(n, kv_heads, d, generator=gen) for _ in range(2))
    meta = build_attention_metadata(q_lens, ctx_lens, tables, block, torch.device("cpu"), rowwise, window)
    out = paged_attention(q, k, v, k_cache, v_cache, meta)  # writes the new K/V, then attends
    row, group = 0, heads // kv_heads
    for q_len, c, table in zip(q_lens, ctx_lens, tables):
        slots = np.asarray(table)[np.arange(c) // block] * block + np.arange(c) % block
        for p in range(c - q_len, c):
            seen = [j for j in range(p + 1) if j < SINK_TOKENS or j > p - window]
            keys = k_cache[slots[seen]].repeat_interleave(group, 1).double()
            values = v_cache[slots[seen]].repeat_interleave(group, 1).double()
            scores = torch.einsum("hd,khd->hk", q[row].double(), keys) * d**-0.5
            expected = torch.einsum("hk,khd->hd", scores.softmax(-1), values)
            torch.testing.assert_close(out[row].double(), expected, atol=1e-5, rtol=1e-5)
            row += 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_leaves_the_cache_as_index_copy_does(dtype):
    g = torch.Generator().manual_seed(5)
    n, kv_heads, d = 5, 2, 64
    qkv = torch.randn(n, 4 * kv_heads * d, generator=g) * 300  # k and v as the projection's views
    qkv[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40])  # odd values round too
    k = qkv[:, kv_heads * d : 2 * kv_heads * d].reshape(n, kv_heads, d)
    v = qkv[:, 3 * kv_heads * d :].reshape(n, kv_heads, d)
    qkv[:, kv_heads * d :].view(n, -1)[0, 1] = float("nan")
    slots = torch.tensor([9, 0, 4, 31, 12])
    fused = (
        torch.randn(32, kv_heads, d, generator=g).to(dtype),
        torch.randn(32, kv_heads, d, generator=g).to(dtype),
    )
    reference = fused[0].clone(), fused[1].clone()
    torch.ops.dynaspec.kv_write_(fused[0], fused[1], k, v, slots)
    reference[0].index_copy_(0, slots, k.to(dtype))
    reference[1].index_copy_(0, slots, v.to(dtype))
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for a, b in zip(fused, reference):
        assert torch.equal(a.isnan(), b.isnan())  # a NaN stays a NaN (torch's own bf16 NaN bits vary)
        a, b = a.masked_fill(a.isnan(), 0), b.masked_fill(b.isnan(), 0)
        assert torch.equal(a.view(bits), b.view(bits))  # bitwise elsewhere; other slots untouched
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.dynaspec.kv_write_(fused[0], fused[1], k, v, torch.tensor([1, 2, 3, 4, 32]))
