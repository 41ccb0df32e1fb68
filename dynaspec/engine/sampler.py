"""Turning logits into the distribution a request samples from, and drawing from it (pure functions).

Every sampled token is a function of the request's seed and the token's output position alone
(``coupled_draw`` over uniforms from the counter-based ``counter_uniforms``): no generator state
advances, so the draw for output position t is the same whether the token is sampled by plain
decoding, verified in a window of any width, or drawn again after a preemption. A drafter draws
its draft for position t the same way from its own distribution, which couples draft and target:
where their likely tokens agree, the draft is the target's own draw (spec_decode/rejection.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dynaspec.engine.request import Request
from dynaspec.engine.types import PrefillChunk, PromptLogits, TokenLogprob


@dataclass(slots=True)
class Penalties:
    """Logit bias and presence, frequency and repetition penalties of a batch's rows.

    They make a token's logit depend on the tokens before it, so under speculation position i of a
    verify window (and the drafter's i-th draft) counts the output so far plus the window's first i
    draft tokens: each position sees exactly the context the target alone would have seen there.
    """

    presence: torch.Tensor  # [batch] float32
    frequency: torch.Tensor  # [batch] float32
    repetition: torch.Tensor  # [batch] float32; 1 leaves logits as they are
    output_counts: torch.Tensor  # [batch, vocab] float32: occurrences of each token in the output so far
    prompt_mask: torch.Tensor  # [batch, vocab] bool: prompt tokens (context of the repetition penalty)
    logit_bias: torch.Tensor  # [batch, vocab] float32

    @classmethod
    def of(cls, requests: list[Request], vocab_size: int, device: torch.device) -> Penalties | None:
        """None when no request uses any (the common case costs nothing)."""
        if not any(r.params.penalized for r in requests):
            return None
        batch = len(requests)
        counts = torch.zeros(batch, vocab_size)
        prompt_mask = torch.zeros(batch, vocab_size, dtype=torch.bool)
        bias = torch.zeros(batch, vocab_size)
        for i, r in enumerate(requests):
            p = r.params
            if not p.penalized:
                continue
            if r.output_token_ids:
                ids = torch.tensor(r.output_token_ids, dtype=torch.long)
                counts[i].index_add_(0, ids, torch.ones(len(ids)))
            if p.repetition_penalty != 1.0:
                prompt_mask[i, torch.tensor(r.prompt_token_ids, dtype=torch.long)] = True
            for token_id, value in p.logit_bias.items():
                if token_id < vocab_size:
                    bias[i, token_id] = value
        params = [r.params for r in requests]
        return cls(
            presence=torch.tensor([p.presence_penalty for p in params], device=device),
            frequency=torch.tensor([p.frequency_penalty for p in params], device=device),
            repetition=torch.tensor([p.repetition_penalty for p in params], device=device),
            output_counts=counts.to(device),
            prompt_mask=prompt_mask.to(device),
            logit_bias=bias.to(device),
        )

    def rows(self, index: torch.Tensor) -> Penalties:  # index: [n] int64
        return Penalties(*(t.index_select(0, index) for t in self._tensors()))

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.presence,
            self.frequency,
            self.repetition,
            self.output_counts,
            self.prompt_mask,
            self.logit_bias,
        )


@dataclass(slots=True)
class SamplingTensors:
    temperature: torch.Tensor  # [batch] float32; 0 for greedy rows
    top_k: torch.Tensor  # [batch] int64; 0 disables
    top_p: torch.Tensor  # [batch] float32
    seeds: torch.Tensor  # [batch] int64: each request's seed (drawn at random when it gave none)
    positions: torch.Tensor  # [batch] int64: output tokens so far, the output position sampled next
    all_greedy: bool
    penalties: Penalties | None = None  # None when no row uses a penalty or a logit bias
    num_logprobs: list[int | None] = field(default_factory=list)  # [batch] top alternatives wanted

    @property
    def plain(self) -> bool:
        """No row uses penalties or logprobs: the target's logits and the seeds decide every token."""
        return self.penalties is None and all(n is None for n in self.num_logprobs)

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy, without penalties or logprobs: the argmax alone decides its tokens."""
        return self.all_greedy and self.plain

    def rows(self, index: torch.Tensor) -> SamplingTensors:  # index: [n] int64, rows may repeat
        """The sampling of the rows ``index`` picks (penalties and logprobs left out: applied and
        reported on the whole batch)."""
        return SamplingTensors(
            temperature=self.temperature.index_select(0, index),
            top_k=self.top_k.index_select(0, index),
            top_p=self.top_p.index_select(0, index),
            seeds=self.seeds.index_select(0, index),
            positions=self.positions.index_select(0, index),
            all_greedy=self.all_greedy,
        )

    @classmethod
    def of(cls, requests: list[Request], vocab_size: int, device: torch.device) -> SamplingTensors:
        params = [r.params for r in requests]
        return cls(
            temperature=to_device([p.temperature for p in params], torch.float32, device),
            top_k=to_device([p.top_k for p in params], torch.long, device),
            top_p=to_device([p.top_p for p in params], torch.float32, device),
            seeds=to_device([r.seed & SEED_MASK for r in requests], torch.long, device),
            positions=to_device([len(r.output_token_ids) for r in requests], torch.long, device),
            all_greedy=all(p.greedy for p in params),
            penalties=Penalties.of(requests, vocab_size, device),
            num_logprobs=[p.logprobs for p in params],
        )


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without waiting: on CUDA through pinned memory, asynchronously
    (a copy from pageable memory would wait for the device to finish its queued work)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def apply_penalties(
    logits: torch.Tensor,  # [batch, positions, vocab] float32 (vocab may be a pruned draft head's)
    penalties: Penalties,  # [batch]
    window_tokens: torch.Tensor,  # [batch, >= first + positions - 1] int64: draft tokens of the window
    first: int = 0,  # the window position of logits[:, 0]
) -> torch.Tensor:  # [batch, positions, vocab]
    """Logit bias, then repetition, frequency and presence penalties. Position i of ``logits`` sits
    at window position first + i, whose context is the output so far and window_tokens[:, :first + i]."""
    batch, positions, vocab = logits.shape
    counts = penalties.output_counts[:, :vocab].clone()  # [batch, vocab]
    if first:
        counts.scatter_add_(
            -1, window_tokens[:, :first], torch.ones_like(window_tokens[:, :first], dtype=counts.dtype)
        )
    counts = counts[:, None, :].expand(batch, positions, vocab)  # [batch, positions, vocab]
    if positions > 1:
        later = window_tokens[:, first : first + positions - 1, None]  # [batch, positions - 1, 1]
        drafted = logits.new_zeros(batch, positions, vocab)
        drafted[:, 1:].scatter_add_(-1, later, torch.ones_like(later, dtype=drafted.dtype))
        counts = counts + drafted.cumsum(1)
    seen = counts > 0
    logits = logits + penalties.logit_bias[:, None, :vocab]
    rep = penalties.repetition[:, None, None]
    repeated = seen | penalties.prompt_mask[:, None, :vocab]
    logits = torch.where(repeated, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - penalties.frequency[:, None, None] * counts - penalties.presence[:, None, None] * seen


def token_logprobs(
    logits: torch.Tensor,  # [rows, positions, vocab] raw target logits
    token_ids: list[list[int]],  # [rows] tokens at positions 0.. of each row (at most positions)
    num_top: list[int],  # [rows] alternatives wanted per row
) -> list[list[TokenLogprob]]:  # [rows][len(token_ids[row])]
    """Log-probabilities of the given tokens under the raw distribution (the model's log-softmax,
    before penalties, temperature, top-k and top-p), with each position's most likely tokens."""
    rows, positions, _ = logits.shape
    logp = logits.float().log_softmax(-1)
    ids = torch.zeros(rows, positions, dtype=torch.long)
    for r, row in enumerate(token_ids):
        ids[r, : len(row)] = torch.tensor(row, dtype=torch.long)
    ids = ids.to(logits.device)
    chosen = logp.gather(-1, ids[..., None])  # [rows, positions, 1]
    rank = (logp > chosen).sum(-1) + 1  # [rows, positions]
    n = max(num_top, default=0)
    top = logp.topk(n, dim=-1) if n else None
    chosen_l, rank_l = chosen[..., 0].tolist(), rank.tolist()  # the host copies of the whole batch
    top_v, top_i = (top.values.tolist(), top.indices.tolist()) if top is not None else (None, None)
    out = []
    for r, row in enumerate(token_ids):
        entries = []
        for j in range(len(row)):
            alternatives = (
                list(zip(top_i[r][j][: num_top[r]], top_v[r][j][: num_top[r]])) if top is not None else []
            )
            entries.append(TokenLogprob(chosen_l[r][j], rank_l[r][j], alternatives))
        out.append(entries)
    return out


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


SEED_MASK = (1 << 63) - 1  # seeds are taken modulo 2^63 (an int64 on the device)
_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2^27: a 32-bit value times it stays below 2^59, exact in int64
_SALT = 0x9E3779B9
COUPLED_TOKENS = 32  # the most likely tokens that race by a noise of their own in a draw (coupled_draw)
_REST_RACE, _REST_PICK = -1, -2  # the streams of the draw's uniforms for the other tokens (ids are >= 0)


def _mix32(x: torch.Tensor) -> torch.Tensor:  # int64 holding 32-bit values
    """An avalanche of 32-bit values (xor-shift-multiply), in int64 arithmetic that never overflows."""
    x = x ^ (x >> 16)
    x = (x * _MIX) & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MIX) & _MASK32
    return x ^ (x >> 16)


