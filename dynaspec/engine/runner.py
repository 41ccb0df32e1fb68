"""Runs one model (target or draft) over a varlen batch of token runs against the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynaspec.engine.kv_cache import allocate_kv_cache
from dynaspec.models.attention import build_attention_metadata
from dynaspec.models.llama import LlamaModel


@dataclass(slots=True)
class TokenRun:
    """New tokens of one sequence: they sit at positions start.. and attend to everything before."""

    token_ids: list[int]
    start: int
    block_ids: list[int]
    logit_rows: list[int]  # offsets within token_ids whose logits are wanted


class ModelRunner:
    def __init__(self, model: LlamaModel, num_slots: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_caches = allocate_kv_cache(model.config, num_slots, dtype, device)

    def run(self, runs: list[TokenRun]) -> torch.Tensor:  # [sum(len(r.logit_rows)), vocab] float32
        """One forward pass over all runs; logits for the requested rows, in run order."""
        ids, positions, rows = [], [], []
        for r in runs:
            rows.extend(len(ids) + o for o in r.logit_rows)
            ids.extend(r.token_ids)
            positions.extend(range(r.start, r.start + len(r.token_ids)))
        meta = build_attention_metadata(
            [len(r.token_ids) for r in runs],
            [r.start + len(r.token_ids) for r in runs],
            [r.block_ids for r in runs],
            self.block_size,
            self.device,
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_caches,
            meta,
        )
        return self.model.compute_logits(hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=self.device)))
