"""Weight-only int8 for a drafter: cheaper draft steps, and the verifier keeps outputs lossless.

Decode is bound by reading weights: per-channel symmetric int8 halves the bytes of bfloat16, and
PyTorch's packed int8 kernel runs a 1-row matmul about 3x faster than bf16 on CPU. For many rows
(a catch-up prefill) the dense kernel wins, so each layer keeps its dense weight too and picks by
the number of rows. Only ever applied to a draft model: drafts may be anything, the target's
verification decides what is emitted.
"""

from __future__ import annotations

import torch
from torch import nn

# rows above which the dense bf16 matmul beats the packed int8 kernel (measured on a 2-core AVX-512 CPU)
INT8_MAX_ROWS = 8


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        scales = w.float().abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
        self.register_buffer(
            "weight_int8", (w.float() / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        )
        self.register_buffer("scales", scales.to(w.dtype))
        self.dense = linear  # shares the original parameters (tied heads stay tied)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] > INT8_MAX_ROWS:
            return self.dense(x)
        out = torch.ops.aten._weight_int8pack_mm(flat.contiguous(), self.weight_int8, self.scales)
        if self.dense.bias is not None:
            out = out + self.dense.bias
        return out.view(*x.shape[:-1], out.shape[-1])


def quantize_int8_(model: nn.Module) -> nn.Module:
    """Swap every nn.Linear (the LM head included) for an Int8Linear, in place."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child))
        else:
            quantize_int8_(child)
    return model