def counter_uniforms(
    seeds: torch.Tensor,  # int64, any shape, values in [0, 2^63)
    positions: torch.Tensor,  # int64, broadcastable with seeds: output positions
    streams: torch.Tensor | int = 0,  # int64, broadcastable: which of a draw's uniforms (a token id, ...)
) -> torch.Tensor:  # float32, the broadcast shape, in (0, 1) on a grid of 2^-24
    """The uniform of each (seed, output position, stream): a hash of the three, no generator state.

    Elementwise integer ops only, so it runs on the device inside a captured step and costs the
    same whatever the window's width. 24 bits (a float32 uniform's resolution), never 0 or 1."""
    hi = (seeds >> 32) & _MASK32
    lo = seeds & _MASK32
    h = _mix32(_mix32((positions & _MASK32) ^ _SALT) ^ (streams & _MASK32))
    h = _mix32(_mix32(h ^ hi) ^ lo)
    return ((h >> 8).to(torch.float32) + 0.5) * 2.0**-24


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    return -(-u.log()).log()


def coupled_draw(
    probs: torch.Tensor,  # [rows, vocab] unnormalized ok
    seeds: torch.Tensor,  # [rows] int64
    positions: torch.Tensor,  # [rows] int64 output positions
) -> torch.Tensor:  # [rows] int64
    """One draw per row from ``probs``, a function of (seed, position) alone, such that two close
    distributions drawn at the same (seed, position) mostly give the same token.

    The ``COUPLED_TOKENS`` most likely tokens race with a Gumbel noise each, keyed by their token
    id, against the rest as one entry (its mass and a noise of its own); when the rest wins, a
    token is drawn from it by inverting its cumulative distribution. Gumbel-max makes each race
    exact, so the draw follows ``probs``; a token's noise is the same in both distributions, so a
    draft drawn this way is the target's draw unless their likely tokens differ (Daliri et al.,
    "Coupling without communication", arXiv 2411.14926)."""
    m = min(COUPLED_TOKENS, probs.shape[-1])
    top, ids = probs.topk(m, dim=-1)  # [rows, m]
    s, t = seeds[:, None], positions[:, None]
    best, at = (top.log() + _gumbel(counter_uniforms(s, t, ids))).max(-1)  # [rows]
    rest = probs.scatter(-1, ids, 0.0)  # [rows, vocab]
    rest_race = rest.sum(-1).log() + _gumbel(counter_uniforms(seeds, positions, _REST_RACE))
    from_rest = sample_at(rest, counter_uniforms(seeds, positions, _REST_PICK))
    return torch.where(rest_race > best, from_rest, ids.gather(-1, at[:, None])[:, 0])


