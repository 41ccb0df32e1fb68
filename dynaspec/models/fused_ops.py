"""Fused operators for the CUDA decode path: Triton kernels, each with a torch twin.

Each public function runs its Triton kernel when the tensors are on CUDA and triton imports (or, for
tests on the CPU, when this module was imported with ``TRITON_INTERPRET=1`` set), else its twin: the
same maths in plain torch ops, which is also the reference the kernels are tested against
(``<name>_twin``). The kernels take every grid size from shapes and never copy to the host, so a
CUDA graph can capture them.

- ``rms_norm`` / ``add_rms_norm``: RMSNorm (after a residual add) in float32, one program per row.
- ``silu_mul``: silu(gate) * up from the fused gate/up projection.
- ``rope_write_kv``: rotate-half RoPE of q and k, and the store of k and v into the paged cache by
  slot (a slot of -1 writes nothing: padding).
- ``paged_attention``: decode/verify attention over a block table (flash-decoding: each program
  reads a split of one sequence's keys once for all its query rows and all query heads of a KV head,
  a second kernel merges the splits).
- ``linear``: a projection of few rows as one weight-streaming kernel (the skinny kernel), where
  batch invariance asks for it or where it beats cuBLAS on the device (``SKINNY_DISPATCH``);
  cuBLAS otherwise.
- ``top1``: each row's most likely token and its probability (softmax max) in two small kernels.
- ``capture_graph``: a function warmed up, then recorded as a CUDA graph (the engine's fixed-shape
  passes, the projections' timing, the tests).

``BATCH_INVARIANT`` (off by default; ``EngineConfig.batch_invariant`` sets it for the process):
each row's result is then bitwise the same whatever the rows beside it, so a verify pass of K + 1
rows a request computes a plain step's numbers and greedy speculation equals plain decoding in
bfloat16 too. Projections of up to ``SKINNY_MAX_ROWS`` rows run the skinny kernel in 16-row tiles
with a reduction order fixed by the shape (off: cuBLAS, whose kernel choice follows the rows), and
attention cuts its key splits at fixed positions (from the block table's capacity) and its rows
into 16-row tiles (off: splits that fill the GPU for the batch at hand, one tile for all rows).
On the H200 it cost a 7B step at batch 1 about 2.3x (results/README.md, the GPU section) while the
RMSNorm and the SiLU-mul ran inside the skinny kernel, far below cuBLAS's speed; they are now the
same row-wise kernels as elsewhere, in front of the plain projection (not yet measured on a GPU).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

log = logging.getLogger(__name__)

# kernels were built for the interpreter (CPU tensors): TRITON_INTERPRET is read when they are defined
_INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET", "0") == "1"
# keys a paged-attention program handles per step of its loop
_ATTN_BLOCK_N = 64
# the most key splits of one (sequence, KV head)
_ATTN_MAX_SPLITS = 64
# SMs assumed when the device does not say (the interpreter): an H100's
_DEFAULT_SMS = 132
# keys a split holds at least (splits are cut from the block table's capacity, not the lengths)
_ATTN_SPLIT_KEYS = 256
# rows a skinny projection's tile holds: every row goes through the same 16-row MMA, so a row's
# result is the same whatever the other rows
_SKINNY_BLOCK_M = 16
# the most rows ``linear`` and its fused forms give their kernel when BATCH_INVARIANT is on (more:
# the twin, i.e. cuBLAS)
SKINNY_MAX_ROWS = 64
# rows and splits that do not depend on the batch (see the module's docstring); process-wide
BATCH_INVARIANT = False
# projections of few rows outside batch-invariant mode run the fastest of cuBLAS and the skinny
# kernel for their shape, timed on the device (``projection_config``); off until a GPU run has
# measured it (benchmarks/gpu_bench.py, the invariant stage's "dispatch" variant)
SKINNY_DISPATCH = False
# (BLOCK_N, BLOCK_K, warps, stages) for every batch-invariant projection instead of
# ``_skinny_config``'s (benchmarks)
SKINNY_CONFIG: tuple[int, int, int, int] | None = None
# vocabulary entries a ``top1`` program scans
_TOP1_BLOCK = 2048


def capture_graph(fn: Callable[[], object], pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """``fn`` warmed up on a side stream (its kernels compile there), then recorded as a CUDA graph:
    (the graph, the outputs of the recorded call, which every replay rewrites)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def triton_enabled(x: torch.Tensor) -> bool:
    """Whether the public functions run their Triton kernel for tensors like ``x``."""
    return triton is not None and (x.is_cuda or _INTERPRET)


# ---------------------------------------------------------------------------------------------------
# RMSNorm (+ residual)


def rms_norm(
    x: torch.Tensor,  # [n, d] bfloat16, float16 or float32
    weight: torch.Tensor,  # [d]
    eps: float,
) -> torch.Tensor:  # [n, d] x.dtype
    if not triton_enabled(x):
        return rms_norm_twin(x, weight, eps)
    return _norm_launch(x, None, weight, eps)[1]


