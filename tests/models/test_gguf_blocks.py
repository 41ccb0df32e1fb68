"""GGUF block decoding: every supported type decodes to exactly what `gguf.quants.dequantize` gives.

Tolerance: exact (bitwise float32 equality). Each product of an f16 scale and a small integer code
fits float32's 24-bit significand, and affine types add their offset once, as the reference does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T

from dynaspec.models.gguf_blocks import GroupedWeight, decode_blocks, random_blocks

OUT, IN = 8, 512

# types gguf can quantize: round-trip real floats; the K-quants only dequantize: random valid bytes
QUANTIZABLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
RANDOM_BYTES = [T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("qtype", QUANTIZABLE + RANDOM_BYTES, ids=lambda t: t.name)
def test_decode_matches_gguf_dequantize(qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    if qtype in QUANTIZABLE:
        raw = quants.quantize(rng.standard_normal((OUT, IN)).astype(np.float32), qtype)
    else:
        raw = random_blocks(qtype, (OUT, IN), seed=int(qtype))
    ref = quants.dequantize(raw, qtype)
    got = decode_blocks(raw, qtype, (OUT, IN), "blk.0.test.weight")
    assert isinstance(got, GroupedWeight)
    assert got.codes.shape == (OUT, IN) and got.scales.shape == (OUT, IN // got.group)
    lo, hi = (0, 2**got.bits) if got.offsets is not None else (-(2 ** (got.bits - 1)), 2 ** (got.bits - 1))
    assert lo <= int(got.codes.min()) and int(got.codes.max()) < hi
    assert torch.equal(got.dequantize(), torch.from_numpy(ref))
    sup = got.superblocks
    if qtype in RANDOM_BYTES:  # the K-quants keep their two-level scales, and they multiply out exactly
        assert torch.equal(sup.d.repeat_interleave(sup.size, dim=1) * sup.sc.float(), got.scales)
        if got.offsets is not None:
            assert torch.equal(sup.dmin.repeat_interleave(sup.size, dim=1) * sup.m.float(), got.offsets)
    else:
        assert sup is None


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_dense_types_pass_through(qtype: T) -> None:
    x = np.random.default_rng(0).standard_normal((OUT, IN)).astype(np.float32)
    raw = quants.quantize(x, qtype)
    got = decode_blocks(raw.view(np.uint8), qtype, (OUT, IN))
    assert torch.equal(got, torch.from_numpy(quants.dequantize(raw.view(np.uint8), qtype).reshape(OUT, IN)))


def test_unsupported_type_names_tensor_and_type() -> None:
    raw = np.zeros((OUT, IN // 256 * GGML_QUANT_SIZES[T.Q2_K][1]), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"blk\.3\.ffn_up\.weight.*Q2_K"):
        decode_blocks(raw, T.Q2_K, (OUT, IN), "blk.3.ffn_up.weight")


def test_wrong_size_is_refused() -> None:
    with pytest.raises(ValueError, match="Q8_0"):
        decode_blocks(np.zeros(10, dtype=np.uint8), T.Q8_0, (OUT, IN), "w")
