"""models/fused_ops.py: each torch twin against dynaspec's reference code (CPU float32, always), each
Triton kernel against its twin (CUDA, else the CPU under TRITON_INTERPRET=1 where triton is installed,
else skipped), and each kernel captured in a CUDA graph (CUDA only)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from dynaspec.models.attention import build_attention_metadata
from dynaspec.models.attention import paged_attention as reference_attention
from dynaspec.models.llama import RMSNorm, _rotate

_MODULE = "dynaspec.models.fused_ops"
_CUDA = torch.cuda.is_available()


def _load_fused_ops():
    """fused_ops, its kernels built for the interpreter when there is no GPU. TRITON_INTERPRET counts
    when the kernels are defined, so only when this is the module's first import; it is set for that
    import only."""
    if _CUDA or _MODULE in sys.modules:
        return importlib.import_module(_MODULE)
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return importlib.import_module(_MODULE)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


fo = _load_fused_ops()


def _kernel_mode() -> str | None:
    """'cuda' or 'interpret': the kernel tests run here; 'subprocess': the module was imported before
    TRITON_INTERPRET could be set, so they run in a fresh interpreter; None: no triton."""
    if fo.triton is None:
        return None
    if _CUDA:
        return "cuda"
    return "interpret" if fo._INTERPRET else "subprocess"


_MODE = _kernel_mode()
_DEVICE = "cuda" if _CUDA else "cpu"
needs_kernels = pytest.mark.skipif(
    _MODE not in ("cuda", "interpret"),
    reason="triton is not installed" if _MODE is None else "kernels run in a fresh interpreter",
)
needs_cuda = pytest.mark.skipif(not _CUDA, reason="needs CUDA")


@pytest.fixture
def invariant(monkeypatch):
    """fused_ops.BATCH_INVARIANT on for the test."""
    monkeypatch.setattr(fo, "BATCH_INVARIANT", True)


DTYPES = [torch.float32, torch.bfloat16]


def _same_rows(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Bitwise equal on CUDA (the kernels' rows do not depend on each other); close elsewhere (the
    interpreter's tl.dot is numpy's matmul, whose result for a row can depend on its place)."""
    if _CUDA:
        assert torch.equal(actual, expected)
    else:
        _close(actual, expected, dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal up to rounding: float32 to ~1e-5; bfloat16 to an ulp or two (the twin and the kernel
    round sums in different orders)."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------------
# twins against the reference code (CPU float32, no triton)


def test_rms_norm_twin_matches_llama():
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x, residual = torch.randn(5, 96), torch.randn(5, 96)
    with torch.no_grad():
        _close(fo.rms_norm_twin(x, norm.weight, norm.eps), norm(x), torch.float32)
        total, normed = fo.add_rms_norm_twin(x, residual, norm.weight, norm.eps)
        ref_total, ref_normed = norm.add_forward(x, residual)
    torch.testing.assert_close(total, ref_total, atol=0, rtol=0)
    _close(normed, ref_normed, torch.float32)


def test_silu_mul_twin_matches_llama():
    torch.manual_seed(0)
    gate_up = torch.randn(4, 2 * 40)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(fo.silu_mul_twin(gate_up), gate * torch.sigmoid(gate) * up, torch.float32)
    _close(fo.silu_mul_twin(gate_up), F.silu(gate) * up, torch.float32)


def test_rope_write_kv_twin_matches_llama():
    torch.manual_seed(0)
    q, k, v, cos, sin, slots = _rope_inputs(n=5, hq=4, hk=2, d=16, dtype=torch.float32, device="cpu")
    k_cache, v_cache = torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    q_rot, k_rot = fo.rope_write_kv_twin(q, k, v, cos, sin, k_cache, v_cache, slots)
    cos3, sin3 = cos[:, None], sin[:, None]  # llama.py's RotaryEmbedding layout [n, 1, d]
    torch.testing.assert_close(q_rot, _rotate(q, cos3, sin3), atol=0, rtol=0)
    torch.testing.assert_close(k_rot, _rotate(k, cos3, sin3), atol=0, rtol=0)
    written = slots >= 0
    torch.testing.assert_close(k_cache[slots[written]], k_rot[written], atol=0, rtol=0)
    torch.testing.assert_close(v_cache[slots[written]], v[written], atol=0, rtol=0)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[slots[written]] = False
    assert untouched.sum() == 12 - int(written.sum())  # the -1 slot wrote nothing
    torch.testing.assert_close(k_cache[untouched], before_k[untouched], atol=0, rtol=0)
    torch.testing.assert_close(v_cache[untouched], before_v[untouched], atol=0, rtol=0)


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("query_len", [1, 4])
def test_paged_attention_twin_matches_attention(query_len, window):
    torch.manual_seed(0)
    hq, hk, d, block_size = 6, 2, 16, 4
    ctx_lens = [13, 5, 22]  # not multiples of block_size
    case = _attention_case(3, query_len, ctx_lens, hq, hk, d, block_size, torch.float32, "cpu")
    q, k_cache, v_cache, block_table, seq_lens, tables = case
    meta = build_attention_metadata(
        [query_len] * 3, ctx_lens, tables, block_size, torch.device("cpu"), window=window
    )
    # the new tokens' K/V are already in the cache: rewriting them leaves it as it is
    k_new, v_new = k_cache[meta.slot_mapping], v_cache[meta.slot_mapping]
    expected = reference_attention(q, k_new, v_new, k_cache, v_cache, meta)
    actual = fo.paged_attention_twin(
        q, k_cache, v_cache, block_table, seq_lens, query_len, block_size, d**-0.5, window, 4
    )
    _close(actual, expected, torch.float32)


def test_paged_attention_twin_padded_rows_are_finite():
    """Rows before a sequence's start (seq_len < query_len, or a padded sequence of length 0) attend
    to key 0; cache rows past a sequence's end may hold anything, NaN included."""
    torch.manual_seed(0)
    q, k_cache, v_cache, block_table, seq_lens, _ = _attention_case(
        2, 4, [2, 9], 4, 2, 8, 4, torch.float32, "cpu"
    )
    past_end = block_table[1, -1].long() * 4  # sequence 1's spare block: positions 12..15, past its 9
    k_cache[past_end : past_end + 4] = float("nan")
    v_cache[past_end : past_end + 4] = float("nan")
    seq_lens[0] = 0
    out = fo.paged_attention_twin(q, k_cache, v_cache, block_table, seq_lens, 4, 4, 8**-0.5)
    assert torch.isfinite(out).all()
    key0 = block_table[0, 0].long() * 4
    expected = v_cache[key0].repeat_interleave(2, dim=0)  # [hq, d]: each query head's KV head
    torch.testing.assert_close(out[0], expected)


# ---------------------------------------------------------------------------------------------------
# kernels against their twins


@needs_kernels
@pytest.mark.parametrize("d", [64, 896])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_kernel(dtype, d):
    torch.manual_seed(0)
    x = torch.randn(3, d, dtype=dtype, device=_DEVICE)
    residual = torch.randn(3, d, dtype=dtype, device=_DEVICE)
    weight = torch.randn(d, device=_DEVICE)
    _close(fo.rms_norm(x, weight, 1e-6), fo.rms_norm_twin(x, weight, 1e-6), dtype)
    total, normed = fo.add_rms_norm(x, residual, weight, 1e-6)
    ref_total, ref_normed = fo.add_rms_norm_twin(x, residual, weight, 1e-6)
    assert total.dtype == normed.dtype == dtype
    _close(total, ref_total, dtype)
    _close(normed, ref_normed, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_kernel(dtype):
    torch.manual_seed(0)
    gate_up = torch.randn(3, 2 * 100, dtype=dtype, device=_DEVICE)
    out = fo.silu_mul(gate_up)
    assert out.shape == (3, 100) and out.dtype == dtype
    _close(out, fo.silu_mul_twin(gate_up), dtype)


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [None, torch.float32])
@pytest.mark.parametrize(("hq", "hk", "d"), [(14, 2, 64), (12, 2, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv_kernel(dtype, hq, hk, d, cache_dtype):
    torch.manual_seed(0)
    cache_dtype = cache_dtype or dtype
    q, k, v, cos, sin, slots = _rope_inputs(5, hq, hk, d, dtype, _DEVICE)
    caches = [torch.randn(12, hk, d, device=_DEVICE).to(cache_dtype) for _ in range(2)]
    twin_caches = [c.clone() for c in caches]
    q_rot, k_rot = fo.rope_write_kv(q, k, v, cos, sin, *caches, slots)
    ref_q, ref_k = fo.rope_write_kv_twin(q, k, v, cos, sin, *twin_caches, slots)
    assert q_rot.is_contiguous() and q_rot.dtype == dtype and k_rot.dtype == dtype
    _close(q_rot, ref_q, dtype)
    _close(k_rot, ref_k, dtype)
    _close(caches[0], twin_caches[0], dtype)
    torch.testing.assert_close(caches[1], twin_caches[1], atol=0, rtol=0)


# (b, query_len, context lengths, hq, hk, head dim, window, splits): 0.5B, 1.5B and 7B head layouts; a
# sequence shorter than query_len has padded rows; None splits: chosen from the shapes
ATTENTION_CASES = [
    (1, 1, [45], 14, 2, 64, None, None),
    (3, 1, [37, 1, 21], 28, 4, 128, None, 3),
    (3, 4, [37, 2, 21], 14, 2, 64, None, 2),
    (3, 4, [37, 2, 50], 12, 2, 128, 8, None),
    (1, 1, [45], 14, 2, 64, 8, 1),
    (2, 3, [300, 5], 14, 2, 64, None, None),  # a capacity of 320 keys: two splits of 256
]


@needs_kernels
@pytest.mark.parametrize(("b", "query_len", "ctx_lens", "hq", "hk", "d", "window", "splits"), ATTENTION_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_kernel(dtype, b, query_len, ctx_lens, hq, hk, d, window, splits):
    torch.manual_seed(0)
    block_size = 16
    q, k_cache, v_cache, block_table, seq_lens, _ = _attention_case(
        b, query_len, ctx_lens, hq, hk, d, block_size, dtype, _DEVICE
    )
    args = (q, k_cache, v_cache, block_table, seq_lens, query_len, block_size, d**-0.5, window)
    out = fo.paged_attention(*args, num_splits=splits)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    _close(out, fo.paged_attention_twin(*args), dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_kernel_rows_do_not_depend_on_the_batch(dtype, invariant):
    """A query's output is bitwise the same alone (a plain step), as the first of a verify window
    and beside other sequences: the splits are cut at fixed key positions, 16 rows a tile."""
    torch.manual_seed(0)
    block_size, d = 16, 64
    q, k_cache, v_cache, block_table, _, _ = _attention_case(
        2, 4, [300, 290], 14, 2, d, block_size, dtype, _DEVICE
    )
    args = (k_cache, v_cache, block_table)
    # sequence 0 verifying positions 296..299 beside sequence 1 (its rows 0..3 of q)
    window = fo.paged_attention(
        q, *args, torch.tensor([300, 290], dtype=torch.int32, device=_DEVICE), 4, block_size, 0.125
    )
    # the same first query alone, as a plain step at position 296
    alone = fo.paged_attention(
        q[:1],
        *args[:2],
        block_table[:1],
        torch.tensor([297], dtype=torch.int32, device=_DEVICE),
        1,
        block_size,
        0.125,
    )
    _same_rows(window[:1], alone, dtype)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 6, 40])
@pytest.mark.parametrize("dtype", DTYPES)
def test_skinny_projection_kernel(dtype, rows, invariant):
    """linear (with and without a bias, into a given tensor) against its twin, and each row bitwise
    the same computed alone."""
    torch.manual_seed(0)
    k, n_out = 160, 200
    x = torch.randn(rows, k, device=_DEVICE).to(dtype)
    weight = (torch.randn(n_out, k, device=_DEVICE) * 0.1).to(dtype)
    bias = torch.randn(n_out, device=_DEVICE).to(dtype)
    assert fo.projection_config(x, weight, bias) is not None  # the kernel, not cuBLAS

    out = fo.linear(x, weight, bias)
    assert out.shape == (rows, n_out) and out.dtype == dtype
    _close(out, fo.linear_twin(x, weight, bias), dtype)
    _same_rows(fo.linear(x[-1:], weight, bias), out[-1:], dtype)

    written = torch.empty(rows, n_out, dtype=dtype, device=_DEVICE)
    assert fo.linear(x, weight, out=written).data_ptr() == written.data_ptr()
    _close(written, fo.linear_twin(x, weight), dtype)


@needs_kernels
def test_skinny_kernel_takes_few_rows_only_when_batch_invariant(monkeypatch):
    x = torch.randn(fo.SKINNY_MAX_ROWS + 1, 32, device=_DEVICE)
    weight = torch.randn(48, 32, device=_DEVICE)
    assert fo.projection_config(x[:1], weight) is None  # off by default: cuBLAS
    monkeypatch.setattr(fo, "BATCH_INVARIANT", True)
    assert fo.projection_config(x[:1], weight) == fo.projection_config(x[:-1], weight) is not None
    assert fo.projection_config(x, weight) is None
    assert fo.projection_config(x[:1], weight.bfloat16()) is None
    assert torch.equal(fo.linear(x, weight), F.linear(x, weight))  # beyond the rows: the twin


@needs_kernels
def test_kernel_dispatch_runs_what_timed_fastest(monkeypatch):
    """SKINNY_DISPATCH: each (shape, row bucket) runs the candidate its timing put first, decided once;
    a call that cannot time (inside a capture; no GPU) runs cuBLAS and decides later."""
    torch.manual_seed(0)
    x = torch.randn(6, 64, device=_DEVICE)
    weight = torch.randn(80, 64, device=_DEVICE) * 0.1
    config = (16, 64, 4, 3)
    timed = []

    def fake_fastest(candidates, key, rows, w, bias, default):
        timed.append((key[:2], rows, candidates))
        return config if key[0] == 80 else None  # cuBLAS fastest for the other shape

    monkeypatch.setattr(fo, "SKINNY_DISPATCH", True)
    monkeypatch.setattr(fo, "_DISPATCH_CHOSEN", {})
    monkeypatch.setattr(fo, "_fastest", fake_fastest)
    monkeypatch.setattr(fo, "_can_time", lambda device: False)
    assert fo.projection_config(x, weight) is None and not timed  # cannot time: cuBLAS, not kept
    monkeypatch.setattr(fo, "_can_time", lambda device: True)
    assert fo.projection_config(x, weight) == config
    assert timed == [((80, 64), 8, [None, *fo._skinny_candidates(80, 64, x.device)])]  # 6 rows: bucket 8
    _close(fo.linear(x, weight), fo.linear_twin(x, weight), torch.float32)
    fo.linear(x[:5], weight)  # the same bucket: decided already
    assert len(timed) == 1
    assert fo.projection_config(x[:1], weight) == config and len(timed) == 2  # bucket 1: its own timing
    other = torch.randn(48, 64, device=_DEVICE)
    assert fo.projection_config(x, other) is None  # cuBLAS timed fastest for this shape
    assert torch.equal(fo.linear(x, other), F.linear(x, other))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_top1_kernel(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(3, 5000, device=_DEVICE) * 3).to(dtype)
    logits[1, 4321] = 40.0  # one certain row
    ids, prob = fo.top1(logits)
    ref_ids, ref_prob = fo.top1_twin(logits)
    assert ids.dtype == torch.int64 and prob.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(prob, ref_prob, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(_MODE != "subprocess", reason="the kernel tests ran in this process, or cannot run")
def test_kernels_in_interpreter_subprocess():
    """The kernel tests above, in a fresh interpreter with TRITON_INTERPRET=1 from its start (~20 s)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    done = subprocess.run([*args, "-k", "kernel and not subprocess"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " skipped" not in done.stdout, done.stdout[-2000:]


# ---------------------------------------------------------------------------------------------------
# CUDA graphs


@needs_cuda
@pytest.mark.skipif(fo.triton is None, reason="triton is not installed")
def test_each_op_replays_in_cuda_graph(invariant):
    torch.manual_seed(0)
    dtype, dev = torch.bfloat16, "cuda"
    x, residual = torch.randn(4, 256, dtype=dtype, device=dev), torch.randn(4, 256, dtype=dtype, device=dev)
    weight = torch.randn(256, device=dev)
    gate_up = torch.randn(4, 2 * 300, dtype=dtype, device=dev)
    q, k, v, cos, sin, slots = _rope_inputs(4, 14, 2, 64, dtype, dev)
    k_cache, v_cache = (torch.zeros(64, 2, 64, dtype=dtype, device=dev) for _ in range(2))
    qa, ka, va, block_table, seq_lens, _ = _attention_case(2, 3, [20, 40], 14, 2, 64, 16, dtype, dev)
    proj = (torch.randn(300, 256, device=dev) * 0.1).to(dtype)
    down = (torch.randn(256, 300, device=dev) * 0.1).to(dtype)
    bias = torch.randn(256, device=dev).to(dtype)
    logits = torch.randn(4, 3000, dtype=dtype, device=dev)

    graphs = {
        "rms_norm": fo.capture_graph(lambda: fo.rms_norm(x, weight, 1e-6)),
        "add_rms_norm": fo.capture_graph(lambda: fo.add_rms_norm(x, residual, weight, 1e-6)),
        "silu_mul": fo.capture_graph(lambda: fo.silu_mul(gate_up)),
        "rope_write_kv": fo.capture_graph(
            lambda: fo.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
        ),
        "paged_attention": fo.capture_graph(
            lambda: fo.paged_attention(qa, ka, va, block_table, seq_lens, 3, 16, 64**-0.5, window=16)
        ),
        "paged_attention_splits": fo.capture_graph(
            lambda: fo.paged_attention(qa, ka, va, block_table, seq_lens, 3, 16, 64**-0.5, num_splits=3)
        ),
        "linear": fo.capture_graph(lambda: fo.linear(x, proj)),
        "linear_bias": fo.capture_graph(lambda: fo.linear(gate_up[:, :300], down, bias)),
        "top1": fo.capture_graph(lambda: fo.top1(logits)),
    }
    # new inputs in the same buffers, then replays without a host sync
    for t in (x, residual, gate_up, q, k, v, qa, logits):
        t.copy_(torch.randn_like(t))
    slots.copy_(torch.tensor([5, -1, 9, 60], device=dev))
    seq_lens.copy_(torch.tensor([33, 2], dtype=torch.int32, device=dev))
    k_cache.zero_()
    v_cache.zero_()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for graph, _ in graphs.values():
            graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()

    _close(graphs["rms_norm"][1], fo.rms_norm_twin(x, weight, 1e-6), dtype)
    for out, ref in zip(graphs["add_rms_norm"][1], fo.add_rms_norm_twin(x, residual, weight, 1e-6)):
        _close(out, ref, dtype)
    _close(graphs["silu_mul"][1], fo.silu_mul_twin(gate_up), dtype)
    twin_k, twin_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    ref_q, _ = fo.rope_write_kv_twin(q, k, v, cos, sin, twin_k, twin_v, slots)
    _close(graphs["rope_write_kv"][1][0], ref_q, dtype)
    _close(k_cache, twin_k, dtype)
    _close(v_cache, twin_v, dtype)
    ref = fo.paged_attention_twin(qa, ka, va, block_table, seq_lens, 3, 16, 64**-0.5, window=16)
    _close(graphs["paged_attention"][1], ref, dtype)
    ref = fo.paged_attention_twin(qa, ka, va, block_table, seq_lens, 3, 16, 64**-0.5)
    _close(graphs["paged_attention_splits"][1], ref, dtype)
    _close(graphs["linear"][1], fo.linear_twin(x, proj), dtype)
    _close(graphs["linear_bias"][1], fo.linear_twin(gate_up[:, :300], down, bias), dtype)
    assert torch.equal(graphs["top1"][1][0], fo.top1_twin(logits)[0])


@needs_cuda
@pytest.mark.skipif(fo.triton is None, reason="triton is not installed")
def test_dispatch_times_on_the_device(monkeypatch):
    """SKINNY_DISPATCH on the GPU: each shape and row bucket timed once (cuBLAS among the candidates,
    over weight copies larger than L2), the choice then captured and replayed like any op."""
    torch.manual_seed(0)
    dtype, dev = torch.bfloat16, "cuda"
    monkeypatch.setattr(fo, "SKINNY_DISPATCH", True)
    monkeypatch.setattr(fo, "_DISPATCH_CHOSEN", {})
    monkeypatch.setattr(fo, "TUNING_RECORD", [])
    weight = (torch.randn(640, 896, device=dev) * 0.05).to(dtype)
    bias = torch.randn(640, device=dev).to(dtype)
    copies = fo._weight_copies(weight)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    assert len(copies) == 64 or len(copies) * weight.numel() * weight.element_size() >= 2 * l2
    for rows in (1, 6):
        x = torch.randn(rows, 896, device=dev).to(dtype)
        _close(fo.linear(x, weight, bias), fo.linear_twin(x, weight, bias), dtype)
        graph, out = fo.capture_graph(lambda x=x: fo.linear(x, weight, bias))
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        _close(out, fo.linear_twin(x, weight, bias), dtype)
    assert [(r["rows"], r["out"], r["in"]) for r in fo.TUNING_RECORD] == [(1, 640, 896), (8, 640, 896)]
    assert all("cublas" in r["us"] and r["chosen"] in r["us"] for r in fo.TUNING_RECORD)


# ---------------------------------------------------------------------------------------------------
# inputs


def _rope_inputs(n, hq, hk, d, dtype, device):
    """q, k, v as views into one qkv projection output (strided), cos/sin of positions 0..n-1 in the
    rotate-half layout, and slots with one -1 (a padded token)."""
    qkv = torch.randn(n, (hq + 2 * hk) * d, device=device).to(dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(n, hq, d), k.view(n, hk, d), v.view(n, hk, d)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device).float() / d))
    freqs = torch.arange(n, device=device).float()[:, None] * inv_freq[None, :] + 3.0
    emb = torch.cat((freqs, freqs), dim=-1)  # [n, d]
    slots = torch.tensor([3, -1, 0, 7, 5][:n] + list(range(8, 8 + max(0, n - 5))), device=device)
    return q, k, v, emb.cos(), emb.sin(), slots


def _attention_case(b, query_len, ctx_lens, hq, hk, d, block_size, dtype, device):
    """Random queries and a cache in which each sequence's blocks are shuffled, with spare slots.
    Returns (q [b * query_len, hq, d], k_cache, v_cache, block_table [b, max_blocks] int32,
    seq_lens [b] int32, the block tables as lists)."""
    max_blocks = max(-(-c // block_size) for c in ctx_lens) + 1
    num_blocks = b * max_blocks + 2
    order = torch.randperm(num_blocks)[: b * max_blocks].view(b, max_blocks)
    tables = [order[i, : -(-c // block_size)].tolist() for i, c in enumerate(ctx_lens)]
    block_table = order.to(torch.int32).to(device)
    k_cache = torch.randn(num_blocks * block_size, hk, d, device=device).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, hk, d, device=device).to(dtype)
    q = torch.randn(b * query_len, hq, d, device=device).to(dtype)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_table, seq_lens, tables
