"""Runs one model (target or draft) over a varlen batch of token runs against the paged KV cache."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dynaspec.engine.kv_cache import allocate_kv_cache
from dynaspec.engine.types import Drafts, PromptLogits, SchedulePlan, TargetLogits
from dynaspec.heap import reuse_freed_memory
from dynaspec.models.attention import build_attention_metadata
from dynaspec.models.llama import LlamaModel
from dynaspec.models.qlinear import kernel_error

log = logging.getLogger(__name__)


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
        if device.type == "cpu":
            reuse_freed_memory()
        # row-wise attention (batch invariant) where its C++ kernel runs
        self.rowwise = (
            device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and kernel_error() is None
        )
        # a drafter's draft_context_window: each token sees the sinks and the last `window` tokens
        self.window: int | None = None

    def forward(self, plan: SchedulePlan, drafts: Drafts) -> TargetLogits:
        """The target's pass for a step: each decode's last token and drafts, then the prefill chunks.

        Row i of ``sampled`` holds the logits of ``plan.sampled[i]``: a decode's last token and its
        draft tokens, or a completing prefill's last prompt token (rows past what a request
        verifies are zero). Prefill chunks of requests that score their prompt also return the
        logits of the positions that predict prompt tokens not scored yet.
        """
        runs, owners, scored = [], [], []  # scored: logit rows of each run that score prompt tokens
        draft_rows = drafts.token_ids.tolist()  # one copy to the host for the whole batch
        for r, row, n in zip(plan.decodes, draft_rows, drafts.draft_lens):
            last = r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1]
            runs.append(TokenRun([last] + row[:n], r.num_computed_tokens, r.block_ids, list(range(n + 1))))
            owners.append(r)
            scored.append(0)
        for chunk in plan.prefills:
            r = chunk.request
            start = r.num_computed_tokens
            score = r.prompt_offsets_to_score(start, chunk.num_tokens)
            rows = list(score) + ([chunk.num_tokens - 1] if chunk.completes else [])
            runs.append(TokenRun(r.token_at(start, start + chunk.num_tokens), start, r.block_ids, rows))
            owners.append(r)
            scored.append(len(score))
        flat = self.run(runs)  # [sum of logit rows, vocab]
        sampled_rows = [run.logit_rows[n:] for run, n in zip(runs, scored)]
        width = drafts.k + 1
        if not any(scored) and all(len(rows) == width for rows in sampled_rows):
            return TargetLogits(flat.view(len(runs), width, flat.shape[-1]))  # no padding
        out = flat.new_empty(sum(1 for rows in sampled_rows if rows), width, flat.shape[-1])
        prompts, row, at = [], 0, 0
        for run, r, n, rows in zip(runs, owners, scored, sampled_rows):
            if n:
                first = run.start + run.logit_rows[0] + 1  # the first prompt token these rows predict
                targets = r.prompt_token_ids[first : first + n]
                prompts.append(PromptLogits(r.request_id, flat[at : at + n], targets))
            if rows:
                out[row, : len(rows)] = flat[at + n : at + n + len(rows)]
                out[row, len(rows) :] = 0
                row += 1
            at += n + len(rows)
        return TargetLogits(out, prompts)

    def run(self, runs: list[TokenRun], hidden: bool = False) -> torch.Tensor:
        """One forward pass over all runs; logits for the requested rows, in run order
        ([sum(len(r.logit_rows)), vocab] float32), or with ``hidden`` the final hidden states the
        head would read ([rows, hidden_size])."""
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
            window=self.window,
        )
        states = self.model(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_caches,
            meta,
        )
        rows_t = torch.tensor(rows, dtype=torch.long, device=self.device)
        picked = states.index_select(0, rows_t)
        return picked if hidden else self.model.compute_logits(picked)
