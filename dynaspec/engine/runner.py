"""Runs one model (target or draft) over a varlen batch of token runs against the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynaspec.engine.kv_cache import allocate_kv_cache
from dynaspec.engine.types import Drafts, SchedulePlan
from dynaspec.models.attention import build_attention_metadata
from dynaspec.models.llama import LlamaModel
from dynaspec.models.qlinear import kernel_error


@dataclass(slots=True)
class TokenRun:
    """New tokens of one sequence: they sit at positions start.. and attend to everything before."""

    token_ids: list[int]
    start: int
    block_ids: list[int]
    logit_rows: list[int]  # offsets within token_ids whose logits are wanted


class ModelRunner:
    def __init__(
        self, model: LlamaModel, num_slots: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_caches = allocate_kv_cache(model.config, num_slots, dtype, device)
        # row-wise attention (batch invariant) where its C++ kernel runs
        self.rowwise = (
            device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and kernel_error() is None
        )

    def forward(
        self, plan: SchedulePlan, drafts: Drafts
    ) -> torch.Tensor:  # [len(plan.sampled), k + 1, vocab]
        """The target's pass for a step: each decode's last token and drafts, then the prefill chunks.

        Row i of the result holds the logits of ``plan.sampled[i]``: a decode's last token and
        its draft tokens, or a completing prefill's last prompt token (rows past what a request
        verifies are zero).
        """
        runs = []
        draft_rows = drafts.token_ids.tolist()  # one copy to the host for the whole batch
        for r, row, n in zip(plan.decodes, draft_rows, drafts.draft_lens):
            last = r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1]
            runs.append(TokenRun([last] + row[:n], r.num_computed_tokens, r.block_ids, list(range(n + 1))))
        for chunk in plan.prefills:
            r = chunk.request
            start = r.num_computed_tokens
            rows = [chunk.num_tokens - 1] if chunk.completes else []
            runs.append(TokenRun(r.token_at(start, start + chunk.num_tokens), start, r.block_ids, rows))
        flat = self.run(runs)  # [sum of logit rows, vocab]
        lengths = [len(run.logit_rows) for run in runs if run.logit_rows]
        out = flat.new_zeros(len(lengths), drafts.k + 1, flat.shape[-1])
        for i, piece in enumerate(flat.split(lengths)):
            out[i, : len(piece)] = piece
        return out

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
            rowwise=self.rowwise,
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_caches,
            meta,
        )
        rows_t = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows_t))
