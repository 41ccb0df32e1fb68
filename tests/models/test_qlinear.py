"""QuantLinear: every path against a float reference matmul, and batch invariance.

Reference: x @ W^T in float64 with W the exact dequantized weight. Tolerances (relative Frobenius
error of the output): "dense"/"int4" in float32 1e-5 (float rounding only); "int4"/"dense" in
bfloat16 2e-2 (bf16 inputs, scales and output); "int8" 2e-2 (weights re-rounded per channel); "vnni"
2e-2 (activations rounded to int8 per group of 16 or 32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from dynaspec.models.gguf_blocks import GroupedWeight, decode_blocks, random_blocks
from dynaspec.models.qlinear import (
    AMX_MIN_ROWS,
    NO_AMX,
    SCALE_F16,
    SCALE_F16_SYM,
    SCALE_F32,
    SCALE_SUPER,
    SCALE_SUPER_SYM,
    QuantLinear,
    default_path,
    kernel_error,
    quantize_dense,
)

ROWS = (1, 2, 3, 4, 8, 16, 32, 64)
OUT, IN = 80, 512  # 80 columns: not a multiple of the kernel's 32-column step
needs_kernel = pytest.mark.skipif(
    kernel_error() is not None, reason=f"C++ kernel unavailable: {kernel_error()}"
)


def _gguf_weight(qtype: T) -> GroupedWeight:
    """Blocks as a GGUF file holds them: quantized by gguf where it can, else random valid bytes."""
    if qtype in (T.Q4_0, T.Q8_0, T.Q5_0):
        x = np.random.default_rng(int(qtype)).standard_normal((OUT, IN)).astype(np.float32) * 0.05
        return decode_blocks(quants.quantize(x, qtype), qtype, (OUT, IN))
    return decode_blocks(random_blocks(qtype, (OUT, IN), seed=int(qtype)), qtype, (OUT, IN))


def _weight(kind: str) -> GroupedWeight:
    if kind.startswith("gguf_"):
        return _gguf_weight(T[kind[5:].upper()])
    g = torch.Generator().manual_seed(0)
    if kind == "q4_affine":  # Q4_K/Q4_1-like: uint8 codes with offsets, groups of 32
        return GroupedWeight(
            torch.randint(0, 16, (OUT, IN), generator=g, dtype=torch.uint8),
            torch.rand(OUT, IN // 32, generator=g) * 0.01,
            -torch.rand(OUT, IN // 32, generator=g) * 0.05,
            32,
            4,
        )
    if kind == "q4_sym":  # Q4_0-like
        return GroupedWeight(
            torch.randint(-8, 8, (OUT, IN), generator=g, dtype=torch.int8),
            torch.rand(OUT, IN // 32, generator=g) * 0.01,
            None,
            32,
            4,
        )
    if kind == "q6_k":  # signed 6-bit codes, groups of 16
        return GroupedWeight(
            torch.randint(-32, 32, (OUT, IN), generator=g, dtype=torch.int8),
            torch.rand(OUT, IN // 16, generator=g) * 0.003,
            None,
            16,
            6,
        )
    if kind == "q8_0":
        return GroupedWeight(
            torch.randint(-128, 128, (OUT, IN), generator=g, dtype=torch.int8),
            torch.rand(OUT, IN // 32, generator=g) * 0.001,
            None,
            32,
            8,
        )
    raise AssertionError(kind)


KINDS = (
    "q4_affine",
    "q4_sym",
    "q6_k",
    "q8_0",
    "gguf_q4_k",
    "gguf_q5_k",
    "gguf_q6_k",
    "gguf_q4_0",
    "gguf_q5_0",
    "gguf_q8_0",
)
CASES = [  # (path, compute dtype, weight kinds, tolerance)
    ("dense", torch.float32, KINDS, 1e-5),
    ("dense", torch.bfloat16, KINDS, 2e-2),
    ("int4", torch.float32, ("q4_affine", "q4_sym", "gguf_q4_k", "gguf_q4_0"), 1e-5),
    ("int4", torch.bfloat16, ("q4_affine", "q4_sym", "gguf_q4_k", "gguf_q4_0"), 2e-2),
    ("int8", torch.float32, KINDS, 2e-2),
    ("vnni", torch.float32, KINDS, 2e-2),
    ("vnni", torch.bfloat16, KINDS, 2e-2),
]


def _params():
    for path, dtype, kinds, tol in CASES:
        marks = [needs_kernel] if path == "vnni" else []
        for kind in kinds:
            yield pytest.param(path, dtype, kind, tol, id=f"{path}-{str(dtype)[6:]}-{kind}", marks=marks)


@pytest.mark.parametrize("path,dtype,kind,tol", list(_params()))
def test_path_matches_float_reference(path: str, dtype: torch.dtype, kind: str, tol: float) -> None:
    weight = _weight(kind)
    bias = torch.randn(OUT, generator=torch.Generator().manual_seed(1))
    layer = QuantLinear(weight, bias, path=path, dtype=dtype)
    x = torch.randn(max(ROWS), IN, generator=torch.Generator().manual_seed(2))
    ref = x.double() @ weight.dequantize().double().t() + bias.double()
    for rows in ROWS:
        y = layer(x[:rows].to(dtype))
        assert y.dtype == dtype and y.shape == (rows, OUT)
        err = ((y.double() - ref[:rows]).norm() / ref[:rows].norm()).item()
        assert err < tol, f"rows={rows}: relative error {err:.2e} >= {tol}"


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    "amx_min_rows", [NO_AMX, 1, AMX_MIN_ROWS], ids=["vnni-only", "amx-always", "default"]
)
def test_vnni_is_batch_invariant(kind: str, dtype: torch.dtype, amx_min_rows: int) -> None:
    """Row i alone (always the VNNI loop) equals row i inside a batch of any size, bitwise, whether
    the batch ran through the VNNI loop or AMX tiles (the default path's promise)."""
    layer = QuantLinear(_weight(kind), torch.randn(OUT), path="vnni")
    most = 130  # the general loop takes 64 rows at a time (kRowChunk): 130 ends on a 2-row chunk
    x = torch.randn(most, IN, generator=torch.Generator().manual_seed(3)).to(dtype)
    layer.impl.amx_min_rows = NO_AMX
    alone = torch.cat([layer(x[i : i + 1]) for i in range(most)])
    layer.impl.amx_min_rows = amx_min_rows
    for rows in (*ROWS, 5, 6, 7, 17, 28, 40, 65, 69, most):  # 5-7: AVX2's general loop just past 4 rows
        assert torch.equal(layer(x[:rows]), alone[:rows]), f"rows={rows}"


@needs_kernel
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K])
def test_vnni_is_batch_invariant_across_row_parts(qtype: T) -> None:
    """A wide layer's rows go in parts (kXqPartBytes: on AVX2, 192 rows of 8,960 inputs a part);
    300 rows span two parts there, and each row still equals itself alone."""
    shape = (64, 8960)
    layer = QuantLinear(decode_blocks(random_blocks(qtype, shape, 0), qtype, shape), path="vnni")
    x = torch.randn(300, shape[1], generator=torch.Generator().manual_seed(5))
    assert torch.equal(layer(x), torch.cat([layer(x[i : i + 1]) for i in range(len(x))]))


