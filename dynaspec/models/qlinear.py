"""Weight-only quantized linear layers built from the group-wise integer form of `gguf_blocks`.

A `QuantLinear` keeps a GGUF tensor's own codes and scales and multiplies through one of four paths,
chosen at construction:
- "vnni": this package's C++ operator (csrc/qmatmul.cpp): int8 activations per group and AVX-512
  VNNI dot products (AMX int8 tiles for blocks of 16 rows, same results), so its cost grows slowly
  with rows (speculative verification) and each row's result is independent of the batch. The
  default when it builds (JIT, cached in torch's extension directory); else int4, else int8.
- "int4": PyTorch's `_weight_int4pack_mm_for_cpu`, exact for 4-bit groups of 32 with float32
  scales; it computes w = (q - 8) * scale + zero.
- "int8": PyTorch's per-channel `_weight_int8pack_mm` after re-rounding the weights (lossy).
- "dense": the dequantized weight in the compute dtype and `F.linear` (reference and fallback).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dynaspec.models.gguf_blocks import GroupedWeight, decode_reader_tensor
from dynaspec.models.kernels import kernel_error

KERNEL_LANES = 16  # output columns per packed tile of the C++ kernel
KERNEL_GROUPS = (16, 32)  # group sizes the C++ kernel takes
KERNEL_COLUMN_MULTIPLE = 32  # the kernel computes two tiles at a time: columns are padded to this
INT4_GROUPS = (32, 64, 128, 256)  # group sizes PyTorch's int4 kernel accepts
INT4_INNER_K_TILES = 2
PATHS = ("vnni", "int4", "int8", "dense")
# Calls with at least this many rows use AMX tiles when the CPU has them (identical results): the
# measured crossover on a 1536x8960 Q4_K layer, 2 threads (VNNI ~0.03 ms per row, a 16-row AMX block ~0.5 ms).
AMX_MIN_ROWS = 12
# the kernel's scale modes (csrc/qmatmul.cpp ScaleMode); the _SYM ones leave out a symmetric type's offsets
SCALE_F32, SCALE_F16, SCALE_SUPER, SCALE_F16_SYM, SCALE_SUPER_SYM = 0, 1, 2, 3, 4
NO_AMX = 2**62  # an amx_min_rows that keeps every call on the VNNI loop


def default_path(weight: GroupedWeight) -> str:
    """The fastest path that keeps this weight: the C++ kernel when it builds, else PyTorch's int4
    kernel for 4-bit groups it accepts, else its per-channel int8 kernel."""
    if weight.group in KERNEL_GROUPS and kernel_error() is None:
        return "vnni"
    if weight.bits == 4 and weight.group in INT4_GROUPS:
        return "int4"
    return "int8"


def _kernel_bits(weight: GroupedWeight) -> int:
    """How the kernel stores these codes: 4-bit types as nibbles, 5-bit groups of 32 and 6-bit
    groups of 16 (Q5_0/Q5_1/Q5_K, Q6_K) as nibbles plus a plane of top bits, anything else as bytes."""
    if weight.bits == 4 or (weight.bits, weight.group) in ((5, 32), (6, 16)):
        return weight.bits
    return 8


def unsigned_shift(weight: GroupedWeight) -> tuple[int, torch.Tensor]:
    """The shift that takes the codes to [0, 2**bits) and the offsets that go with it: w = scale *
    (code + shift) + offset. Affine types need none; for symmetric ones the offset is -shift * scale,
    exact in float32 (a power of two times the scale)."""
    if weight.offsets is not None:
        return 0, weight.offsets
    shift = 2 ** (weight.bits - 1)
    return shift, weight.scales * -shift


def unsigned_form(weight: GroupedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes shifted to [0, 2**bits) and their offsets: (u [out, in] uint8, offset [out, in // group])."""
    shift, offsets = unsigned_shift(weight)
    if shift == 0:
        return weight.codes.to(torch.uint8), offsets
    return (weight.codes.to(torch.int16) + shift).to(torch.uint8), offsets


class _Vnni(nn.Module):
    """Packs the codes into 16-column tiles for csrc/qmatmul.cpp: [tiles / 2, groups, 2, bytes], each
    pair of tiles interleaved group by group (one stream per thread; `tile_slot` there)."""

    def __init__(self, weight: GroupedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        error = kernel_error()
        if error is not None:
            raise ValueError(f"path 'vnni' is not available: {error}")
        if weight.group not in KERNEL_GROUPS:
            raise ValueError(f"path 'vnni' takes groups of {KERNEL_GROUPS}, not {weight.group}")
        out, g = weight.shape[0], weight.group
        self.n_out, self.group = out, g
        self.amx_min_rows = AMX_MIN_ROWS
        self.bits = _kernel_bits(weight)
        pad = -out % KERNEL_COLUMN_MULTIPLE
        # the unsigned form (codes shifted to [0, 2**bits)) packed into 16-column tiles, in C++
        shift, offsets = unsigned_shift(weight)
        packed = torch.ops.dynaspec.pack_tiles(weight.codes.contiguous(), shift, self.bits, g, pad)
        self.register_buffer("packed", packed)  # [tiles / 2, groups, 2, bytes]
        self.mode, f32, sub, self.super_groups = _scale_table(weight, offsets, pad)
        self.register_buffer("scales_f32", f32)
        self.register_buffer("scales_sub", sub)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out] float32
        return torch.ops.dynaspec.qmm_vnni(
            x,
            self.packed,
            self.scales_f32,
            self.scales_sub,
            self.n_out,
            self.group,
            self.bits,
            self.mode,
            self.super_groups,
            self.amx_min_rows,
        )


