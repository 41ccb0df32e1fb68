"""Runs one model (target or draft) over a varlen batch of token runs against the paged KV cache."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dynaspec.engine.kv_cache import allocate_kv_cache, cdiv
from dynaspec.engine.static_pass import (
    NO_SLOT,
    Field,
    PassGraphs,
    StaticInputs,
    batch_buckets,
    block_table_rows,
    bucket_of,
    slots_of,
)
from dynaspec.engine.types import Drafts, PromptLogits, SchedulePlan, TargetLogits
from dynaspec.heap import reuse_freed_memory
from dynaspec.models import fused_ops
from dynaspec.models.attention import AttentionMetadata, DecodeMetadata, build_attention_metadata
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
        self,
        model: LlamaModel,
        num_slots: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        hidden_layers: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        # the layers whose entering hidden states ``forward`` returns (a proposer reading the
        # target's own states, Proposer.hidden_layers); empty: none, at no cost
        self.hidden_layers = hidden_layers
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
        self.num_slots = num_slots
        self.static: StaticDecoder | None = None  # decode-only steps on fixed shapes (enable_static)
        self.observer: Callable[[SchedulePlan, TargetLogits], None] | None = None  # observe()

    def observe(
        self, layers: tuple[int, ...], fn: Callable[[SchedulePlan, TargetLogits], None] | None
    ) -> None:
        """Hand each step's plan and the target's pass to ``fn``, with the hidden states entering
        ``layers`` (``dynaspec train-draft`` records the target's answers so); None stops it. Not
        with a proposer that reads hidden states of its own."""
        if fn is None:
            self.observer, self.hidden_layers = None, ()
            return
        if self.hidden_layers and self.observer is None:
            raise ValueError("observe: the proposer reads the target's hidden states already")
        self.observer, self.hidden_layers = fn, tuple(layers)

    def enable_static(self, max_num_seqs: int, max_width: int, max_model_len: int) -> StaticDecoder:
        """Run decode-only steps on fixed shapes from now on (``StaticDecoder``)."""
        self.static = StaticDecoder(self, max_num_seqs, max_width, max_model_len)
        return self.static

    def forward(self, plan: SchedulePlan, drafts: Drafts) -> TargetLogits:
        """The target's pass for a step (``_forward``), shown to the observer if there is one."""
        out = self._forward(plan, drafts)
        if self.observer is not None:
            self.observer(plan, out)
        return out

    def _forward(self, plan: SchedulePlan, drafts: Drafts) -> TargetLogits:
        """The target's pass for a step: each decode's last token and drafts, then the prefill chunks.

        Row i of ``sampled`` holds the logits of ``plan.sampled[i]``: a decode's last token and its
        draft tokens, or a completing prefill's last prompt token (rows past what a request
        verifies are zero). Prefill chunks of requests that score their prompt also return the
        logits of the positions that predict prompt tokens not scored yet. With ``hidden_layers``
        the hidden states of every token of the pass come back too (``TargetLogits.hidden``), and
        decode-only steps take the varlen pass rather than the fixed-shape one.
        """
        if self.static is not None and not self.hidden_layers and self.static.takes(plan, drafts):
            return TargetLogits(self.static.verify(plan, drafts))
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
        hidden = None  # [tokens of the pass, len(hidden_layers) * hidden]
        if self.hidden_layers:
            flat, hidden = self.run_capture(runs, self.hidden_layers)
        else:
            flat = self.run(runs)  # [sum of logit rows, vocab]
        sampled_rows = [run.logit_rows[n:] for run, n in zip(runs, scored)]
        width = drafts.k + 1
        if not any(scored) and all(len(rows) == width for rows in sampled_rows):
            return TargetLogits(flat.view(len(runs), width, flat.shape[-1]), hidden=hidden)  # no padding
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
        return TargetLogits(out, prompts, hidden)

    def run(self, runs: list[TokenRun], hidden: bool = False) -> torch.Tensor:
        """One forward pass over all runs; logits for the requested rows, in run order
        ([sum(len(r.logit_rows)), vocab] float32), or with ``hidden`` the final hidden states the
        head would read ([rows, hidden_size])."""
        ids, positions, rows, meta = self._inputs(runs)
        states = self.model(ids, positions, self.kv_caches, meta)
        picked = states.index_select(0, rows)
        return picked if hidden else self.model.compute_logits(picked)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block's K/V in every layer (a shared block unshared)."""
        bs = self.block_size
        src = torch.tensor([s * bs + o for s, _ in pairs for o in range(bs)], device=self.device)
        dst = torch.tensor([d * bs + o for _, d in pairs for o in range(bs)], device=self.device)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def run_capture(
        self, runs: list[TokenRun], layer_ids: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [logit rows, vocab] float32, [tokens, len(layer_ids) * hidden]
        """``run``, also returning the hidden states entering the layers ``layer_ids`` for every
        token of the pass (``LlamaModel.forward_capture``)."""
        ids, positions, rows, meta = self._inputs(runs)
        states, hidden = self.model.forward_capture(ids, positions, self.kv_caches, meta, layer_ids)
        return self.model.compute_logits(states.index_select(0, rows)), hidden

    def _inputs(
        self, runs: list[TokenRun]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids and positions [tokens], the logit rows [rows] and the attention metadata of a pass."""
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
        device = self.device
        return (
            torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            torch.tensor(rows, dtype=torch.long, device=device),
            meta,
        )


class StaticDecoder:
    """The target's decode-only steps on fixed shapes: each decode's last token and ``width - 1``
    draft positions (a row's positions past its drafts are padding), its requests padded to a
    batch bucket; one pinned copy of the inputs, the drafts copied in on the device, then the pass
    (a CUDA graph replay where captured). Steps with prefill chunks run the varlen pass."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_width: int, max_model_len: int) -> None:
        self.runner = runner
        self.model = runner.model
        self.buckets = batch_buckets(max_num_seqs)
        self.max_width = max_width  # tokens per row: 1 + the largest K
        self.max_blocks = cdiv(max_model_len, runner.block_size)
        device = runner.device
        rows = self.buckets[-1] * max_width
        self.inputs = StaticInputs(rows * 3 + self.buckets[-1] * (1 + self.max_blocks), device)
        head = self.model.lm_head.weight
        self.logits = torch.empty(rows, self.model.config.vocab_size, dtype=head.dtype, device=device)
        self.graphs = PassGraphs(device)

    def fields(self, b: int, width: int) -> list[Field]:
        return [
            Field("ids", (b, width)),
            Field("positions", (b, width)),
            Field("slots", (b, width)),
            Field("seq_lens", (b,)),
            Field("block_table", (b, self.max_blocks)),
        ]

    def takes(self, plan: SchedulePlan, drafts: Drafts) -> bool:
        return not plan.prefills and drafts.k + 1 <= self.max_width and plan.num_decodes <= self.buckets[-1]

    def verify(self, plan: SchedulePlan, drafts: Drafts) -> torch.Tensor:
        """Logits [num_decodes, k + 1, vocab] (the head's dtype) of each decode's window."""
        b, width = plan.num_decodes, drafts.k + 1
        rows = bucket_of(b, self.buckets)
        fields = self.fields(rows, width)
        host_drafts = drafts.token_ids.device.type == "cpu"
        ids = np.zeros((rows, width), dtype=np.int64)
        starts = np.zeros(rows, dtype=np.int64)
        lens = np.zeros(rows, dtype=np.int64)  # positions each row verifies (1 + its drafts)
        for i, r in enumerate(plan.decodes):
            ids[i, 0] = r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1]
            starts[i] = r.num_computed_tokens
            lens[i] = 1 + drafts.draft_lens[i]
        if host_drafts and drafts.k:
            ids[:b, 1:] = drafts.token_ids.numpy()
        offsets = np.arange(width)
        positions = starts[:, None] + offsets[None, :]
        table = block_table_rows([r.block_ids for r in plan.decodes], rows, self.max_blocks)
        slots = slots_of(table, positions, self.runner.block_size)
        slots[offsets[None, :] >= lens[:, None]] = NO_SLOT
        seq_lens = starts + width
        seq_lens[b:] = width  # padding rows see block 0
        arrays = {
            "ids": ids,
            "positions": positions,
            "slots": slots,
            "seq_lens": seq_lens,
            "block_table": table,
        }
        self.inputs.load(fields, arrays)
        if drafts.k and not host_drafts:
            self.inputs.views(fields)["ids"][:b, 1:].copy_(drafts.token_ids)
        out = self.graphs.run((rows, width), lambda: self._pass(rows, width))
        return out.view(rows, width, -1)[:b]

    def _pass(self, rows: int, width: int) -> torch.Tensor:  # [rows * width, vocab]
        """The pass over the static buffers (what a graph records)."""
        v = self.inputs.views(self.fields(rows, width))
        meta = DecodeMetadata(
            v["slots"].view(-1).long(), v["block_table"], v["seq_lens"], width, self.runner.block_size
        )
        ids, positions = v["ids"].view(-1), v["positions"].view(-1)
        hidden = self.model.forward_decode(ids, positions, self.runner.kv_caches, meta)
        return head_into(self.model, hidden, self.logits[: rows * width])

    def capture(self, pool) -> None:
        """Graphs for every bucket and width, largest first, into ``pool``."""
        for rows in reversed(self.buckets):
            for width in range(self.max_width, 0, -1):
                self.graphs.capture((rows, width), functools.partial(self._pass, rows, width), pool)


@torch.inference_mode()
def head_into(model: LlamaModel, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The head's logits of ``hidden`` [rows, hidden] written into ``out`` [rows, vocab] (no new
    tensor where the head is a plain matrix)."""
    head = model.lm_head
    if isinstance(head, nn.Linear) and head.bias is None and head.weight.dtype == hidden.dtype:
        return fused_ops.linear(hidden, head.weight, out=out)
    return out.copy_(head(hidden))


class StaticChain:
    """A drafter's passes of a step on fixed shapes, as one replay: a catch-up pass over the last
    ``CATCHUP_TOKENS`` tokens of each row (earlier unseen tokens are read beforehand by a varlen
    pass), then ``k - 1`` passes of one token, each fed the previous pass's most likely token.
    Returns each pass's most likely token and its probability, per row."""

    CATCHUP_TOKENS = 2  # steady state: the recovered token, or the last draft and the bonus token

    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_k: int, max_model_len: int) -> None:
        self.runner = runner
        self.model = runner.model
        self.buckets = batch_buckets(max_num_seqs)
        self.max_k = max_k
        self.max_blocks = cdiv(max_model_len, runner.block_size)
        rows, device = self.buckets[-1], runner.device
        c = self.CATCHUP_TOKENS
        self.inputs = StaticInputs(rows * (3 * c + 2 + 3 * max_k + self.max_blocks), device)
        self.tokens = torch.zeros(rows, max_k, dtype=torch.long, device=device)  # [rows, max_k]
        self.confidence = torch.zeros(rows, max_k, dtype=torch.float32, device=device)  # [rows, max_k]
        self.graphs = PassGraphs(device)

    def fields(self, b: int, k: int) -> list[Field]:
        c = self.CATCHUP_TOKENS
        return [
            Field("ids", (b, c)),  # the catch-up pass
            Field("positions", (b, c)),
            Field("slots", (b, c)),
            Field("seq_lens", (b,)),
            Field("caps", (b,)),  # draft tokens each row may keep
            Field("next_positions", (k - 1, b)),  # passes 1 .. k - 1
            Field("next_slots", (k - 1, b)),
            Field("next_seq_lens", (k - 1, b)),
            Field("block_table", (b, self.max_blocks)),
        ]

    def takes(self, num_rows: int, k: int) -> bool:
        return 1 <= k <= self.max_k and num_rows <= self.buckets[-1]

    def run(self, rows: int, k: int, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Load the inputs ([rows] padded to a bucket by the caller) and run the chain: tokens and
        confidence [rows, k], and the caps on the device [rows]."""
        fields = self.fields(rows, k)
        self.inputs.load(fields, arrays)
        self.graphs.run((rows, k), lambda: self._pass(rows, k))
        caps = self.inputs.views(fields)["caps"]
        return {"tokens": self.tokens[:rows, :k], "confidence": self.confidence[:rows, :k], "caps": caps}

    def _pass(self, rows: int, k: int) -> None:
        """The chain over the static buffers (what a graph records)."""
        v = self.inputs.views(self.fields(rows, k))
        c, block_size, window = self.CATCHUP_TOKENS, self.runner.block_size, self.runner.window
        caches = self.runner.kv_caches
        table = v["block_table"]
        meta = DecodeMetadata(v["slots"].view(-1).long(), table, v["seq_lens"], c, block_size, window)
        hidden = self.model.forward_decode(v["ids"].view(-1), v["positions"].view(-1), caches, meta)
        hidden = hidden.view(rows, c, -1)[:, -1]  # [rows, hidden]
        for j in range(k):
            if j:
                slots, seq_lens = v["next_slots"][j - 1].long(), v["next_seq_lens"][j - 1]
                meta = DecodeMetadata(slots, table, seq_lens, 1, block_size, window)
                ids = self.tokens[:rows, j - 1]
                hidden = self.model.forward_decode(ids, v["next_positions"][j - 1], caches, meta)
            ids, prob = fused_ops.top1(self.model.decode_logits(hidden))  # [rows] each
            self.tokens[:rows, j] = ids
            self.confidence[:rows, j] = prob

    def capture(self, pool) -> None:
        """Graphs for every bucket and K, largest first, into ``pool``."""
        for rows in reversed(self.buckets):
            for k in range(self.max_k, 0, -1):
                self.graphs.capture((rows, k), functools.partial(self._pass, rows, k), pool)