def add_rms_norm(
    x: torch.Tensor,  # [n, d]
    residual: torch.Tensor,  # [n, d]
    weight: torch.Tensor,  # [d]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (x + residual, rms_norm(x + residual)): [n, d] x.dtype each
    if not triton_enabled(x):
        return add_rms_norm_twin(x, residual, weight, eps)
    return _norm_launch(x, residual, weight, eps)


def rms_norm_twin(
    x: torch.Tensor,  # [n, d]
    weight: torch.Tensor,  # [d]
    eps: float,
) -> torch.Tensor:  # [n, d] x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x32).to(x.dtype)


def add_rms_norm_twin(
    x: torch.Tensor,  # [n, d]
    residual: torch.Tensor,  # [n, d]
    weight: torch.Tensor,  # [d]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [n, d] each
    total = x + residual
    return total, rms_norm_twin(total, weight, eps)


def _norm_launch(
    x: torch.Tensor,  # [n, d]
    residual: torch.Tensor | None,  # [n, d]
    weight: torch.Tensor,  # [d]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (the sum, or x when no residual; the norm): [n, d]
    d = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        total, res2 = x, x2
    else:
        total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        res2 = _rows(residual)
    n = x2.shape[0]
    if n > 0:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(n,)](
            x2,
            res2,
            weight,
            total,
            out,
            x2.stride(0),
            res2.stride(0),
            d,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_D=block,
            num_warps=min(16, max(1, block // 256)),
        )
    return total, out


def _rows(x: torch.Tensor) -> torch.Tensor:  # [rows, d] with a unit stride along d
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


# ---------------------------------------------------------------------------------------------------
# SiLU-mul


def silu_mul(
    gate_up: torch.Tensor,  # [n, 2 * i]
) -> torch.Tensor:  # [n, i] gate_up.dtype: silu(gate) * up
    if not triton_enabled(gate_up):
        return silu_mul_twin(gate_up)
    x2 = _rows(gate_up)
    n, inter = x2.shape[0], x2.shape[1] // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    if n > 0:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](x2, out, x2.stride(0), inter, BLOCK=block)
    return out


def silu_mul_twin(
    gate_up: torch.Tensor,  # [n, 2 * i]
) -> torch.Tensor:  # [n, i]
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


# ---------------------------------------------------------------------------------------------------
# RoPE + KV cache write


def rope_write_kv(
    q: torch.Tensor,  # [n, hq, d] (a view into the qkv projection's output is fine)
    k: torch.Tensor,  # [n, hk, d]
    v: torch.Tensor,  # [n, hk, d]
    cos: torch.Tensor,  # [n, d] float32 (or [n, 1, d]), rotate-half layout: cat(freqs, freqs)
    sin: torch.Tensor,  # [n, d] float32 (or [n, 1, d])
    k_cache: torch.Tensor,  # [num_slots, hk, d] written at slots
    v_cache: torch.Tensor,  # [num_slots, hk, d] written at slots
    slots: torch.Tensor,  # [n] int64 cache slot of each token; -1: not written
) -> tuple[torch.Tensor, torch.Tensor]:  # (q rotated [n, hq, d] q.dtype, k rotated [n, hk, d] k.dtype)
    """Rotate q and k and store k and v into the caches at ``slots`` (cast to the caches' dtype).
    Returns the rotated q, and the rotated k [n, hk, d] in k.dtype, contiguous (every row, written or
    not)."""
    if not triton_enabled(q):
        return rope_write_kv_twin(q, k, v, cos, sin, k_cache, v_cache, slots)
    n, hq, d = q.shape
    hk = k.shape[1]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cos, sin = _rows(cos.reshape(n, d)), _rows(sin.reshape(n, d))
    q_out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((n, hk, d), dtype=k.dtype, device=k.device)
    if n > 0:
        _rope_kv_kernel[(n, hq + hk)](
            q,
            k,
            v,
            cos,
            sin,
            k_cache,
            v_cache,
            slots,
            q_out,
            k_out,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            cos.stride(0),
            sin.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            v_cache.stride(0),
            v_cache.stride(1),
            hq,
            hk,
            d // 2,
            BLOCK_HALF=triton.next_power_of_2(d // 2),
        )
    return q_out, k_out


def rope_write_kv_twin(
    q: torch.Tensor,  # [n, hq, d]
    k: torch.Tensor,  # [n, hk, d]
    v: torch.Tensor,  # [n, hk, d]
    cos: torch.Tensor,  # [n, d] float32 (or [n, 1, d])
    sin: torch.Tensor,  # [n, d] float32 (or [n, 1, d])
    k_cache: torch.Tensor,  # [num_slots, hk, d]
    v_cache: torch.Tensor,  # [num_slots, hk, d]
    slots: torch.Tensor,  # [n] int64; -1: not written
) -> tuple[torch.Tensor, torch.Tensor]:  # (q rotated [n, hq, d] contiguous, k rotated [n, hk, d])
    """The twin selects the written rows with a boolean mask: a host sync on CUDA (the kernel has none)."""
    n, _, d = q.shape
    cos, sin = cos.reshape(n, 1, d), sin.reshape(n, 1, d)
    q_rot = _rotate(q, cos, sin).contiguous()
    k_rot = _rotate(k, cos, sin)
    keep = slots >= 0
    written = slots[keep]
    k_cache.index_copy_(0, written, k_rot[keep].to(k_cache.dtype))
    v_cache.index_copy_(0, written, v[keep].to(v_cache.dtype))
    return q_rot, k_rot


def _rotate(
    x: torch.Tensor,  # [n, heads, d]
    cos: torch.Tensor,  # [n, 1, d]
    sin: torch.Tensor,  # [n, 1, d]
) -> torch.Tensor:  # [n, heads, d] x.dtype
    """llama.py's ``_rotate``: rotate-half in float32."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


# ---------------------------------------------------------------------------------------------------
# Paged decode/verify attention


def paged_attention(
    q: torch.Tensor,  # [b * query_len, hq, d]: rows i * query_len + j, j < query_len, are sequence i's
    k_cache: torch.Tensor,  # [num_slots, hk, d]
    v_cache: torch.Tensor,  # [num_slots, hk, d]
    block_table: torch.Tensor,  # [b, max_blocks] int32 cache block ids (slot = block * block_size + offset)
    seq_lens: torch.Tensor,  # [b] int32 context tokens of each sequence, its query_len new ones included
    query_len: int,
    block_size: int,
    scale: float,
    window: int | None = None,
    sink_tokens: int = 4,
    num_splits: int | None = None,
) -> torch.Tensor:  # [b * query_len, hq, d] q.dtype
    """Causal attention of each sequence's ``query_len`` new tokens (at positions seq_len - query_len
    + j) to its cached keys. With ``window`` a query at position p sees only the first
    ``sink_tokens`` positions and those above p - window. A row whose position is negative (padding)
    attends to key 0. ``num_splits`` fixes how many key splits the kernel uses (default: from the
    shapes, to fill the GPU); the twin ignores it."""
    if not triton_enabled(q):
        return paged_attention_twin(
            q, k_cache, v_cache, block_table, seq_lens, query_len, block_size, scale, window, sink_tokens
        )
    n, hq, d = q.shape
    hk = k_cache.shape[1]
    b = n // query_len
    assert b * query_len == n and hq % hk == 0, (q.shape, query_len, k_cache.shape)
    group = hq // hk
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    capacity = block_table.shape[1] * block_size
    invariant = BATCH_INVARIANT and window is None
    if num_splits is None:
        num_splits, split_keys = _attention_splits(b, hk, capacity, q.device, not invariant)
    else:
        split_keys = triton.cdiv(triton.cdiv(capacity, num_splits), _ATTN_BLOCK_N) * _ATTN_BLOCK_N
    block_m = _SKINNY_BLOCK_M if invariant else max(16, triton.next_power_of_2(query_len * group))
    row_tiles = triton.cdiv(query_len * group, block_m)
    block_d = triton.next_power_of_2(d)
    if num_splits > 1:
        mid_o = torch.empty((n, hq, num_splits, d), dtype=torch.float32, device=q.device)
        mid_ml = torch.empty((2, n, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_ml = out
    _paged_attention_kernel[(b, hk * row_tiles, num_splits)](
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        out,
        mid_o,
        mid_ml,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        block_table.stride(0),
        k_cache.shape[0],
        block_table.shape[1],
        query_len,
        group,
        hq,
        row_tiles,
        block_size,
        scale * 1.4426950408889634,  # log2(e): the kernel works in base 2
        window if window is not None else 0,
        sink_tokens,
        num_splits,
        split_keys,
        d,
        n * hq * num_splits,
        BLOCK_M=block_m,
        BLOCK_N=_ATTN_BLOCK_N,
        BLOCK_D=block_d,
        WINDOW=window is not None,
        FIXED_SPLITS=invariant,
        ONE_SPLIT=num_splits == 1,
        DOT_F32=q.dtype == torch.float32 or _INTERPRET,
        num_warps=4,
    )
    if num_splits > 1:
        _merge_splits_kernel[(n, hq)](
            mid_o,
            mid_ml,
            out,
            num_splits,
            d,
            n * hq * num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out


def paged_attention_twin(
    q: torch.Tensor,  # [b * query_len, hq, d]
    k_cache: torch.Tensor,  # [num_slots, hk, d]
    v_cache: torch.Tensor,  # [num_slots, hk, d]
    block_table: torch.Tensor,  # [b, max_blocks] int32
    seq_lens: torch.Tensor,  # [b] int32
    query_len: int,
    block_size: int,
    scale: float,
    window: int | None = None,
    sink_tokens: int = 4,
) -> torch.Tensor:  # [b * query_len, hq, d] q.dtype
    """Gathers every position the block table can hold (no host sync), attends in float32 with a
    mask: causal, the window's, and the sequence's end (cache rows past it may hold anything)."""
    n, hq, d = q.shape
    hk = k_cache.shape[1]
    b = n // query_len
    group = hq // hk
    table = block_table[:b].long()  # [b, max_blocks]
    ctx = table.shape[1] * block_size
    key = torch.arange(ctx, device=q.device)  # [ctx]
    slots = table[:, key // block_size] * block_size + key % block_size  # [b, ctx]
    slots = slots.clamp(0, k_cache.shape[0] - 1).reshape(-1)
    k = k_cache.index_select(0, slots).view(b, ctx, hk, d).permute(0, 2, 3, 1).float()  # [b, hk, d, ctx]
    v = v_cache.index_select(0, slots).view(b, ctx, hk, d).transpose(1, 2).float()  # [b, hk, ctx, d]
    lens = seq_lens[:b].long()[:, None]  # [b, 1]
    v = v.masked_fill((key >= lens.clamp(min=1))[:, None, :, None], 0.0)  # key 0 stays: padded rows
    # a window's positions past a row's drafts are not written (slot -1): on the CPU such a cache
    # row may hold NaN, which a zero weight would still spread (0 * NaN); make it finite
    v = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    pos = (lens - query_len + torch.arange(query_len, device=q.device)).clamp(min=0)  # [b, query_len]
    visible = key <= pos[..., None]  # [b, query_len, ctx]
    if window is not None:
        visible &= (key < sink_tokens) | (key > pos[..., None] - window)
    qf = q.float().view(b, query_len, hk, group, d).permute(0, 2, 3, 1, 4)  # [b, hk, group, query_len, d]
    scores = (qf.reshape(b, hk, group * query_len, d) @ k) * scale  # [b, hk, group * query_len, ctx]
    scores = scores.view(b, hk, group, query_len, ctx).masked_fill(~visible[:, None, None], float("-inf"))
    probs = scores.softmax(-1).view(b, hk, group * query_len, ctx)
    out = (probs @ v).view(b, hk, group, query_len, d).permute(0, 3, 1, 2, 4)  # [b, query_len, hk, group, d]
    return out.reshape(n, hq, d).to(q.dtype)


# ---------------------------------------------------------------------------------------------------
# Projections of few rows (decode, verify, a drafter's chain)


def _skinny_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the skinny kernel can take ``x`` [rows, in] against ``weight`` [out, in]."""
    rows = x.numel() // max(1, x.shape[-1])
    return (
        triton_enabled(x)
        and 0 < rows <= SKINNY_MAX_ROWS
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.dtype == x.dtype
        and weight.stride(-1) == 1
        and weight.device == x.device
    )


def projection_config(
    x: torch.Tensor,  # [rows, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None = None,
) -> tuple[int, int, int, int] | None:
    """The skinny kernel's config ``linear`` runs for this call, or None for cuBLAS (the twin).

    Batch invariant: the kernel for up to ``SKINNY_MAX_ROWS`` rows, its config chosen by the shape
    alone. Else, with ``SKINNY_DISPATCH`` on CUDA: whichever of cuBLAS and the kernel's configs
    replayed fastest for the shape and the rows (rounded up to a power of two), timed once, the
    first time such a call runs outside a capture (one captured before that gets cuBLAS)."""
    if not _skinny_fits(x, weight):
        return None
    out_features, k = weight.shape
    key = (out_features, k, bias is not None, x.dtype, x.device)
    if BATCH_INVARIANT:
        return _skinny_config(key, weight, bias)
    if not SKINNY_DISPATCH:
        return None
    rows = x.numel() // x.shape[-1]
    return _dispatch_config(key, triton.next_power_of_2(rows), weight, bias)


def linear(
    x: torch.Tensor,  # [n, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None = None,  # [out]
    out: torch.Tensor | None = None,  # [n, out] contiguous, x.dtype: written instead of a new tensor
) -> torch.Tensor:  # [n, out] x.dtype
    config = projection_config(x, weight, bias)
    if config is None:
        return linear_twin(x, weight, bias, out)
    return _skinny_launch(x, weight, bias, config, out)


def linear_twin(
    x: torch.Tensor,  # [n, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,  # [n, out] contiguous
) -> torch.Tensor:  # [n, out]
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None and x.dim() == 2:
        return torch.mm(x, weight.t(), out=out)
    return out.copy_(F.linear(x, weight, bias).view_as(out))


def _skinny_launch(
    x: torch.Tensor,  # [n, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None,  # [out]
    config: tuple[int, int, int, int],  # (BLOCK_N, BLOCK_K, warps, stages)
    out: torch.Tensor | None = None,  # [n, out] contiguous
) -> torch.Tensor:  # [n, out] (x's leading dimensions)
    shape = x.shape
    x2 = _rows(x)
    n, k = x2.shape[0], weight.shape[1]
    out_features = weight.shape[0]
    y = torch.empty(n, out_features, dtype=x.dtype, device=x.device) if out is None else out
    block_n, block_k, warps, stages = config
    row_tiles = triton.cdiv(n, _SKINNY_BLOCK_M)
    _skinny_kernel[(row_tiles * triton.cdiv(out_features, block_n),)](
        x2,
        weight,
        bias if bias is not None else weight,
        y,
        n,
        out_features,
        k,
        x2.stride(0),
        weight.stride(0),
        row_tiles,
        HAS_BIAS=bias is not None,
        BLOCK_M=_SKINNY_BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_F32=x.dtype == torch.float32 or _INTERPRET,
        num_warps=warps,
        num_stages=stages,
    )
    return y if len(shape) == 2 else y.view(*shape[:-1], out_features)


def _skinny_heuristic(out_features: int, k: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages): output tiles as wide as still give every SM two programs
    (16 at least), the reduction in chunks of 256 where it is long."""
    want = 2 * _sm_count(device)
    block_n = 16
    for candidate in (128, 64, 32):
        if triton.cdiv(out_features, candidate) >= want:
            block_n = candidate
            break
    block_k = 256 if k >= 2048 else 128
    return block_n, min(block_k, triton.next_power_of_2(k)), 4, 3


def _skinny_candidates(out_features: int, k: int, device: torch.device) -> list[tuple[int, int, int, int]]:
    """The heuristic's config, the other reduction chunk, narrower tiles with a deeper pipeline, and
    the narrowest tiles (the most programs: long reductions over few outputs, like a down
    projection, want them)."""
    block_n, block_k, warps, stages = _skinny_heuristic(out_features, k, device)
    other_k = min(384 - block_k, triton.next_power_of_2(k))
    out = [
        (block_n, block_k, warps, stages),
        (block_n, other_k, warps, stages),
        (max(16, block_n // 2), block_k, 4, 4),
        (16, min(256, triton.next_power_of_2(k)), 4, 4),
    ]
    return list(dict.fromkeys(out))


# (out, in, bias, dtype, device) -> the config a batch-invariant projection of that shape runs with
_SKINNY_CHOSEN: dict[tuple, tuple[int, int, int, int]] = {}
# (out, in, bias, dtype, device, rows) -> the dispatch's choice (None: cuBLAS)
_DISPATCH_CHOSEN: dict[tuple, tuple[int, int, int, int] | None] = {}
# every timing of candidates: {"out", "in", "rows", "bias", "dtype", "us": {candidate: us}, "chosen"}
TUNING_RECORD: list[dict] = []


def _skinny_config(
    key: tuple,  # (out, in, bias, dtype, device)
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[int, int, int, int]:
    """The batch-invariant projection's kernel config. On CUDA each shape's candidates are timed
    once (one row) the first time the shape runs outside a capture, and the fastest is kept for
    every later call, whatever its rows: the choice depends on the shape alone, never on the rows,
    so the reduction order (and each row's result) does not."""
    if SKINNY_CONFIG is not None:
        return SKINNY_CONFIG
    chosen = _SKINNY_CHOSEN.get(key)
    if chosen is None:
        out_features, k, device = key[0], key[1], key[-1]
        chosen = _skinny_heuristic(out_features, k, device)
        if _can_time(device):
            candidates = _skinny_candidates(out_features, k, device)
            chosen = _fastest(candidates, key, 1, weight, bias, default=chosen)
        _SKINNY_CHOSEN[key] = chosen
    return chosen


def _dispatch_config(
    key: tuple,  # (out, in, bias, dtype, device)
    rows: int,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[int, int, int, int] | None:
    """``SKINNY_DISPATCH``'s choice for the shape and rows: None (cuBLAS) or a kernel config."""
    full = (*key, rows)
    if full in _DISPATCH_CHOSEN:
        return _DISPATCH_CHOSEN[full]
    if not _can_time(key[-1]):
        return None  # inside a capture: cuBLAS, decided again at the next call outside one
    candidates = [None, *_skinny_candidates(key[0], key[1], key[-1])]
    chosen = _fastest(candidates, key, rows, weight, bias, default=None)
    _DISPATCH_CHOSEN[full] = chosen
    return chosen


def _can_time(device: torch.device) -> bool:
    return device.type == "cuda" and not torch.cuda.is_current_stream_capturing()


def _fastest(
    candidates: list[tuple[int, int, int, int] | None],  # None: cuBLAS
    key: tuple,  # (out, in, bias, dtype, device)
    rows: int,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    default: tuple[int, int, int, int] | None,
) -> tuple[int, int, int, int] | None:
    """The candidate whose calls on ``rows`` rows replayed fastest in a CUDA graph over copies of the
    weight too large together for L2 (the weights of a real pass come from memory, not L2), its
    timings added to ``TUNING_RECORD``; ``default`` when none could be timed. A candidate that fails
    to build or capture is left out (logged)."""
    out_features, k, _, dtype, device = key
    x = torch.randn(rows, k, device=device).to(dtype)
    y = torch.empty(rows, out_features, dtype=dtype, device=device)
    weights = _weight_copies(weight)
    calls = max(10, len(weights))

    def run(candidate, w: torch.Tensor) -> None:
        if candidate is None:
            linear_twin(x, w, bias, None if bias is not None else y)
        else:
            _skinny_launch(x, w, bias, candidate, y)

    times = {}
    for candidate in candidates:
        try:
            ms = _replay_ms(lambda c=candidate: [run(c, weights[i % len(weights)]) for i in range(calls)])
        except Exception as err:  # e.g. a config whose tiles exceed the device's shared memory
            log.info("projection %s candidate %s left out: %s", key[:2], candidate, err)
            continue
        times[candidate] = ms * 1000 / calls
    if times:
        chosen = min(times, key=times.get)
        TUNING_RECORD.append(
            {
                "out": out_features,
                "in": k,
                "rows": rows,
                "bias": bias is not None,
                "dtype": str(dtype),
                "invariant": BATCH_INVARIANT,
                "us": {_name(c): round(us, 2) for c, us in times.items()},
                "chosen": _name(chosen),
            }
        )
        return chosen
    log.warning("projection %s: no candidate could be timed; the default is used", key[:2])
    return default


def _name(candidate: tuple[int, int, int, int] | None) -> str:
    return "cublas" if candidate is None else ",".join(map(str, candidate))


def _weight_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """``weight`` and enough copies of it to hold twice the device's L2 cache (one when the weight
    alone is larger, 64 at most)."""
    l2 = getattr(torch.cuda.get_device_properties(weight.device), "L2_cache_size", 0) or (50 << 20)
    size = weight.numel() * weight.element_size()
    count = 1 if size >= l2 else min(64, -(-2 * l2 // size))
    return [weight] + [weight.clone() for _ in range(count - 1)]


def _replay_ms(fn: Callable[[], object]) -> float:
    """The best of 5 replays of ``fn`` captured as a CUDA graph, in ms."""
    graph, _ = capture_graph(fn)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


# ---------------------------------------------------------------------------------------------------
# The most likely token and its probability


def top1(
    logits: torch.Tensor,  # [n, vocab] any float dtype
) -> tuple[torch.Tensor, torch.Tensor]:  # (ids [n] int64, softmax probability of each [n] float32)
    """Each row's argmax and its softmax probability (float32 maths): the chain's drafts and their
    confidence without a float32 copy of the logits or a softmax over them."""
    if not triton_enabled(logits):
        return top1_twin(logits)
    x2 = _rows(logits)
    n, vocab = x2.shape
    blocks = triton.cdiv(vocab, _TOP1_BLOCK)
    part = torch.empty((3, n, blocks), dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, dtype=torch.int64, device=logits.device)
    prob = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n > 0:
        _top1_partial_kernel[(n, blocks)](x2, part, x2.stride(0), vocab, n * blocks, BLOCK=_TOP1_BLOCK)
        _top1_merge_kernel[(n,)](part, ids, prob, blocks, n * blocks, BLOCK_S=triton.next_power_of_2(blocks))
    return ids, prob


def top1_twin(
    logits: torch.Tensor,  # [n, vocab]
) -> tuple[torch.Tensor, torch.Tensor]:  # ([n] int64, [n] float32)
    top = torch.softmax(logits.float(), -1).max(-1)
    return top.indices, top.values


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _attention_splits(b: int, hk: int, capacity: int, device: torch.device, adapt: bool) -> tuple[int, int]:
    """(key splits per (sequence, KV head), keys a split holds). Batch invariant (``adapt`` off):
    the splits are cut at fixed key positions, from the block table's capacity alone (at least
    ``_ATTN_SPLIT_KEYS`` keys each), so a row's keys meet in the same order whatever the batch,
    its length or the query length. Else the splits divide each sequence's visible span: enough
    programs to fill the SMs once (keys a split holds: 0, computed by the kernel)."""
    if not adapt:
        keys = triton.cdiv(triton.cdiv(capacity, _ATTN_MAX_SPLITS), _ATTN_BLOCK_N) * _ATTN_BLOCK_N
        keys = max(_ATTN_SPLIT_KEYS, keys)
        return triton.cdiv(capacity, keys), keys
    want = triton.cdiv(_sm_count(device), b * hk)
    return max(1, min(want, triton.cdiv(capacity, _ATTN_BLOCK_N), _ATTN_MAX_SPLITS)), 0


# ---------------------------------------------------------------------------------------------------
# Triton kernels (defined only where triton imports)

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,  # [n, d]
        res_ptr,  # [n, d] (x_ptr again when HAS_RESIDUAL is off)
        w_ptr,  # [d]
        sum_ptr,  # [n, d] contiguous: x + residual
        out_ptr,  # [n, d] contiguous
        x_stride,
        res_stride,
        d,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < d
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * d + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / d + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * d + cols, (w * (xf * rstd)).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(
        x_ptr,  # [n, 2 * inter]
        out_ptr,  # [n, inter] contiguous
        x_stride,
        inter,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * inter + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kv_kernel(
        q_ptr,  # [n, hq, d]
        k_ptr,  # [n, hk, d]
        v_ptr,  # [n, hk, d]
        cos_ptr,  # [n, d] float32
        sin_ptr,  # [n, d] float32
        kc_ptr,  # [num_slots, hk, d]
        vc_ptr,  # [num_slots, hk, d]
        slots_ptr,  # [n] int64
        q_out_ptr,  # [n, hq, d] contiguous
        k_out_ptr,  # [n, hk, d] contiguous
        sq0,
        sq1,
        sk0,
        sk1,
        sv0,
        sv1,
        scos,
        ssin,
        skc0,
        skc1,
        svc0,
        svc1,
        hq,
        hk,
        half,
        BLOCK_HALF: tl.constexpr,
    ):
        """One program per (token, head): heads below hq are q's, the rest k's and v's."""
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs = tl.arange(0, BLOCK_HALF)
        mask = offs < half
        c1 = tl.load(cos_ptr + tok * scos + offs, mask=mask, other=0.0)
        c2 = tl.load(cos_ptr + tok * scos + half + offs, mask=mask, other=0.0)
        s1 = tl.load(sin_ptr + tok * ssin + offs, mask=mask, other=0.0)
        s2 = tl.load(sin_ptr + tok * ssin + half + offs, mask=mask, other=0.0)
        if head < hq:
            src = q_ptr + tok * sq0 + head * sq1
            x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src + half + offs, mask=mask, other=0.0).to(tl.float32)
            dst = q_out_ptr + (tok * hq + head) * 2 * half
            tl.store(dst + offs, (x1 * c1 - x2 * s1).to(q_out_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + half + offs, (x2 * c2 + x1 * s2).to(q_out_ptr.dtype.element_ty), mask=mask)
        else:
            h = head - hq
            src = k_ptr + tok * sk0 + h * sk1
            x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src + half + offs, mask=mask, other=0.0).to(tl.float32)
            # rounded to k's dtype first, as the twin stores k.to(k.dtype).to(cache dtype)
            r1 = (x1 * c1 - x2 * s1).to(k_out_ptr.dtype.element_ty)
            r2 = (x2 * c2 + x1 * s2).to(k_out_ptr.dtype.element_ty)
            dst = k_out_ptr + (tok * hk + h) * 2 * half
            tl.store(dst + offs, r1, mask=mask)
            tl.store(dst + half + offs, r2, mask=mask)
            slot = tl.load(slots_ptr + tok).to(tl.int64)
            if slot >= 0:
                kc = kc_ptr + slot * skc0 + h * skc1
                tl.store(kc + offs, r1.to(kc_ptr.dtype.element_ty), mask=mask)
                tl.store(kc + half + offs, r2.to(kc_ptr.dtype.element_ty), mask=mask)
                vs = v_ptr + tok * sv0 + h * sv1
                vc = vc_ptr + slot * svc0 + h * svc1
                v1 = tl.load(vs + offs, mask=mask, other=0.0)
                v2 = tl.load(vs + half + offs, mask=mask, other=0.0)
                tl.store(vc + offs, v1.to(vc_ptr.dtype.element_ty), mask=mask)
                tl.store(vc + half + offs, v2.to(vc_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dot(a, b, F32: tl.constexpr):
        """a @ b accumulated in float32; with F32 the operands are widened first and multiplied in
        full precision (float32 inputs: no TF32; the interpreter, whose half-precision dot is wrong)."""
        if F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _paged_attention_kernel(
        q_ptr,  # [b * query_len, hq, d]
        kc_ptr,  # [num_slots, hk, d]
        vc_ptr,  # [num_slots, hk, d]
        bt_ptr,  # [b, max_blocks] int32
        lens_ptr,  # [b] int32
        out_ptr,  # [b * query_len, hq, d] contiguous (ONE_SPLIT)
        mid_o_ptr,  # [b * query_len, hq, splits, d] float32: unnormalised output of each split
        mid_ml_ptr,  # [2, b * query_len, hq, splits] float32: running max (base 2) and sum of each split
        sq0,
        sq1,
        skc0,
        skc1,
        svc0,
        svc1,
        sbt0,
        num_slots,
        max_blocks,
        query_len,
        group,
        hq,
        row_tiles,
        block_size,
        scale_log2,
        window,
        sink,
        num_splits,
        split_keys,
        head_dim,
        ml_plane,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        WINDOW: tl.constexpr,
        ONE_SPLIT: tl.constexpr,
        DOT_F32: tl.constexpr,
        FIXED_SPLITS: tl.constexpr,
    ):
        """One program per (sequence, KV head and tile of BLOCK_M rows, split): rows are (query j,
        head of the group) pairs, so each K/V tile is read once for BLOCK_M of them. Keys are
        numbered over the visible span (the sinks, then from the first key any query's window
        reaches); with FIXED_SPLITS the splits hold ``split_keys`` keys each, else the span is cut
        into equal splits."""
        seq = tl.program_id(0)
        kvh = tl.program_id(1) // row_tiles
        rows = (tl.program_id(1) % row_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        split = tl.program_id(2)
        row_ok = rows < query_len * group
        j = rows // group
        head = kvh * group + rows % group
        token = seq.to(tl.int64) * query_len + j
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q = tl.load(
            q_ptr + token[:, None] * sq0 + head[:, None] * sq1 + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        seq_len = tl.load(lens_ptr + seq)
        pos = tl.maximum(seq_len - query_len + j, 0)  # [BLOCK_M] a padded row sees key 0
        n_keys = tl.maximum(seq_len, 1)
        lo = 0
        n_sink = 0
        if WINDOW:
            first = tl.maximum(seq_len - query_len - window + 1, 0)  # lowest key the first query sees
            gap = first > sink
            lo = tl.where(gap, first, 0)
            n_sink = tl.where(gap, sink, 0)
        count = n_sink + n_keys - lo
        split_len = split_keys
        if not FIXED_SPLITS:
            split_len = tl.cdiv(tl.cdiv(count, num_splits), BLOCK_N) * BLOCK_N
        start = split * split_len
        end = tl.minimum(start + split_len, count)

        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite before the first visible key: no inf - inf
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        offs = tl.arange(0, BLOCK_N)
        for t in range(start, end, BLOCK_N):
            t_ok = t + offs < end
            key = tl.where(t + offs < n_sink, t + offs, t + offs - n_sink + lo)  # [BLOCK_N]
            page = key // block_size
            t_ok = t_ok & (page < max_blocks)
            block = tl.load(bt_ptr + seq.to(tl.int64) * sbt0 + page, mask=t_ok, other=0).to(tl.int64)
            slot = block * block_size + key % block_size
            slot = tl.minimum(tl.maximum(slot, 0), num_slots - 1)
            kv_mask = t_ok[:, None] & d_ok[None, :]
            k = tl.load(kc_ptr + slot[:, None] * skc0 + kvh * skc1 + d[None, :], mask=kv_mask, other=0.0)
            s = _dot(q, tl.trans(k.to(q.dtype)), DOT_F32)
            visible = t_ok[None, :] & (key[None, :] <= pos[:, None])
            if WINDOW:
                visible = visible & ((key[None, :] < sink) | (key[None, :] > pos[:, None] - window))
            s = tl.where(visible, s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(vc_ptr + slot[:, None] * svc0 + kvh * svc1 + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), DOT_F32)
            m_i = m_new

        out_mask = row_ok[:, None] & d_ok[None, :]
        if ONE_SPLIT:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            dst = out_ptr + (token * hq + head)[:, None] * head_dim + d[None, :]
            tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            at = (token * hq + head) * num_splits + split  # [BLOCK_M]
            tl.store(mid_o_ptr + at[:, None] * head_dim + d[None, :], acc, mask=out_mask)
            tl.store(mid_ml_ptr + at, m_i, mask=row_ok)
            tl.store(mid_ml_ptr + ml_plane + at, l_i, mask=row_ok)

    @triton.jit
    def _merge_splits_kernel(
        mid_o_ptr,  # [rows, hq, splits, d] float32
        mid_ml_ptr,  # [2, rows, hq, splits] float32
        out_ptr,  # [rows, hq, d] contiguous
        num_splits,
        head_dim,
        ml_plane,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """One program per (query row, head): the splits' partial softmaxes into one."""
        row = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        s_ok = s < num_splits
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        at = row * num_splits + s
        m = tl.load(mid_ml_ptr + at, mask=s_ok, other=float("-inf"))
        l_s = tl.load(mid_ml_ptr + ml_plane + at, mask=s_ok, other=0.0)
        w = tl.exp2(m - tl.max(m, axis=0))  # [BLOCK_S]
        acc = tl.load(
            mid_o_ptr + at[:, None] * head_dim + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0
        )
        total = tl.sum(l_s * w, axis=0)
        o = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + row * head_dim + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)

    @triton.jit
    def _skinny_kernel(
        x_ptr,  # [n, in]
        w_ptr,  # [out, in]
        b_ptr,  # [out]
        y_ptr,  # [n, out] contiguous
        n,
        n_out,
        k_dim,
        sx,
        sw,
        row_tiles,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        """One program per (tile of BLOCK_N outputs, tile of BLOCK_M rows), the row tiles of one
        output tile next to each other (they read the same weights, from L2 after the first); the
        reduction runs in BLOCK_K chunks in a fixed order."""
        pid = tl.program_id(0)
        row_tile = pid % row_tiles
        col_tile = pid // row_tiles
        rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n
        cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_out
        kk = tl.arange(0, BLOCK_K)
        rows64 = rows.to(tl.int64)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k_dim, BLOCK_K):
            k_ok = k0 + kk < k_dim
            a = tl.load(
                x_ptr + rows64[:, None] * sx + (k0 + kk)[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + cols.to(tl.int64)[:, None] * sw + (k0 + kk)[None, :],
                mask=col_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            acc += _dot(a, tl.trans(w), DOT_F32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(
            y_ptr + rows64[:, None] * n_out + cols[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )

    @triton.jit
    def _top1_partial_kernel(
        x_ptr,  # [n, vocab]
        part_ptr,  # [3, n, blocks] float32: each block's max, its first index, sum of exp(x - max)
        sx,
        vocab,
        plane,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * sx + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        first = tl.min(tl.where(x == m, offs, vocab), axis=0)
        total = tl.sum(tl.exp(x - m), axis=0)
        at = row * tl.num_programs(1) + blk
        tl.store(part_ptr + at, m)
        tl.store(part_ptr + plane + at, first.to(tl.float32))
        tl.store(part_ptr + 2 * plane + at, total)

    @triton.jit
    def _top1_merge_kernel(
        part_ptr,  # [3, n, blocks] float32
        ids_ptr,  # [n] int64
        prob_ptr,  # [n] float32
        blocks,
        plane,
        BLOCK_S: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, BLOCK_S)
        ok = s < blocks
        at = row * blocks + s
        m = tl.load(part_ptr + at, mask=ok, other=float("-inf"))
        first = tl.load(part_ptr + plane + at, mask=ok, other=3.0e38)
        total = tl.load(part_ptr + 2 * plane + at, mask=ok, other=0.0)
        top = tl.max(m, axis=0)
        best = tl.min(tl.where(m == top, first, 3.0e38), axis=0)
        z = tl.sum(total * tl.exp(m - top), axis=0)
        tl.store(ids_ptr + row, best.to(tl.int64))
        tl.store(prob_ptr + row, 1.0 / z)