def _scale_table(
    weight: GroupedWeight,
    offsets: torch.Tensor,  # [out, groups] float32: the unsigned form's offsets
    pad: int,
) -> tuple[int, torch.Tensor, torch.Tensor, int]:
    """The smallest exact storage of the kernel's scales and offsets, in tiles of 16 columns:
    (mode, f32 [tiles / 2, groups or super-blocks, 2, fields, 16], sub [tiles / 2, groups, 2, fields,
    16], groups per super-block: pairs of tiles interleaved as the codes are). K-quants stream int8
    sub-scales (2 bytes per group and column instead of 8); types whose scales are f16 values stream
    them as f16. Symmetric types (no offsets of their own:
    the unsigned form's is -2^(bits-1) x the scale, which the kernel computes) stream the scales
    alone (one field instead of two)."""

    def tiled(*vs: torch.Tensor) -> torch.Tensor:  # k x [out, n] -> [tiles / 2, n, 2, k, 16]
        v = F.pad(torch.stack(vs, dim=-1), (0, 0, 0, 0, 0, pad))
        pair = KERNEL_COLUMN_MULTIPLE // KERNEL_LANES
        return v.view(-1, pair, KERNEL_LANES, *v.shape[1:]).permute(0, 3, 1, 4, 2).contiguous()

    empty = torch.empty(0)
    symmetric = weight.offsets is None and _kernel_bits(weight) == weight.bits  # the kernel's shift
    sb = weight.superblocks
    if sb is not None:
        if symmetric:
            return SCALE_SUPER_SYM, tiled(sb.d), tiled(sb.sc), sb.size
        dmin, m = (sb.dmin, sb.m) if weight.offsets is not None else (sb.d * -(2 ** (weight.bits - 1)), sb.sc)
        return SCALE_SUPER, tiled(sb.d, dmin), tiled(sb.sc, m), sb.size
    half = torch.stack([weight.scales, offsets]).half()
    if torch.isfinite(half).all() and torch.equal(half.float(), torch.stack([weight.scales, offsets])):
        if symmetric:
            return SCALE_F16_SYM, empty, tiled(half[0]).view(torch.int16), 1
        return SCALE_F16, empty, tiled(half[0], half[1]).view(torch.int16), 1
    return SCALE_F32, tiled(weight.scales.float(), offsets.float()), empty, 1


class _Int4(nn.Module):
    """PyTorch's int4 CPU kernel: w = (u - 8) * scale + zero, so zero = offset + 8 * scale."""

    def __init__(self, weight: GroupedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        if weight.bits != 4 or weight.group not in INT4_GROUPS:
            raise ValueError(
                f"path 'int4' takes 4-bit codes in groups of {INT4_GROUPS}, "
                f"not {weight.bits}-bit/{weight.group}"
            )
        u, offsets = unsigned_form(weight)
        self.group, self.dtype = weight.group, dtype
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32), INT4_INNER_K_TILES)
        self.register_buffer("packed", packed)  # [out, in // 2] uint8
        zeros = offsets + 8 * weight.scales
        self.register_buffer("scale_zeros", torch.stack([weight.scales.t(), zeros.t()], dim=-1).to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out] in self.dtype
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(self.dtype).contiguous(), self.packed, self.group, self.scale_zeros
        )


