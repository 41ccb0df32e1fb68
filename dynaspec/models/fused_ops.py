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
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# kernels were built for the interpreter (CPU tensors): TRITON_INTERPRET is read when they are defined
_INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET", "0") == "1"
# keys a paged-attention program handles per step of its loop
_ATTN_BLOCK_N = 64
# the most key splits of one (sequence, KV head)
_ATTN_MAX_SPLITS = 64
# SMs assumed when the device does not say (the interpreter): an H100's
_DEFAULT_SMS = 132


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
    if num_splits is None:
        num_splits = _attention_splits(b, hk, block_table.shape[1] * block_size, q.device)
    block_m = max(16, triton.next_power_of_2(query_len * group))
    block_d = triton.next_power_of_2(d)
    if num_splits > 1:
        mid_o = torch.empty((n, hq, num_splits, d), dtype=torch.float32, device=q.device)
        mid_ml = torch.empty((2, n, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_ml = out
    _paged_attention_kernel[(b, hk, num_splits)](
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
        block_size,
        scale * 1.4426950408889634,  # log2(e): the kernel works in base 2
        window if window is not None else 0,
        sink_tokens,
        num_splits,
        d,
        n * hq * num_splits,
        BLOCK_M=block_m,
        BLOCK_N=_ATTN_BLOCK_N,
        BLOCK_D=block_d,
        WINDOW=window is not None,
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


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _attention_splits(b: int, hk: int, max_context: int, device: torch.device) -> int:
    """Key splits per (sequence, KV head): enough programs to fill the SMs once, no more splits than
    key tiles in the longest context the block table holds."""
    want = triton.cdiv(_sm_count(device), b * hk)
    return max(1, min(want, triton.cdiv(max_context, _ATTN_BLOCK_N), _ATTN_MAX_SPLITS))


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
        block_size,
        scale_log2,
        window,
        sink,
        num_splits,
        head_dim,
        ml_plane,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        WINDOW: tl.constexpr,
        ONE_SPLIT: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        """One program per (sequence, KV head, split): rows are (query j, head of the group) pairs,
        so each K/V tile is read once for all of them. Keys are numbered over the visible span (the
        sinks, then from the first key any query's window reaches), cut into equal splits."""
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        rows = tl.arange(0, BLOCK_M)
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

        hq = group * tl.num_programs(1)
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
