"""Drafting with a smaller model of the same family, for the whole batch at once.

The drafter keeps its own KV cache, addressed by the target's block tables. For each request it
remembers how many tokens its cache holds; a step first catches up on the tokens it has not seen
(the target's last accepted tokens, or a whole prompt) in one varlen pass that yields draft 1,
then runs K - 1 single-token passes. After verification, the drafter's K/V for accepted drafts
stays valid and the rest is simply overwritten later.

With ``draft_context_window: W`` (default 256; 0 for the whole context) the drafter sees only the
context's first ``SINK_TOKENS`` and its last W tokens (StreamingLLM's window with attention
sinks), so neither its catch-up nor its attention grows with the context:
- a drafter that has fallen more than W tokens behind a request (a new prompt, or output generated
  while K was 0, as in a rollout's drain) reads the first tokens if it lacks them and the last W,
  and skips the rest. Its cache indices (and RoPE positions) close up over the gap, so from then on
  a request's token at position p sits at index p - shift in the drafter;
- every token it reads or drafts attends to the first ``SINK_TOKENS`` indices and the last W up to
  its own (the runner's sliding window), however long the request has run since.
A head cut to the first ``draft_vocab_size`` ids can never propose the rest, yet a request's own
rare tokens (its identifiers, its language's words) recur in it. Where the cut rows stay readable
(``head_lookup``: a tied embedding, or a GGUF head's rows in place) the drafter also scores, for
each request, the ids beyond the cut that its context holds: their head rows, read once when first
seen, dotted with the hidden state (on 1024-token sampled code outputs, 27 ids a request on
average raise the drafts kept from 0.801 to 0.844; the whole head keeps 0.872).

With prefix caching, requests share the blocks of a common prompt prefix. Because the window
shifts indices, a shared block's drafter K/V is its first holder's: the engine gives a request a
copy of each shared block its drafter is about to write into (``kv_writes``). Every drafter then
reads only K/V it wrote itself, and a long cached prompt is copied only as far as the drafter's
closed-up indices reach.

Drafts may get worse; verification keeps the output lossless either way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from dynaspec.engine.kv_cache import fill_kv_noise, kv_bytes_per_token
from dynaspec.engine.runner import ModelRunner, StaticChain, TokenRun
from dynaspec.engine.sampler import (
    SamplingTensors,
    apply_penalties,
    coupled_draw,
    processed_probs,
    top_probability,
)
from dynaspec.engine.static_pass import NO_SLOT, StepClock, block_table_rows, bucket_of, slots_of
from dynaspec.engine.types import DeviceDrafts, DraftPass, Drafts, SchedulePlan, StepResult
from dynaspec.models.attention import SINK_TOKENS
from dynaspec.models.build import effective_quantization
from dynaspec.models.loader import compute_dtypes, load_model, resolve_model
from dynaspec.spec_decode.proposer import Proposer, ProposerContext, register_proposer


@dataclass(slots=True)
class ContextVocab:
    """A request's ids beyond the drafter's cut head, with the head rows that score them."""

    ids: torch.Tensor  # [n] int64
    rows: torch.Tensor  # [n, hidden] float32
    seen: set[int] = field(default_factory=set)
    scanned: int = 0  # context tokens looked at so far


@register_proposer("draft_model")
class DraftModelProposer(Proposer):
    def __init__(self, spec_config, ctx: ProposerContext) -> None:
        super().__init__(ctx)
        source = resolve_model(spec_config.model, load_format=spec_config.load_format or "auto")
        if not source.tokenizer().same_vocabulary(ctx.target_tokenizer):
            raise ValueError(
                f"speculative_config.model: the draft model {spec_config.model!r} uses a different "
                "tokenizer from the target's; draft and target must share a vocabulary"
            )
        # drafts may be anything (verification keeps outputs lossless): 4 bits on the CPU unless
        # draft_quantization says otherwise
        quantization = spec_config.drafter_quantization(ctx.device.type, ctx.quantization)
        mode = effective_quantization(quantization, source.is_gguf, ctx.device)
        self.dtype, self.kv_dtype = compute_dtypes(ctx.dtype_flag, mode)
        self.model = load_model(
            source, quantization, self.dtype, ctx.device, head_rows=spec_config.draft_vocab_size
        )
        self.vocab_size = self.model.config.vocab_size  # the verifier's q needs the full vocabulary
        cut = spec_config.draft_vocab_size
        # where the head is cut and its other rows stay readable: each request's own rare ids too
        readable = self.model.head_lookup is not None
        self.head_rows = cut if cut and cut < self.vocab_size and readable else None
        self.context_vocab: dict[str, ContextVocab] = {}
        self.runner: ModelRunner | None = None
        self._window = spec_config.context_window
        self.num_computed: dict[str, int] = {}  # request id -> tokens the drafter has read or skipped
        self.shift: dict[str, int] = {}  # request id -> tokens skipped: position p sits at index p - shift
        self.fed_drafts: dict[str, int] = {}  # of the step being verified: request id -> drafts fed
        self.static: StaticChain | None = None  # greedy drafting on fixed shapes (enable_static)

    @property
    def window(self) -> int | None:
        return self._window

    @window.setter
    def window(self, tokens: int | None) -> None:
        """Set before requests run (a benchmark's variant): what the drafter has read stays as read."""
        self._window = tokens
        if self.runner is not None:
            self.runner.window = tokens

    def unseen_tokens(self, request) -> int:
        """Tokens to feed before drafting for ``request``: 1 when caught up, its whole prompt when new
        (at most ``SINK_TOKENS`` + the window when there is one)."""
        return self._reads(request.num_tokens, self.num_computed.get(request.request_id, 0))

    def catchup_tokens(self, context_tokens: int) -> int:
        return self._reads(context_tokens, 0)

    def _reads(self, num_tokens: int, done: int) -> int:
        """Tokens a catch-up from ``done`` to ``num_tokens`` reads."""
        if self._skips(num_tokens, done):
            return max(0, SINK_TOKENS - done) + self.window
        return num_tokens - done

    def _skips(self, num_tokens: int, done: int) -> bool:
        """Whether a catch-up from ``done`` to ``num_tokens`` skips tokens between the sinks (or
        what the drafter has) and the window."""
        return self.window is not None and num_tokens - self.window > max(done, SINK_TOKENS)

    def _catchup(self, request) -> tuple[list[int], int]:
        """(tokens the drafter reads before drafting for ``request``, the shift after reading them)."""
        done = self.num_computed.get(request.request_id, 0)
        shift = self.shift.get(request.request_id, 0)
        n = request.num_tokens
        if not self._skips(n, done):
            return request.token_at(done, n), shift
        tail = n - self.window
        head = request.token_at(done, SINK_TOKENS) if done < SINK_TOKENS else []  # done < SINK: shift 0
        return head + request.token_at(tail, n), tail - (done - shift + len(head))

    def _context_vocab(self, request) -> ContextVocab:
        """``request``'s ids beyond the cut head, updated with the tokens it gained since last asked."""
        vocab = self.context_vocab.get(request.request_id)
        if vocab is None:
            empty = torch.empty(0, self.model.config.hidden_size, device=self.ctx.device)
            vocab = ContextVocab(torch.empty(0, dtype=torch.long, device=self.ctx.device), empty)
            self.context_vocab[request.request_id] = vocab
        tokens = request.token_at(vocab.scanned, request.num_tokens)
        new = [t for t in dict.fromkeys(tokens) if t >= self.head_rows and t not in vocab.seen]
        if new:
            ids = torch.tensor(new, dtype=torch.long, device=self.ctx.device)
            rows = self.model.head_lookup(ids).float()
            vocab.ids, vocab.rows = torch.cat([vocab.ids, ids]), torch.cat([vocab.rows, rows])
            vocab.seen.update(new)
        vocab.scanned = request.num_tokens
        return vocab

    def _widen(self, logits: torch.Tensor, hidden: torch.Tensor, vocabs: list[ContextVocab]) -> torch.Tensor:
        """The cut head's logits [rows, cut] over the whole vocabulary: each row's context ids
        scored too, every other id beyond the cut at -inf (never proposed)."""
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, : logits.shape[1]] = logits
        for row, vocab in enumerate(vocabs):
            if len(vocab.ids):
                full[row].index_copy_(0, vocab.ids, vocab.rows @ hidden[row].float())
        return full

    def pays_for_unfilled_positions(self) -> bool:
        return True  # the pass at a stopped position ran before its confidence stopped it

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model.config, self.kv_dtype)

    def allocate_kv(self, num_slots: int) -> None:
        self.runner = ModelRunner(self.model, num_slots, self.ctx.block_size, self.kv_dtype, self.ctx.device)
        self.runner.window = self._window

    def shares_cached_blocks(self) -> bool:
        return True  # it says where it writes its K/V: kv_writes

    def kv_writes(self, request, cap: int) -> tuple[int, int] | None:
        """From the index after what it has read: its catch-up, then drafts 1..cap-1 fed."""
        rid = request.request_id
        start = self.num_computed.get(rid, 0) - self.shift.get(rid, 0)
        return start, start + self.unseen_tokens(request) + cap - 1

    def copy_kv_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(pairs)

    def enable_static(self, max_num_seqs: int, max_k: int, max_model_len: int) -> None:
        self.static = StaticChain(self.runner, max_num_seqs, max_k, max_model_len)
        self.clock = StepClock(self.ctx.device)

    def capture(self, pool) -> None:
        if self.static is not None:
            self.static.capture(pool)

    def propose(self, plan: SchedulePlan, sampling: SamplingTensors) -> Drafts:
        """Up to ``k_caps[i]`` drafts per decode, one drafter pass per position over the rows still
        drafting. A row stops before position j when the drafter's top probability there is below
        ``plan.min_draft_confidence`` (a confidence stop): decided from the distribution, not the
        token drawn from it, so which positions are verified depends only on earlier drafts and
        sampled verification stays exact."""
        if plan.k == 0:
            return self.no_drafts(plan)
        static = self.static
        fixed_shape = static is not None and static.takes(plan.num_decodes, plan.k)
        if fixed_shape and sampling.plain_greedy and not self.head_rows:
            return self._propose_static(plan)
        active = [i for i, cap in enumerate(plan.k_caps) if cap > 0]
        k = plan.k
        passes: list[DraftPass] = []
        tokens = torch.zeros(plan.num_decodes, k, dtype=torch.long, device=self.ctx.device)
        sampled = not sampling.all_greedy
        lens = [0] * plan.num_decodes  # draft tokens kept per decode
        self.fed_drafts = {}
        confidence: list[list[float]] = [[] for _ in range(plan.num_decodes)]
        runs = []
        vocabs = {i: self._context_vocab(plan.decodes[i]) for i in active} if self.head_rows else {}
        for i in active:
            r = plan.decodes[i]
            ids, shift = self._catchup(r)
            # the catch-up ends at index num_tokens - 1 - shift, the index of the token draft 1 follows
            index = r.num_tokens - shift - len(ids)
            runs.append(TokenRun(ids, index, r.block_ids, [len(ids) - 1]))
            self.shift[r.request_id] = shift
        for j in range(k):
            if j > 0:  # feed draft j-1 of the requests that still draft at j
                active = [i for i in active if plan.k_caps[i] > j and lens[i] == j]
                if not active:
                    break
                runs = []
                for i in active:
                    r = plan.decodes[i]
                    index = r.num_tokens + j - 1 - self.shift.get(r.request_id, 0)
                    runs.append(TokenRun([int(tokens[i, j - 1])], index, r.block_ids, [0]))
            start = time.perf_counter()
            if vocabs:
                hidden = self.runner.run(runs, hidden=True)
                logits = self._widen(self.model.compute_logits(hidden), hidden, [vocabs[i] for i in active])
            else:
                logits = self.runner.run(runs)
            logits = logits[:, None, :]  # [len(active), 1, vocab]
            rows = len(runs)
            extra = sum(len(r.token_ids) for r in runs) - rows
            passes.append(DraftPass(rows, extra, self._elapsed_ms(start)))
            idx = torch.tensor(active, dtype=torch.long, device=self.ctx.device)
            if sampling.penalties is not None:  # draft j's context: the output and drafts 0..j-1
                logits = apply_penalties(logits, sampling.penalties.rows(idx), tokens.index_select(0, idx), j)
            if sampled:  # draft j at the uniform the target draws its token j from (rejection.py)
                rows_sampling = sampling.rows(idx)
                q = processed_probs(
                    logits, rows_sampling.temperature, rows_sampling.top_k, rows_sampling.top_p
                )[:, 0]
                q = F.pad(q, (0, self.vocab_size - q.shape[-1]))  # a pruned head never proposes the rest
                top = q.max(-1)
                drawn = coupled_draw(q, rows_sampling.seeds, rows_sampling.positions + j)  # [len(active)]
                drawn = torch.where(rows_sampling.temperature > 0, drawn, top.indices)
                tokens[:, j].index_copy_(0, idx, drawn)
                top_p = top.values.tolist()
            else:
                top_p, top = top_probability(logits[:, 0])  # [len(active)] each
                tokens[idx, j] = top
                top_p = top_p.tolist()
            for row, i in enumerate(active):
                self.fed_drafts[plan.decodes[i].request_id] = j  # pass j fed drafts 0..j-1
                if top_p[row] >= plan.min_draft_confidence:
                    lens[i] = j + 1
                    confidence[i].append(top_p[row])
        return Drafts(tokens, lens, passes, confidence)

    def _propose_static(self, plan: SchedulePlan) -> Drafts:
        """Greedy drafts from the chain on fixed shapes (``StaticChain``): every row runs all K
        passes; a row's K/V is written only for the drafts its cap allows, and which drafts it
        keeps (its cap, confidence stops) is decided on the device."""
        static, k, b = self.static, plan.k, plan.num_decodes
        rows = bucket_of(b, static.buckets)
        c = static.CATCHUP_TOKENS
        clock = self.clock
        start = clock.mark()
        ids = np.zeros((rows, c), dtype=np.int64)
        last = np.zeros(rows, dtype=np.int64)  # index of each row's last token (its catch-up's end)
        caps = np.zeros(rows, dtype=np.int64)
        tails = np.zeros(rows, dtype=np.int64)  # catch-up tokens the chain reads per row
        catchups, extra = [], 0
        self.fed_drafts = {}
        for i, (r, cap) in enumerate(zip(plan.decodes, plan.k_caps)):
            if cap == 0:
                continue
            tokens, shift = self._catchup(r)
            self.shift[r.request_id] = shift
            last[i] = r.num_tokens - 1 - shift
            if len(tokens) > c:  # a new request, or output generated while it did not draft
                catchups.append(TokenRun(tokens[:-c], int(last[i]) + 1 - len(tokens), r.block_ids, []))
            tail = tokens[-c:]
            ids[i, c - len(tail) :] = tail
            tails[i], caps[i] = len(tail), cap
            extra += len(tokens) - 1
            self.fed_drafts[r.request_id] = cap - 1  # pass j feeds draft j - 1, for j < cap
        if catchups:
            self.runner.run(catchups)
        table = block_table_rows([r.block_ids for r in plan.decodes], rows, static.max_blocks)
        offsets = np.arange(c)
        positions = last[:, None] - (c - 1) + offsets[None, :]  # [rows, c]
        slots = slots_of(table, np.maximum(positions, 0), self.ctx.block_size)
        slots[(offsets[None, :] < c - tails[:, None]) | (positions < 0)] = NO_SLOT
        steps = np.arange(1, k)[:, None]  # [k - 1, 1] pass j feeds draft j - 1 at index last + j
        next_positions = last[None, :] + steps  # [k - 1, rows]
        next_slots = slots_of(table, next_positions.T, self.ctx.block_size).T
        next_slots[steps >= caps[None, :]] = NO_SLOT
        out = static.run(
            rows,
            k,
            {
                "ids": ids,
                "positions": positions,
                "slots": slots,
                "seq_lens": last + 1,
                "caps": caps,
                "next_positions": next_positions,
                "next_slots": next_slots,
                "next_seq_lens": next_positions + 1,
                "block_table": table,
            },
        )
        end = clock.mark()
        tokens, confidence = out["tokens"][:b], out["confidence"][:b]
        keep = (confidence >= plan.min_draft_confidence) & (
            torch.arange(k, device=self.ctx.device)[None, :] < out["caps"][:b, None]
        )
        lens = keep.long().cumprod(1).sum(1)  # [b] drafts kept: up to the first stop
        num_active = int(np.count_nonzero(caps))

        def timer() -> list[DraftPass]:
            ms = clock.ms(start, end) / k
            return [DraftPass(num_active, extra if j == 0 else 0, ms) for j in range(k)]

        return Drafts(tokens, list(plan.k_caps), pending=DeviceDrafts(lens, confidence, timer))

    def catch_up(self, prompts: list[list[int]], block_tables: list[list[int]]) -> float:
        runs = [TokenRun(ids, 0, blocks, [len(ids) - 1]) for ids, blocks in zip(prompts, block_tables)]
        start = time.perf_counter()
        self.runner.run(runs)
        return self._elapsed_ms(start)

    def _elapsed_ms(self, start: float) -> float:
        if self.ctx.device.type == "cuda":  # kernels are asynchronous: time what really ran
            torch.cuda.synchronize(self.ctx.device)
        return (time.perf_counter() - start) * 1000

    def commit(self, plan: SchedulePlan, result: StepResult) -> None:
        for r, accepted in zip(plan.decodes, result.num_accepted):
            fed = self.fed_drafts.get(r.request_id)
            if fed is None:  # the drafter did not run for it this step
                continue
            # runs before the scheduler appends: r.num_tokens is still the length drafts followed.
            # The drafter holds the real tokens and the drafts it was fed; accepted ones stay valid.
            self.num_computed[r.request_id] = r.num_tokens + min(accepted, fed)
        self.fed_drafts = {}

    def assume_read(self, request, num_tokens: int, slots: torch.Tensor) -> None:
        if self.runner is not None:
            fill_kv_noise(self.runner.kv_caches, slots)
        self.num_computed[request.request_id] = num_tokens
        self.shift.pop(request.request_id, None)

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.num_computed.pop(rid, None)
            self.shift.pop(rid, None)
            self.context_vocab.pop(rid, None)
