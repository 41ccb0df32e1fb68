"""Drafting with a smaller model of the same family, for the whole batch at once.

The drafter keeps its own KV cache, addressed by the target's block tables. For each request it
remembers how many tokens its cache holds; a step first catches up on the tokens it has not seen
(the target's last accepted tokens, or a whole prompt) in one varlen pass that yields draft 1,
then runs K - 1 single-token passes. After verification, the drafter's K/V for accepted drafts
stays valid and the rest is simply overwritten later.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from dynaspec.engine.kv_cache import kv_bytes_per_token
from dynaspec.engine.runner import ModelRunner, TokenRun
from dynaspec.engine.sampler import SamplingTensors, processed_probs
from dynaspec.engine.scheduler import SchedulePlan, StepResult
from dynaspec.models.llama import LlamaModel
from dynaspec.models.loader import load_hf_dir, load_tokenizer, resolve_model
from dynaspec.models.quant import quantize_int8_
from dynaspec.spec.proposer import Drafts, ProposerContext, register_proposer


@register_proposer("draft_model")
class DraftModelProposer:
    def __init__(self, spec_config, ctx: ProposerContext) -> None:
        path = resolve_model(spec_config.model)
        if not load_tokenizer(path).same_vocabulary(ctx.target_tokenizer):
            raise ValueError(
                f"speculative_config.model: the draft model {spec_config.model!r} uses a different "
                "tokenizer from the target's; draft and target must share a vocabulary"
            )
        config, weights, _ = load_hf_dir(path)
        self.model = LlamaModel.from_weights(config, weights, ctx.dtype, ctx.device)
        del weights
        self.vocab_size = config.vocab_size  # the verifier's q needs the full vocabulary
        if spec_config.draft_vocab_size is not None:
            self.model.truncate_lm_head(spec_config.draft_vocab_size)
        if spec_config.draft_quantization == "int8":
            quantize_int8_(self.model)
        self.ctx = ctx
        self.runner: ModelRunner | None = None
        self.num_computed: dict[str, int] = {}  # request id -> tokens whose draft K/V is valid
        self.last_pass_timings: list[tuple[int, int, float]] = []  # (rows, extra tokens, ms) per pass

    def pending_tokens(self, request) -> int:
        """Tokens to feed before drafting for ``request``: 1 when caught up, its whole prompt when new."""
        return request.num_tokens - self.num_computed.get(request.request_id, 0)

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model.config, self.ctx.dtype)

    def allocate_kv(self, num_slots: int) -> None:
        self.runner = ModelRunner(self.model, num_slots, self.ctx.block_size, self.ctx.dtype, self.ctx.device)

    def propose(self, plan: SchedulePlan, sampling: SamplingTensors) -> Drafts:
        self.last_pass_timings = []
        if plan.k == 0:
            return Drafts.none(plan.num_decodes, self.ctx.device)
        active = [i for i, cap in enumerate(plan.max_drafts) if cap > 0]
        k = max((plan.max_drafts[i] for i in active), default=0)
        tokens = torch.zeros(plan.num_decodes, k, dtype=torch.long, device=self.ctx.device)
        want_probs = not sampling.all_greedy
        probs = None
        if want_probs:
            probs = torch.zeros(plan.num_decodes, k, self.vocab_size, device=self.ctx.device)
        runs = []
        for i in active:
            r = plan.decodes[i]
            done = self.num_computed.get(r.request_id, 0)
            runs.append(TokenRun(r.token_at(done, r.num_tokens), done, r.block_ids, [r.num_tokens - done - 1]))
        for j in range(k):
            if j > 0:  # feed draft j-1 of the requests that want more than j drafts
                active = [i for i in active if plan.max_drafts[i] > j]
                runs = [
                    TokenRun([int(tokens[i, j - 1])], plan.decodes[i].num_tokens + j - 1, plan.decodes[i].block_ids, [0])
                    for i in active
                ]
            start = time.perf_counter()
            logits = self.runner.run(runs)[:, None, :]  # [len(active), 1, vocab]
            if self.ctx.device.type == "cuda":
                torch.cuda.synchronize(self.ctx.device)
            rows = len(runs)
            extra = sum(len(r.token_ids) for r in runs) - rows
            self.last_pass_timings.append((rows, extra, (time.perf_counter() - start) * 1000))
            idx = torch.tensor(active, dtype=torch.long, device=self.ctx.device)
            if want_probs:
                q = processed_probs(logits, sampling.temperature[idx], sampling.top_k[idx], sampling.top_p[idx])[:, 0]
                q = F.pad(q, (0, self.vocab_size - q.shape[-1]))  # a pruned head never proposes the rest
                probs[:, j].index_copy_(0, idx, q)
                for row, i in enumerate(active):
                    if sampling.temperature[i] > 0:
                        tokens[i, j] = torch.multinomial(q[row], 1, generator=sampling.generators[i])[0]
                    else:
                        tokens[i, j] = q[row].argmax()
            else:
                tokens[idx, j] = logits[:, 0].argmax(-1)
        return Drafts(tokens, list(plan.max_drafts), probs)

    def time_catchup(self, prompts: list[list[int]], block_tables: list[list[int]]) -> float:
        """Milliseconds of one drafter pass over whole prompts from nothing (a new request's catch-up).

        For the profiler: the blocks must be free ones, lent by the caller."""
        runs = [TokenRun(ids, 0, blocks, [len(ids) - 1]) for ids, blocks in zip(prompts, block_tables)]
        start = time.perf_counter()
        self.runner.run(runs)
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        return (time.perf_counter() - start) * 1000

    def commit(self, plan: SchedulePlan, result: StepResult) -> None:
        for r, n_drafts, emitted in zip(plan.decodes, result.num_drafts, result.token_ids):
            if n_drafts == 0:
                continue
            accepted = len(emitted) - 1
            # runs before the scheduler appends: r.num_tokens is still the length drafts followed.
            # The drafter holds the real tokens and drafts 1..n_drafts-1; accepted ones stay valid.
            self.num_computed[r.request_id] = r.num_tokens + min(accepted, n_drafts - 1)

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.num_computed.pop(rid, None)