@needs_kernel
def test_default_path_is_the_kernel() -> None:
    assert default_path(_weight("q4_affine")) == "vnni"
    assert QuantLinear(_weight("q6_k")).path == "vnni"
    wide_groups = quantize_dense(torch.randn(8, 256), 4, group=64)  # a group size the kernel does not take
    assert default_path(wide_groups) == "int4"


@needs_kernel
def test_the_hot_path_follows_the_buffers_when_they_move() -> None:
    """The kernel's arguments are cached as plain attributes (fast calls); moving the buffers
    (`_apply`: .to(), .cpu(), ...) rebuilds them, so a call never reads a stale tensor."""
    layer = QuantLinear(_weight("gguf_q4_k"), bias=torch.randn(_weight("gguf_q4_k").shape[0]), path="vnni")
    x = torch.randn(3, layer.in_features)
    expected = layer(x)
    layer._apply(lambda t: t.clone())  # every buffer replaced by a copy
    assert layer._vnni[0] is layer.impl.packed and layer._bias is layer.bias
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)


@needs_kernel
def test_kernel_streams_the_smallest_exact_scales() -> None:
    kinds = ("q4_affine", "gguf_q4_k", "gguf_q6_k", "gguf_q8_0", "gguf_q5_0", "gguf_q5_1")
    layers = {kind: QuantLinear(_weight(kind), path="vnni") for kind in kinds}
    dense = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    for bits in (4, 8):  # re-quantized at load: float16 scales alone, 4.5 and 8.5 bits a weight
        layers[f"int{bits}"] = QuantLinear(quantize_dense(dense, bits), path="vnni")
    assert {kind: layer.impl.mode for kind, layer in layers.items()} == {
        "q4_affine": SCALE_F32,
        "gguf_q4_k": SCALE_SUPER,
        "gguf_q6_k": SCALE_SUPER_SYM,  # symmetric: the offsets are not stored
        "gguf_q8_0": SCALE_F16_SYM,
        "gguf_q5_0": SCALE_F16_SYM,
        "gguf_q5_1": SCALE_F16,
        "int4": SCALE_F16_SYM,
        "int8": SCALE_F16_SYM,
    }
    # one field a group for the symmetric types: Q8_0 streams 2 bytes of scale per 32 codes
    impl = layers["gguf_q8_0"].impl
    assert impl.scales_sub.numel() == impl.packed.shape[0] * impl.packed.shape[1] * impl.packed.shape[2] * 16