class _Int8(nn.Module):
    """PyTorch's per-channel int8 kernel after re-rounding: scale = max|w| / 127 per output row."""

    def __init__(self, weight: GroupedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        w = weight.dequantize()
        scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0  # [out]
        self.dtype = dtype
        self.register_buffer("codes", (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out] in self.dtype
        return torch.ops.aten._weight_int8pack_mm(x.to(self.dtype).contiguous(), self.codes, self.scales)


class _Dense(nn.Module):
    """The dequantized weight in the compute dtype."""

    def __init__(self, weight: GroupedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.register_buffer("weight", weight.dequantize().to(dtype))  # [out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out] in self.dtype
        return F.linear(x.to(self.dtype), self.weight)


_IMPLS = {"vnni": _Vnni, "int4": _Int4, "int8": _Int8, "dense": _Dense}


class QuantLinear(nn.Module):
    """y = x W^T + b with W held quantized; `path` None picks `default_path`. `dtype` is the compute
    dtype of the built-in paths (their scales are stored in it); the output has x's dtype."""

    def __init__(
        self,
        weight: GroupedWeight,
        bias: torch.Tensor | None = None,  # [out]
        path: str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        path = default_path(weight) if path is None else path
        if path not in _IMPLS:
            raise ValueError(f"path: {path!r} is not one of {PATHS}")
        self.path = path
        self.out_features, self.in_features = weight.shape
        self.impl = _IMPLS[path](weight, dtype)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self._refresh_hot_path()

    def _refresh_hot_path(self) -> None:
        """The VNNI kernel's arguments and the bias as plain attributes: reading buffers through
        nn.Module's __getattr__ on every call made the module cost 7.1 us a call against the op's
        3.0 (benchmarks/probes/qmm_call_overhead.py). Rebuilt whenever the buffers move (`_apply`)."""
        v = self.impl
        self._vnni = None
        if self.path == "vnni":
            self._vnni = (
                v.packed,
                v.scales_f32,
                v.scales_sub,
                v.n_out,
                v.group,
                v.bits,
                v.mode,
                v.super_groups,
                v.amx_min_rows,
            )
        self._bias = self.bias

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._refresh_hot_path()
        return out

    @classmethod
    def from_parts(
        cls,
        codes: torch.Tensor,  # [out, in] int8 (symmetric) or uint8 (with offsets)
        scales: torch.Tensor,  # [out, in // group]
        offsets: torch.Tensor | None,  # [out, in // group] or None
        group: int,
        bias: torch.Tensor | None = None,  # [out]
        bits: int | None = None,
        **kwargs,
    ) -> QuantLinear:
        """From raw group-wise parts; `bits` defaults to the fewest that hold the codes."""
        if bits is None:
            lo, hi = int(codes.min()), int(codes.max())
            bits = (
                max(1, (hi - lo).bit_length())
                if offsets is not None
                else max(lo.bit_length(), hi.bit_length()) + 1
            )
        weight = GroupedWeight(
            codes, scales.float(), None if offsets is None else offsets.float(), group, bits
        )
        return cls(weight, bias, **kwargs)

    @classmethod
    def from_gguf(cls, tensor, bias: torch.Tensor | None = None, **kwargs) -> QuantLinear:
        """From a `gguf.GGUFReader` tensor of a quantized 2-D weight (dense types are refused)."""
        weight = decode_reader_tensor(tensor)
        if not isinstance(weight, GroupedWeight):
            raise TypeError(f"{tensor.name}: {tensor.tensor_type.name} is not quantized; use nn.Linear")
        return cls(weight, bias, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self._vnni is not None and x.dim() == 2 and x.dtype == torch.float32:
            # the decode hot path, called ~130 times a step: no reshapes, no casts, no module hop
            y = torch.ops.dynaspec.qmm_vnni(x, *self._vnni)
            return y if self._bias is None else y.add_(self._bias)
        flat = x.reshape(-1, self.in_features)
        y = self.impl(flat)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, path={self.path}"


def quantize_dense(weight: torch.Tensor, bits: int, group: int = 32) -> GroupedWeight:  # weight [out, in]
    """Round-to-nearest group-wise symmetric quantization of a dense checkpoint's weight, as GGUF's
    Q8_0 and Q4_0 do: per group a float16 scale d and signed codes, w ~ d * code. 8 bits: d = max|w|
    / 127, codes in [-127, 127]; fewer: d = -m / 2**(bits-1), m the group's value of largest
    magnitude, codes in [-2**(bits-1), 2**(bits-1)) (m's code is the most negative one; the
    other end is clamped one code short). The kernel streams the scale alone (the offset is
    -2**(bits-1) * d, which it computes): 4.5 bits a weight at 4 bits, 8.5 at 8. Lower quality than a
    GGUF's own K-quants, which search their scales."""
    if not 2 <= bits <= 8:
        raise ValueError(f"bits: {bits} is not in [2, 8]")
    out, n_in = weight.shape
    if n_in % group:
        raise ValueError(f"group: {group} does not divide in_features {n_in}")
    w = weight.detach().float().view(out, n_in // group, group)
    half = 2 ** (bits - 1)
    if bits == 8:
        lo, hi, d = -127, 127, w.abs().amax(dim=-1) / 127.0
    else:
        m = torch.gather(w, -1, w.abs().argmax(dim=-1, keepdim=True))[..., 0]
        lo, hi, d = -half, half - 1, m / -half
    scales = d.half().float()  # stored as float16: the kernel streams 2 bytes of scale a group
    inv = torch.where(scales != 0, 1.0 / scales, torch.zeros_like(scales))
    codes = (w * inv[..., None]).round().clamp(lo, hi).to(torch.int8)
    return GroupedWeight(codes.view(out, n_in), scales, None, group, bits)
