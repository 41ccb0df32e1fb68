"""Turning logits into the distribution a request samples from (pure functions)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynaspec.engine.request import Request


@dataclass(slots=True)
class SamplingTensors:
    temperature: torch.Tensor  # [batch] float32; 0 for greedy rows
    top_k: torch.Tensor  # [batch] int64; 0 disables
    top_p: torch.Tensor  # [batch] float32
    generators: list[torch.Generator]  # [batch] one per request, for reproducible seeds
    all_greedy: bool

    @classmethod
    def of(cls, requests: list[Request], device: torch.device) -> SamplingTensors:
        params = [r.params for r in requests]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            generators=[r.generator for r in requests],
            all_greedy=all(p.greedy for p in params),
        )


def processed_probs(
    logits: torch.Tensor,  # [batch, positions, vocab] float32
    temperature: torch.Tensor,  # [batch]
    top_k: torch.Tensor,  # [batch]
    top_p: torch.Tensor,  # [batch]
) -> torch.Tensor:  # [batch, positions, vocab] float32
    """Softmax after temperature, top-k and top-p; greedy rows become one-hot at the argmax."""
    greedy = temperature == 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / t[:, None, None]
    vocab = logits.shape[-1]
    need_k = bool(((top_k > 0) & (top_k < vocab)).any())
    need_p = bool((top_p < 1.0).any())
    if need_k or need_p:
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if need_k:
            k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
            rank = torch.arange(vocab, device=logits.device)
            drop |= rank[None, None, :] >= k[:, None, None]
        if need_p:
            sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
            before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
            drop |= before >= top_p[:, None, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(-1, sorted_idx, sorted_logits)
    probs = scaled.softmax(-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None, None], one_hot, probs)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator) -> int:  # probs: [vocab]
    return int(torch.multinomial(probs, 1, generator=generator))
