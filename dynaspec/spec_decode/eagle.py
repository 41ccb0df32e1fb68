"""Drafting with an EAGLE head (``"method": "eagle"`` or ``"eagle3"``) on the target's hidden states.

The runner returns the target's hidden states entering the layers the head reads
(``hidden_layers``) for every token it computes; ``read_hidden`` and ``commit`` keep, per request,
those of the positions that stay (a prefill chunk's, and a decode's last token and accepted
drafts). A step's drafting then:
1. catches up: one varlen head pass over each drafting request's kept positions p (reading the
   target's state at p and the token at p + 1), which writes the head's K/V for them and yields
   draft 1 at the last one;
2. chains: K - 1 passes of one token each, every one reading the head's own output at the
   previous position and the draft it drew there.
The chain's K/V (at positions the target has not confirmed) is overwritten by the next catch-up,
so the head's cache only ever holds K/V computed from the target's states. The cache is addressed
by the target's slots. Per-request K caps, confidence stops and sampled drafts drawn at the
target's uniforms work as for a draft model (draft_model.py).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from dynaspec.engine.kv_cache import allocate_kv_cache, fill_kv_noise, kv_bytes_per_token
from dynaspec.engine.sampler import (
    SamplingTensors,
    apply_penalties,
    coupled_draw,
    processed_probs,
    top_probability,
)
from dynaspec.engine.types import DraftPass, Drafts, SchedulePlan, StepResult
from dynaspec.models.attention import build_attention_metadata
from dynaspec.models.hugepages import place_on_huge_pages
from dynaspec.models.qlinear import kernel_error
from dynaspec.spec_decode.eagle_head import EAGLE, EAGLE3, load_eagle_head, quantize_head
from dynaspec.spec_decode.proposer import Proposer, ProposerContext, register_proposer


@dataclass(slots=True)
class HeadState:
    """What the head holds of one request: K/V for the positions before ``first``, and the target's
    hidden states of the positions from ``first`` on that it has not read yet."""

    first: int
    pending: list[torch.Tensor] = field(default_factory=list)  # [m, len(layers) * H] chunks, in order

    @property
    def end(self) -> int:
        """The position after the last pending one."""
        return self.first + sum(len(rows) for rows in self.pending)


@dataclass(slots=True)
class DraftDraw:
    """The draws of one drafting position for the rows that still draft there."""

    tokens: torch.Tensor  # [num_decodes, k] int64, filled column by column
    lens: list[int]  # [num_decodes] drafts kept so far
    confidence: list[list[float]]  # [num_decodes][lens[i]] the drafter's top probability per draft


def draw_position(
    logits: torch.Tensor,  # [len(rows), vocab] float32 (with to_target: over the head's cut ids)
    rows: list[int],  # the decodes drafting at position j
    j: int,
    draw: DraftDraw,
    sampling: SamplingTensors,
    min_confidence: float,
    to_target: torch.Tensor | None = None,  # [cut vocab] the target id of each of the logits' ids
) -> None:
    """Draft j of each row in ``rows``: the most likely token for greedy requests, for sampled ones a
    draw at the uniform the target draws its token j from (rejection.py), after the request's
    penalties; a row keeps it unless the drafter's top probability is below ``min_confidence``.
    Logits over a cut vocabulary (``to_target``) take only greedy draws without penalties: the ids
    outside it have probability 0, so the top and its probability are the same."""
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits = logits[:, None, :]  # [len(rows), 1, vocab]
    if to_target is not None and not (sampling.all_greedy and sampling.penalties is None):
        raise ValueError("draw_position: cut logits take greedy draws without penalties only")
    if sampling.penalties is not None:  # draft j's context: the output and drafts 0..j-1
        logits = apply_penalties(logits, sampling.penalties.rows(idx), draw.tokens.index_select(0, idx), j)
    if sampling.all_greedy:
        probability, top = top_probability(logits[:, 0])  # [len(rows)] each
        draw.tokens[idx, j] = top if to_target is None else to_target[top]
    else:
        at = sampling.rows(idx)
        q = processed_probs(logits, at.temperature, at.top_k, at.top_p)[:, 0]  # [len(rows), vocab]
        probability, top = q.max(-1)
        drawn = coupled_draw(q, at.seeds, at.positions + j)  # [len(rows)]
        draw.tokens[:, j].index_copy_(0, idx, torch.where(at.temperature > 0, drawn, top))
    for row, p in zip(rows, probability.tolist()):
        if p >= min_confidence:
            draw.lens[row] = j + 1
            draw.confidence[row].append(p)


@register_proposer(EAGLE)
@register_proposer(EAGLE3)
class EagleProposer(Proposer):
    def __init__(self, spec_config, ctx: ProposerContext) -> None:
        super().__init__(ctx)
        target = ctx.target_config
        if target is None or ctx.target_embed is None or ctx.target_logits is None:
            raise ValueError(f"speculative_config.method: {spec_config.method} needs the target's layers")
        self.head = load_eagle_head(spec_config.model, spec_config.method, target, ctx.dtype, ctx.device)
        self.dtype = self.head.fc.weight.dtype  # the head's activations (its linears may be quantized)
        quantize_head(self.head, spec_config.drafter_quantization(ctx.device.type, ctx.quantization))
        self.huge_pages = place_on_huge_pages([self.head], ctx.device)  # CPU weights in 2 MiB pages
        self.embed = self.head.embed_tokens if self.head.embed_tokens is not None else ctx.target_embed
        self.vocab_size = target.vocab_size
        self.kv_dtype = ctx.kv_dtype or ctx.dtype
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.rowwise = (
            ctx.device.type == "cpu"
            and self.kv_dtype in (torch.float32, torch.bfloat16)
            and kernel_error() is None
        )
        self.states: dict[str, HeadState] = {}
        # of the step being verified: the target's states and the rows each decode computed
        self.step_hidden: torch.Tensor | None = None
        self.step_lens: list[int] = []

    def hidden_layers(self) -> tuple[int, ...]:
        return self.head.config.target_layers

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.head.config.layer, self.kv_dtype)

    def allocate_kv(self, num_slots: int) -> None:
        (self.kv_cache,) = allocate_kv_cache(
            self.head.config.layer, num_slots, self.kv_dtype, self.ctx.device
        )

    def pays_for_unfilled_positions(self) -> bool:
        return True  # the pass at a stopped position ran before its confidence stopped it

    def unseen_tokens(self, request) -> int:
        state = self.states.get(request.request_id)
        return max(1, request.num_tokens - 1 - (state.first if state is not None else 0))

    def catchup_tokens(self, context_tokens: int) -> int:
        return context_tokens

    def read_hidden(self, plan: SchedulePlan, drafts: Drafts, hidden: torch.Tensor | None) -> None:
        self.step_hidden, self.step_lens = hidden, list(drafts.draft_lens)

    def commit(self, plan: SchedulePlan, result: StepResult) -> None:
        """Keep the target's states of the positions that stay: each decode's last token and
        accepted drafts, each prefill chunk's tokens (the runner's row order)."""
        hidden, self.step_hidden = self.step_hidden, None
        if hidden is None:
            return
        at = 0
        for r, n, accepted in zip(plan.decodes, self.step_lens, result.num_accepted):
            # runs before the scheduler appends: num_computed_tokens is the last token's position
            self._keep(r.request_id, r.num_computed_tokens, hidden[at : at + 1 + accepted].clone())
            at += 1 + n
        for chunk in plan.prefills:
            r = chunk.request
            self._keep(r.request_id, r.num_computed_tokens, hidden[at : at + chunk.num_tokens])
            at += chunk.num_tokens

    def _keep(self, request_id: str, start: int, rows: torch.Tensor) -> None:
        """Keep ``rows``, the target's states of positions ``start``.. of a request."""
        state = self.states.get(request_id)
        if state is None or state.end != start:  # new (its head K/V before `start` is not there)
            state = self.states[request_id] = HeadState(start)
        state.pending.append(rows)

    def assume_read(self, request, num_tokens: int, slots: torch.Tensor) -> None:
        # the head's K/V of the skipped positions: noise (the target's states of the prefilled rest
        # start the request's state at num_tokens, as after a prefill chunk)
        if self.kv_cache is not None:
            fill_kv_noise([self.kv_cache], slots)

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)

    def propose(self, plan: SchedulePlan, sampling: SamplingTensors) -> Drafts:
        """Up to ``k_caps[i]`` drafts per decode: a catch-up pass yielding draft 1, then one head
        pass per position over the rows still drafting (a confidence stop ends a row's drafts)."""
        if plan.k == 0:
            return self.no_drafts(plan)
        device = self.ctx.device
        draw = DraftDraw(
            torch.zeros(plan.num_decodes, plan.k, dtype=torch.long, device=device),
            [0] * plan.num_decodes,
            [[] for _ in range(plan.num_decodes)],
        )
        passes: list[DraftPass] = []
        active = [i for i, cap in enumerate(plan.k_caps) if cap > 0 and self._caught_up(plan.decodes[i])]
        if not active:
            return Drafts(draw.tokens, draw.lens, passes, draw.confidence)
        # a greedy draw without penalties reads a cut head's own ids: no logits over the full vocabulary
        full = not (self.head.cut and sampling.all_greedy and sampling.penalties is None)
        to_target = None if full else self.head.draft_to_target
        start = time.perf_counter()
        logits, state, extra = self._catch_up([plan.decodes[i] for i in active], full)
        passes.append(DraftPass(len(active), extra, self._elapsed_ms(start)))
        draw_position(logits, active, 0, draw, sampling, plan.min_draft_confidence, to_target)
        for j in range(1, plan.k):
            keep = [row for row, i in enumerate(active) if plan.k_caps[i] > j and draw.lens[i] == j]
            if not keep:
                break
            active = [active[row] for row in keep]
            start = time.perf_counter()
            state = state[torch.tensor(keep, dtype=torch.long, device=device)]
            decodes = [plan.decodes[i] for i in active]
            ids = draw.tokens[active, j - 1]  # [len(active)] the drafts drawn at j - 1
            positions = [r.num_tokens - 2 + j for r in decodes]  # the head reads draft j - 1 here
            tables = [r.block_ids for r in decodes]
            out, state = self._pass(ids, state, positions, [1] * len(active), tables)
            logits = self.head.draft_logits(out, self.ctx.target_logits, self.vocab_size, full)
            passes.append(DraftPass(len(active), 0, self._elapsed_ms(start)))
            draw_position(logits, active, j, draw, sampling, plan.min_draft_confidence, to_target)
        return Drafts(draw.tokens, draw.lens, passes, draw.confidence)

    def _caught_up(self, request) -> bool:
        """Whether the head holds the target's states of every position before the last token's."""
        state = self.states.get(request.request_id)
        return state is not None and state.first < request.num_tokens - 1 <= state.end

    def _catch_up(self, decodes: list, full: bool = True) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One head pass over each request's positions from ``first`` to the one before its last
        token, on the target's states and the tokens after them: the logits [len(decodes), vocab]
        (``full`` False: over a cut head's own ids) and the head's states [len(decodes), H] at each
        request's last position (draft 1, and what the chain goes on from), and the tokens read
        beyond one a request."""
        hidden, ids, positions, lens = [], [], [], []
        for r in decodes:
            state = self.states[r.request_id]
            m = r.num_tokens - 1 - state.first
            hidden.append(torch.cat(state.pending)[:m])
            ids.extend(r.token_at(state.first + 1, r.num_tokens))
            positions.extend(range(state.first, state.first + m))
            lens.append(m)
            self.states[r.request_id] = HeadState(r.num_tokens - 1)
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.ctx.device)
        tables = [r.block_ids for r in decodes]
        out, state = self._pass(ids_t, torch.cat(hidden), positions, lens, tables)
        last = torch.tensor(lens, device=self.ctx.device).cumsum(0) - 1
        logits = self.head.draft_logits(out[last], self.ctx.target_logits, self.vocab_size, full)
        return logits, state[last], len(ids) - len(decodes)

    def _pass(
        self,
        ids: torch.Tensor,  # [n] the tokens after each position
        hidden: torch.Tensor,  # [n, len(layers) * H] the target's, or [n, H] the head's own
        positions: list[int],  # [n]
        lens: list[int],  # per request: its positions in this pass (consecutive, ending at its last)
        block_tables: list[list[int]],  # per request: the target's blocks
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [n, H] what the LM head reads, what the next position reads
        ends = list(itertools.accumulate(lens))  # each request's last row + 1
        ctx_lens = [positions[end - 1] + 1 for end in ends]
        meta = build_attention_metadata(
            lens, ctx_lens, block_tables, self.ctx.block_size, self.ctx.device, rowwise=self.rowwise
        )
        with torch.inference_mode():
            embeds = self.embed(ids).to(self.dtype)
        pos = torch.tensor(positions, dtype=torch.long, device=self.ctx.device)
        return self.head(embeds, hidden.to(embeds.dtype), pos, self.kv_cache, meta)

    def catch_up(self, prompts: list[list[int]], block_tables: list[list[int]]) -> float:
        """A head pass over whole prompts (on zero target states: the cost is the same)."""
        width = len(self.hidden_layers()) * self.head.config.hidden_size
        ids = torch.tensor(
            [t for p in prompts for t in p[1:] + p[-1:]], dtype=torch.long, device=self.ctx.device
        )
        hidden = torch.zeros(len(ids), width, dtype=self.dtype, device=self.ctx.device)
        positions = [i for p in prompts for i in range(len(p))]
        start = time.perf_counter()
        self._pass(ids, hidden, positions, [len(p) for p in prompts], block_tables)
        return self._elapsed_ms(start)

    def stats(self) -> dict:
        return {"pending_positions": sum(s.end - s.first for s in self.states.values())}

    def _elapsed_ms(self, start: float) -> float:
        if self.ctx.device.type == "cuda":  # kernels are asynchronous: time what really ran
            torch.cuda.synchronize(self.ctx.device)
        return (time.perf_counter() - start) * 1000
