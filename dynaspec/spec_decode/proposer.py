"""The proposer interface and its registry.

A proposer drafts tokens for a step's decodes. ``Proposer`` is the whole protocol, with the
behaviour of a proposer that keeps no state as its defaults, so every capability is a method the
engine can call on any proposer (a no-op where it does not apply). Only the config names a method
(``speculative_config.method``); the registry maps it to a class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dynaspec.engine.sampler import SamplingTensors
from dynaspec.engine.types import Drafts, SchedulePlan, StepResult

if TYPE_CHECKING:
    from dynaspec.engine.request import Request
    from dynaspec.kpolicy.config import SpeculativeConfig
    from dynaspec.models.config import ModelConfig


@dataclass(slots=True)
class ProposerContext:
    """What a proposer may know of the engine: no scheduler, no target model."""

    target_tokenizer: object
    dtype: torch.dtype  # the target's activations
    device: torch.device
    block_size: int
    quantization: str = "auto"  # the target's --quantization (a drafter follows it unless told otherwise)
    kv_dtype: torch.dtype | None = None  # the target's KV cache (default: dtype)
    dtype_flag: str = "auto"  # --dtype as given (a drafter of another quantization resolves its own)
    # for a head that reads the target's own hidden states (EAGLE): the target's shape, and its
    # embedding and head as functions (ids [n] -> [n, hidden]; hidden [n, hidden] -> [n, vocab] float32)
    target_config: ModelConfig | None = None
    target_embed: Callable[[torch.Tensor], torch.Tensor] | None = None
    target_logits: Callable[[torch.Tensor], torch.Tensor] | None = None


class Proposer:
    """No speculation; the base of every proposer, whose defaults suit one that keeps no state."""

    def __init__(self, ctx: ProposerContext) -> None:
        self.ctx = ctx
        # the profiler's: every row drafts its whole cap, so that a step timed at K verifies
        # bs x (K+1) tokens, as ITL(bs, K) means (a proposer that may propose fewer pads its rows)
        self.fill_drafts = False
        # True for a proposer whose only drafts are the matches ``free_rates`` offers (the n-gram):
        # the K policy then prices each row by its match
        self.matches_only = False

    def kv_bytes_per_token(self) -> int:
        """KV cache bytes this proposer needs per token (0 if it keeps none)."""
        return 0

    def allocate_kv(self, num_slots: int) -> None:
        """Create KV storage addressed by the same slots as the target's."""

    def shares_cached_blocks(self) -> bool:
        """Whether prefix caching may share blocks between requests it drafts for: always where it
        keeps no K/V; where it does, only if it says where it writes (``kv_writes``)."""
        return self.kv_bytes_per_token() == 0

    def kv_writes(self, request: Request, cap: int) -> tuple[int, int] | None:
        """The indices [start, stop) of ``request``'s blocks at which its own K/V is written if it
        drafts up to ``cap`` tokens for it this step; None where it keeps none. The engine first
        gives the request copies of the blocks there that other requests share."""
        return None

    def copy_kv_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy its K/V of each (source, destination) block, as the target's (a block unshared)."""

    def enable_static(self, max_num_seqs: int, max_k: int, max_model_len: int) -> None:
        """Draft on fixed shapes from now on, where the proposer has such a path (a CUDA graph)."""

    def capture(self, pool) -> None:
        """Record the fixed-shape drafting as CUDA graphs into ``pool`` (after ``enable_static``)."""

    def unseen_tokens(self, request: Request) -> int:
        """Tokens it must process before it can draft for ``request`` (1 when caught up)."""
        return 0

    def catchup_tokens(self, context_tokens: int) -> int:
        """Tokens it would process to catch up on a context of this many tokens it has not seen
        (a new request's prompt)."""
        return 0

    def free_rates(self, request: Request) -> tuple[float, ...]:
        """A draft it could give ``request`` this step at no drafter pass (a suffix match beside
        a draft model): each token's estimated probability given the ones before; () where it has
        none, the default. Asked for each decode before the K policy chooses; the draft, where the
        policy takes it (``SchedulePlan.free_rows``), is the one ``propose`` returns."""
        return ()

    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers whose entering hidden states it reads (``num_hidden_layers``: the
        final norm's output); empty, the default, and the target computes none."""
        return ()

    def read_hidden(self, plan: SchedulePlan, drafts: Drafts, hidden: torch.Tensor | None) -> None:
        """The target's hidden states of a step's pass (``TargetLogits.hidden``: one row per token
        it computed, [tokens, len(hidden_layers()) * hidden], None when it reads none), before
        ``commit``."""

    def propose(self, plan: SchedulePlan, sampling: SamplingTensors) -> Drafts:
        """Up to ``plan.k_caps[i]`` draft tokens for each decode; nothing runs when ``plan.k == 0``."""
        return self.no_drafts(plan)

    def commit(self, plan: SchedulePlan, result: StepResult) -> None:
        """Learn what was accepted (e.g. how much of the drafter's own KV stays valid)."""

    def release(self, request_ids: list[str]) -> None:
        """Forget requests that finished or were preempted."""

    def assume_read(self, request: Request, num_tokens: int, slots: torch.Tensor) -> None:
        """Take the first ``num_tokens`` of ``request`` as read, without reading them, their K/V at
        ``slots`` filled with noise (``fill_kv_noise``): the profiler's long contexts, whose
        prefill it skips (``Scheduler.admit_computed``)."""

    def reset(self) -> None:
        """Forget what earlier requests taught it (a benchmark's configurations then start alike);
        called with no request running."""

    def pays_for_unfilled_positions(self) -> bool:
        """Whether a draft position it was asked for and left empty (a confidence stop, no match)
        still cost it a pass: then the K policy counts acceptance per position asked."""
        return False

    def stats(self) -> dict:
        """What the proposer holds (e.g. the memory its state takes); {} when it keeps none."""
        return {}

    def catch_up(self, prompts: list[list[int]], block_tables: list[list[int]]) -> float | None:
        """Milliseconds of one pass over whole prompts from nothing (what a new request costs the
        drafter), on blocks the caller lends; None when the proposer has nothing to catch up on."""
        return None

    def no_drafts(self, plan: SchedulePlan) -> Drafts:
        empty = torch.zeros(plan.num_decodes, 0, dtype=torch.long, device=self.ctx.device)
        return Drafts(empty, [0] * plan.num_decodes)


ProposerFactory = Callable[["SpeculativeConfig", ProposerContext], Proposer]
PROPOSERS: dict[str, ProposerFactory] = {}


def register_proposer(name: str) -> Callable[[ProposerFactory], ProposerFactory]:
    def wrap(factory: ProposerFactory) -> ProposerFactory:
        PROPOSERS[name] = factory
        return factory

    return wrap


def make_proposer(spec_config: SpeculativeConfig | None, ctx: ProposerContext) -> Proposer:
    if spec_config is None:
        return Proposer(ctx)
    import dynaspec.spec_decode.draft_model
    import dynaspec.spec_decode.eagle
    import dynaspec.spec_decode.ngram
    import dynaspec.spec_decode.suffix  # noqa: F401  each registers its method
    from dynaspec.spec_decode.hybrid import HybridProposer

    proposer = PROPOSERS[spec_config.method](spec_config, ctx)
    if spec_config.enable_suffix_decoding:
        return HybridProposer(proposer, PROPOSERS["suffix"](spec_config, ctx), spec_config.max_k)
    return proposer
