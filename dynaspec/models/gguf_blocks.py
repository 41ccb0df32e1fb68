"""Decode raw GGUF quantized blocks into a group-wise integer form that keeps the file's values.

Every supported block type is, per group of 16 or 32 weights, `w = scale * q + offset` with small
integer codes `q`: Q4_0/Q5_0/Q8_0/Q6_K are symmetric (signed codes, no offset), Q4_1/Q5_1/Q4_K/Q5_K
are affine (unsigned codes and an offset per group). The K-quants' two-level scales are multiplied
out (scale = d * sc_j, offset = -dmin * m_j), so `GroupedWeight.dequantize` equals
`gguf.quants.dequantize` exactly. Decoding is vectorised over all blocks of a tensor at once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from dynaspec.models.kernels import kernel_error

QK_K = 256  # weights per K-quant super-block
DECODE_CHUNK_BLOCKS = 1 << 13  # blocks decoded at a time, so the temporaries stay in cache


@dataclass(frozen=True, slots=True)
class SuperBlocks:
    """The K-quants' two-level scales, kept so a kernel can stream 8-bit sub-scales instead of
    float32 per group: scale = d[g // size] * sc[g], offset = dmin[g // size] * m[g] (exact)."""

    size: int  # groups per super-block
    d: torch.Tensor  # [out, groups // size] float32 (an f16 value of the file)
    sc: torch.Tensor  # [out, groups] int8
    dmin: torch.Tensor | None  # [out, groups // size] float32; None without offsets
    m: torch.Tensor | None  # [out, groups] int8; None without offsets


@dataclass(frozen=True, slots=True)
class GroupedWeight:
    """Integer codes with one float32 scale (and, for affine types, offset) per group of weights."""

    codes: torch.Tensor  # [out, in] int8 (symmetric types) or uint8 (affine types)
    scales: torch.Tensor  # [out, in // group] float32
    offsets: torch.Tensor | None  # [out, in // group] float32; None for symmetric types
    group: int  # weights per group along `in`
    bits: int  # codes use this many bits (signed codes lie in [-2**(bits-1), 2**(bits-1)))
    superblocks: SuperBlocks | None = None  # the same scales and offsets, factored (K-quants)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:  # [out, in] float32
        out, n_in = self.codes.shape
        q = self.codes.view(out, n_in // self.group, self.group).float()
        w = self.scales[..., None] * q
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.view(out, n_in)


def _f16(b: np.ndarray) -> np.ndarray:  # [n, 2] uint8 -> [n] float32
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Split packed bytes [n, m] into 2*m nibbles: each run of `run` bytes gives its low nibbles
    then its high nibbles (the order of Q4_0/Q4_1/Q5_0/Q5_1 with run 16 and Q4_K/Q5_K/Q6_K with 32/64)."""
    n, m = qs.shape
    q = qs.reshape(n, m // run, 1, run) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, 2 * m)


def _high_bits(qh: np.ndarray, width: int) -> np.ndarray:
    """Fields of `width` bits [n, m] -> [n, m * 8 // width]: field j of byte i lands at j * m + i."""
    n, m = qh.shape
    shifts = np.arange(0, 8, width, dtype=np.uint8).reshape(1, -1, 1)
    return ((qh.reshape(n, 1, m) >> shifts) & ((1 << width) - 1)).reshape(n, -1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of Q4_K/Q5_K scales -> 6-bit (sc, m) for the 8 groups, each [n, 8] uint8.

    Bytes 0-3 hold sc_0..3 in their low 6 bits, bytes 4-7 m_0..3; sc_4..7 and m_4..7 take their low
    4 bits from bytes 8-11 (sc low nibble, m high nibble) and their top 2 bits from the top bits of
    bytes 0-3 (sc) and 4-7 (m)."""
    lo_sc, lo_m, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([lo_sc & 0x3F, (mixed & 0x0F) | ((lo_sc >> 6) << 4)], axis=1)
    m = np.concatenate([lo_m & 0x3F, (mixed >> 4) | ((lo_m >> 6) << 4)], axis=1)
    return sc, m


def _q4_0(b: np.ndarray):
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:18], 16).astype(np.int8) - 8
    return q, d[:, None], None, 32, 4, None


def _q4_1(b: np.ndarray):
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return _nibbles(b[:, 4:20], 16), d[:, None], m[:, None], 32, 4, None


def _q5_low_high(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:  # [n, 32] uint8 in [0, 32)
    high = np.unpackbits(qh, axis=1, bitorder="little")  # bit i of the little-endian 32-bit qh: weight i
    return _nibbles(qs, 16) | (high << 4)


def _q5_0(b: np.ndarray):
    d = _f16(b[:, 0:2])
    q = _q5_low_high(b[:, 2:6], b[:, 6:22]).astype(np.int8) - 16
    return q, d[:, None], None, 32, 5, None


def _q5_1(b: np.ndarray):
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return _q5_low_high(b[:, 4:8], b[:, 8:24]), d[:, None], m[:, None], 32, 5, None


def _q8_0(b: np.ndarray):
    d = _f16(b[:, 0:2])
    return np.ascontiguousarray(b[:, 2:34]).view(np.int8), d[:, None], None, 32, 8, None


def _k_affine(b: np.ndarray, qh: np.ndarray | None, qs: np.ndarray | None):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _k_scales(b[:, 4:16])
    q = None if qs is None else _nibbles(qs, 32)
    if qh is not None:
        q = q | (_high_bits(qh, 1) << 4)
    scales, offsets = d[:, None] * sc.astype(np.float32), -(dmin[:, None] * m.astype(np.float32))
    return q, scales, offsets, 32, (d, sc.view(np.int8), -dmin, m.view(np.int8))


def _q4_k(b: np.ndarray, codes: bool = True):
    q, scales, offsets, group, sup = _k_affine(b, None, b[:, 16:144] if codes else None)
    return q, scales, offsets, group, 4, sup


def _q5_k(b: np.ndarray):
    q, scales, offsets, group, sup = _k_affine(b, b[:, 16:48], b[:, 48:176])
    return q, scales, offsets, group, 5, sup


def _q6_k(b: np.ndarray, codes: bool = True):
    q = None
    if codes:
        low = _nibbles(b[:, 0:128], 64)  # [n, 256]: halves of 128, each low nibbles then high nibbles
        high = _high_bits(b[:, 128:192].reshape(-1, 32), 2).reshape(-1, QK_K)  # per half: 4 fields x 32
        q = (low | (high << 4)).astype(np.int8) - 32
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    return q, d[:, None] * sc, None, 16, 6, (d, sc.astype(np.int8), None, None)


_DECODERS = {
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
# Types whose codes the C++ unpacker gives (in parallel, straight from the bytes) when the kernels
# are built; numpy then decodes only their scales.
_SCALE_DECODERS = {
    GGMLQuantizationType.Q4_K: functools.partial(_q4_k, codes=False),
    GGMLQuantizationType.Q6_K: functools.partial(_q6_k, codes=False),
}
DENSE_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
SUPPORTED_TYPES = (*_DECODERS, *DENSE_TYPES)


def decode_blocks(
    data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int], name: str = "tensor"
) -> GroupedWeight | torch.Tensor:
    """Raw bytes of one GGUF tensor (any array layout holding them) -> GroupedWeight, or a dense
    float32 tensor [out, in] for F32/F16/BF16. `shape` is (out, in), the reverse of GGUF's order."""
    qtype = GGMLQuantizationType(qtype)
    out, n_in = shape
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if qtype in DENSE_TYPES:
        if qtype == GGMLQuantizationType.F32:
            dense = raw.view(np.float32).copy()
        elif qtype == GGMLQuantizationType.F16:
            dense = raw.view(np.float16).astype(np.float32)
        else:
            dense = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return torch.from_numpy(dense.reshape(out, n_in))
    decoder = _DECODERS.get(qtype)
    if decoder is None:
        raise ValueError(
            f"{name}: GGUF type {qtype.name} is not supported "
            f"(supported: {', '.join(t.name for t in SUPPORTED_TYPES)})"
        )
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if n_in % block_size or raw.size != out * n_in // block_size * type_size:
        raise ValueError(f"{name}: {raw.size} bytes do not hold a {qtype.name} tensor of shape {shape}")
    blocks = raw.reshape(-1, type_size)
    native = qtype in _SCALE_DECODERS and kernel_error() is None
    if native:
        decoder = _SCALE_DECODERS[qtype]
    chunks = [
        decoder(blocks[i : i + DECODE_CHUNK_BLOCKS]) for i in range(0, len(blocks), DECODE_CHUNK_BLOCKS)
    ]
    q, scales, offsets, group, bits, sup = _concat(chunks)
    if native:
        src = torch.from_numpy(raw if raw.flags.writeable else raw.copy())
        q = torch.ops.dynaspec.gguf_codes(src, int(qtype), out, n_in).numpy()
    groups = n_in // group
    superblocks = None
    if sup is not None:  # one super-block per GGUF block
        d, sc, dmin, m = sup
        supers = n_in // block_size

        def ints(v: np.ndarray) -> torch.Tensor:  # [blocks, groups per block] -> [out, groups]
            return torch.from_numpy(np.ascontiguousarray(v).reshape(out, groups))

        superblocks = SuperBlocks(
            size=groups // supers,
            d=torch.from_numpy(d.reshape(out, supers).copy()),
            sc=ints(sc),
            dmin=None if dmin is None else torch.from_numpy(dmin.reshape(out, supers).copy()),
            m=None if m is None else ints(m),
        )
    return GroupedWeight(
        codes=torch.from_numpy(np.ascontiguousarray(q).reshape(out, n_in)),
        scales=torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(out, groups)),
        offsets=None
        if offsets is None
        else torch.from_numpy(_per_group(offsets, scales.shape).reshape(out, groups)),
        group=group,
        bits=bits,
        superblocks=superblocks,
    )


def _concat(chunks: list[tuple]) -> tuple:
    """Join the decoders' per-chunk results along the block axis (arrays and tuples of arrays)."""

    def join(parts: list):
        if parts[0] is None or isinstance(parts[0], int):
            return parts[0]
        if isinstance(parts[0], tuple):
            return tuple(join([p[i] for p in parts]) for i in range(len(parts[0])))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    return tuple(join([c[i] for c in chunks]) for i in range(len(chunks[0])))


def _per_group(
    values: np.ndarray, shape: tuple[int, ...]
) -> np.ndarray:  # values broadcast to shape, own copy
    return np.broadcast_to(values, shape).astype(np.float32, copy=True)


def random_blocks(qtype: GGMLQuantizationType, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """Random valid blocks of a quantized type for tests and benchmarks: uniform random bytes with
    the f16 super-scales (d, and dmin where the type has one) set to small positive values.
    Returns [out, bytes per row] uint8."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in _DECODERS:
        raise ValueError(f"random_blocks: {qtype.name} is not a supported quantized type")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    out, n_in = shape
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(out * n_in // block_size, type_size), dtype=np.uint8)
    d = rng.uniform(1e-4, 2e-3, size=(raw.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == GGMLQuantizationType.Q6_K:
        raw[:, 208:210] = d[:, 0:2]  # d closes the block
    elif qtype in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0):
        raw[:, 0:2] = d[:, 0:2]
    else:
        raw[:, 0:4] = d  # d, then dmin (or m for Q4_1/Q5_1)
    return raw.reshape(out, -1)


def decode_reader_tensor(tensor) -> GroupedWeight | torch.Tensor:
    """A `gguf.GGUFReader` tensor of a 2-D weight -> GroupedWeight (or dense float32 [out, in])."""
    n_in, out = (int(n) for n in tensor.shape)
    return decode_blocks(tensor.data, tensor.tensor_type, (out, n_in), tensor.name)


def _map_rows(weights: list[GroupedWeight], fn) -> GroupedWeight:
    """One GroupedWeight whose every per-row tensor (all have the output rows first) is `fn` of that
    tensor in each of `weights` (all of one layout)."""
    first, sb = weights[0], weights[0].superblocks

    def each(get):
        return fn([get(w) for w in weights])

    return GroupedWeight(
        codes=each(lambda w: w.codes),
        scales=each(lambda w: w.scales),
        offsets=None if first.offsets is None else each(lambda w: w.offsets),
        group=first.group,
        bits=first.bits,
        superblocks=None
        if sb is None
        else SuperBlocks(
            size=sb.size,
            d=each(lambda w: w.superblocks.d),
            sc=each(lambda w: w.superblocks.sc),
            dmin=None if sb.dmin is None else each(lambda w: w.superblocks.dmin),
            m=None if sb.m is None else each(lambda w: w.superblocks.m),
        ),
    )


def select_rows(weight: GroupedWeight, index: torch.Tensor) -> GroupedWeight:
    """The output rows `index` of a weight (a permutation, or a prefix for a pruned head)."""
    return _map_rows([weight], lambda ts: ts[0].index_select(0, index))


def layout(weight: GroupedWeight) -> tuple:
    """What must agree for two weights' rows to be stacked into one layer."""
    sb = weight.superblocks
    return (
        weight.codes.dtype,
        weight.codes.shape[1],
        weight.group,
        weight.bits,
        weight.offsets is None,
        None if sb is None else (sb.size, sb.dmin is None),
    )


def concat_rows(weights: list[GroupedWeight]) -> GroupedWeight:
    """Weights of one layout stacked along the output rows (fused q/k/v or gate/up)."""
    if len({layout(w) for w in weights}) != 1:
        raise ValueError("concat_rows: the weights differ in layout")
    return weights[0] if len(weights) == 1 else _map_rows(weights, torch.cat)