def sample_at(
    probs: torch.Tensor,  # [rows, vocab] unnormalized ok
    u: torch.Tensor,  # [rows] uniforms in [0, 1)
) -> torch.Tensor:  # [rows] int64
    """One draw per row by inverting the cumulative distribution (vocabulary order) at u.

    The first index whose cumulative mass exceeds u x total has a positive probability (a token of
    probability 0 repeats its predecessor's cumulative mass), and u < 1 always finds one. On CPU it
    is ~25x faster than ``torch.multinomial`` over a 152k vocabulary (0.1 vs 2.7 ms a draw), which
    made sampling a third of a plain step at temperature 1.0 and batch 32."""
    cdf = probs.cumsum(-1)
    target = (u.to(cdf.dtype) * cdf[:, -1])[:, None]  # [rows, 1]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:  # [..., vocab] -> [...] int64
    """The argmax over the last dimension (the first of equal maxima, as ``torch.argmax``). On the
    CPU, float32 logits go through NumPy's argmax: ~20x faster than torch's over a 152k vocabulary
    (13 against 270 us a row, about 0.5% of a batch-1 step)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(np.asarray(logits.numpy().argmax(-1)))  # a 1-D input's is a scalar
    return logits.argmax(-1)


def top_probability(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [n, vocab] -> [n], [n]
    """Each row's softmax probability of its most likely token, and that token (``greedy_tokens``):
    ``softmax(logits).max(-1)`` to float32 rounding, without a softmax over the whole vocabulary
    (the top's probability is exp(top - logsumexp)): 2-3x faster over 152k ids, a little slower
    over 16k (benchmarks/probes/host_costs.py)."""
    top = greedy_tokens(logits).to(logits.device)
    value = logits.gather(-1, top[:, None])[:, 0].float()
    return torch.exp(value - torch.logsumexp(logits.float(), -1)), top


def target_tokens(
    logits: torch.Tensor,  # [rows, width, vocab] (penalized where the rows use penalties)
    sampling: SamplingTensors,  # [rows]
    first: torch.Tensor | None = None,  # [rows] int64 window position of logits[:, 0] (default 0)
) -> torch.Tensor:  # [rows, width] int64
    """The target's token at each window position: the argmax for a greedy row, for a sampled one
    the draw at (seed, output position) from the processed distribution (``coupled_draw``)."""
    argmax = greedy_tokens(logits).to(logits.device)
    if sampling.all_greedy:
        return argmax
    rows, width, vocab = logits.shape
    probs = processed_probs(logits.float(), sampling.temperature, sampling.top_k, sampling.top_p)
    offset = torch.arange(width, device=logits.device)[None, :]  # [1, width]
    if first is not None:
        offset = offset + first[:, None]
    seeds = sampling.seeds[:, None].expand(rows, width).reshape(-1)
    positions = (sampling.positions[:, None] + offset).reshape(-1)  # [rows * width]
    drawn = coupled_draw(probs.reshape(rows * width, vocab), seeds, positions).view(rows, width)
    return torch.where(sampling.temperature[:, None] > 0, drawn, argmax)


def score_prompts(
    prompts: list[PromptLogits], prefills: list[PrefillChunk]
) -> dict[str, list[TokenLogprob]]:  # request id -> one TokenLogprob per prompt token scored
    """Raw log-probabilities of the prompt tokens a step's prefill chunks scored."""
    wanted = {c.request.request_id: c.request.params.prompt_logprobs or 0 for c in prefills}
    return {
        p.request_id: token_logprobs(p.logits[None], [p.token_ids], [wanted[p.request_id]])[0]
        for p in prompts
    }