def test_quantize_dense_round_trips() -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    for bits in (4, 8):
        q = quantize_dense(w, bits)
        assert q.offsets is None and q.codes.dtype == torch.int8  # symmetric, as Q4_0 and Q8_0
        assert torch.equal(q.scales.half().float(), q.scales)  # float16 scales
        half = 2 ** (bits - 1)
        assert q.codes.min() >= -half and q.codes.max() <= half - 1
        # half a step from the value, but for the end the clamp cuts one code short (4 bits)
        step = q.scales.abs()[..., None] * (0.5 if bits == 8 else 1.0)  # Q4_0-style d may be negative
        err = (q.dequantize() - w).abs().view(64, 8, 32)
        assert (err <= step * 1.001 + 1e-7).all()
        assert (err <= q.scales.abs()[..., None] * 0.5 * 1.001 + 1e-7).float().mean() > 0.99
        # the group's value of largest magnitude is kept to float16's rounding of its scale
        biggest = w.view(64, 8, 32).abs().amax(-1)
        assert torch.allclose(q.dequantize().view(64, 8, 32).abs().amax(-1), biggest, rtol=1e-3)


def test_from_parts_and_leading_dims() -> None:
    weight = _weight("q4_affine")
    layer = QuantLinear.from_parts(
        weight.codes, weight.scales, weight.offsets, 32, path="dense", dtype=torch.float32
    )
    assert layer.impl.weight.shape == (OUT, IN)
    x = torch.randn(2, 3, IN)
    assert layer(x).shape == (2, 3, OUT)


def test_unknown_path_is_refused() -> None:
    with pytest.raises(ValueError, match="path"):
        QuantLinear(_weight("q8_0"), path="fp8")
    with pytest.raises(ValueError, match="int4"):
        QuantLinear(_weight("q8_0"), path="int4")


def test_from_gguf_reads_a_file(tmp_path) -> None:
    from gguf import GGUFReader, GGUFWriter

    raw = random_blocks(T.Q4_K, (OUT, IN))
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=T.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = GGUFReader(str(path)).tensors[0]
    layer = QuantLinear.from_gguf(tensor, path="dense", dtype=torch.float32)
    assert (layer.out_features, layer.in_features) == (OUT, IN)
    assert torch.equal(layer.impl.weight, decode_blocks(raw, T.Q4_K, (OUT, IN)).dequantize())


def test_without_the_kernel_the_built_in_paths_are_chosen(monkeypatch) -> None:
    from dynaspec.models import qlinear

    monkeypatch.setattr(qlinear, "kernel_error", lambda: "no compiler (test)")
    assert default_path(_weight("gguf_q4_k")) == "int4"
    assert default_path(_weight("gguf_q6_k")) == "int8"
    with pytest.raises(ValueError, match="no compiler"):
        QuantLinear(_weight("gguf_q4_k"), path="vnni")


@needs_kernel
@pytest.mark.parametrize("bits,group,n_in", [(4, 32, 160), (6, 16, 96), (8, 32, 224)])
def test_vnni_group_counts_off_the_amx_chunk(bits: int, group: int, n_in: int) -> None:
    """5, 6 and 7 groups per row: the AMX loop's last chunk is partial; still equal to the VNNI loop."""
    g = torch.Generator().manual_seed(5)
    lo = -(2 ** (bits - 1))
    codes = torch.randint(lo, -lo, (48, n_in), generator=g, dtype=torch.int16).to(torch.int8)
    weight = GroupedWeight(codes, torch.rand(48, n_in // group, generator=g) * 0.01, None, group, bits)
    layer = QuantLinear(weight, path="vnni")
    x = torch.randn(20, n_in, generator=g)
    layer.impl.amx_min_rows = 1
    amx = layer(x)
    layer.impl.amx_min_rows = NO_AMX
    assert torch.equal(amx, layer(x))
    ref = x.double() @ weight.dequantize().double().t()
    assert ((amx.double() - ref).norm() / ref.norm()).item() < 2e-2
    assert layer(x[:0]).shape == (0, 48)
