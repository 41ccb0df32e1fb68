"""The engine: request -> scheduler -> proposer -> target forward -> rejection sampler -> outputs."""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dynaspec.engine.kv_cache import BlockAllocator, cdiv, kv_bytes_per_token
from dynaspec.engine.request import Request, RequestOutput
from dynaspec.engine.runner import ModelRunner
from dynaspec.engine.sampler import SamplingTensors, score_prompts
from dynaspec.engine.scheduler import Scheduler
from dynaspec.engine.static_pass import StepClock
from dynaspec.engine.types import KPolicy, SchedulePlan, StepRecord, StepTiming
from dynaspec.kpolicy.config import SpeculativeConfig
from dynaspec.kpolicy.policy import FixedK, make_policy
from dynaspec.models import fused_ops
from dynaspec.models.build import QUANTIZATIONS, effective_quantization
from dynaspec.models.loader import DTYPES, compute_dtypes, load_model, resolve_model
from dynaspec.models.tokenizer import IncrementalDetokenizer
from dynaspec.sampling_params import SamplingParams
from dynaspec.spec_decode.proposer import ProposerContext, make_proposer
from dynaspec.spec_decode.rejection import verify
from dynaspec.spec_decode.stats import SpecStats
from dynaspec.spec_decode.synthetic import SyntheticAcceptance

if TYPE_CHECKING:
    from dynaspec.kpolicy.profile import Profile

log = logging.getLogger(__name__)
AUTO = "auto"  # dynamic_config_path: profile the engine on first use (engine/build.py), cached


@dataclass(slots=True)
class EngineConfig:
    model: str
    # auto: float32 activations around quantized layers, bfloat16 for dense ones; KV cache bfloat16.
    # float32 everywhere is the exactness reference.
    dtype: str = "auto"
    quantization: str = "auto"  # auto: a GGUF's own blocks, dense for HF directories; none, int8, int4
    load_format: str = "auto"  # auto: the model's weights; dummy: random ones of its shape (benchmarks)
    device: str = "auto"  # auto: cuda if present, else cpu
    max_num_seqs: int = 32
    max_model_len: int | None = None  # default: the model's context, capped by the KV budget
    max_num_batched_tokens: int = 512  # per step; prefill chunks fill what decodes leave
    kv_cache_memory_gb: float = 2.0
    block_size: int = 16
    speculative_config: SpeculativeConfig | dict | str | None = None
    seed: int = 0  # seeds requests that give no seed of their own
    progress: bool = True
    # decode-only steps on fixed shapes (engine/static_pass.py): None = on CUDA only
    static_decode: bool | None = None
    enforce_eager: bool = False  # vLLM's flag: no CUDA graphs (the fixed-shape steps run eagerly)
    # fixed-shape steps whose rows do not depend on each other (models/fused_ops.py BATCH_INVARIANT,
    # process-wide): greedy speculation equals plain decoding in bfloat16 too, at a cost on the GPU
    batch_invariant: bool = False
    # vLLM's flag: share the K/V of prompt blocks already computed (kv_cache.BlockAllocator). None:
    # on unless the proposer cannot share blocks (an EAGLE head needs the target's hidden states of
    # every position; a draft model copies a shared block before it writes there)
    enable_prefix_caching: bool | None = None

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization: must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}"
            )
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device: must be auto, cpu or cuda[:N]; got {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(f"max_model_len: must be an integer >= 2, got {self.max_model_len!r}")
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb: must be > 0, got {self.kv_cache_memory_gb!r}")
        if not isinstance(self.speculative_config, SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass(slots=True)
class EngineCounters:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens taken from the prefix cache
    chosen_k: int = 0  # the K chosen for the load at the last step with decodes
    spec: SpecStats = field(default_factory=SpecStats)


@dataclass(slots=True)
class Recording:
    """What the engine did inside one ``Engine.recording()`` block."""

    spec: SpecStats = field(default_factory=SpecStats)
    timings: list[StepTiming] = field(default_factory=list)  # one per step


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        device = config.torch_device
        source = resolve_model(config.model, progress=config.progress, load_format=config.load_format)
        self.quantization = effective_quantization(config.quantization, source.is_gguf, device)
        dtype, kv_dtype = compute_dtypes(config.dtype, self.quantization)
        self.dtype, self.kv_dtype = dtype, kv_dtype
        # the tokenizer (a second of Python in transformers) loads while the weights are unpacked
        with ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(source.tokenizer)
            model = load_model(source, config.quantization, dtype, device, progress=config.progress)
            self.tokenizer = tokenizer.result()
        model_config = self.model_config = model.config
        spec = config.speculative_config
        self.proposer = make_proposer(
            spec.for_target(config.load_format) if spec is not None else None,
            ProposerContext(
                self.tokenizer,
                dtype,
                device,
                config.block_size,
                config.quantization,
                kv_dtype,
                config.dtype,
                model_config,
                model.model.embed_tokens,
                model.compute_logits,
            ),
        )

        bytes_per_token = kv_bytes_per_token(model_config, kv_dtype) + self.proposer.kv_bytes_per_token()
        num_blocks = max(1, int(config.kv_cache_memory_gb * 2**30) // (bytes_per_token * config.block_size))
        capacity = num_blocks * config.block_size
        max_len = config.max_model_len or model_config.max_position_embeddings
        if max_len > capacity:
            log.warning("max_model_len %d exceeds the KV budget (%d tokens); capping it", max_len, capacity)
            max_len = capacity
        self.max_model_len = max_len
        self.allocator = BlockAllocator(num_blocks, config.block_size, self._prefix_caching(spec))
        self.kv_bytes_per_block = bytes_per_token * config.block_size  # target and drafter together
        self.runner = ModelRunner(
            model,
            num_blocks * config.block_size,
            config.block_size,
            kv_dtype,
            device,
            hidden_layers=self.proposer.hidden_layers(),  # none unless the proposer reads them (EAGLE)
        )
        self.proposer.allocate_kv(num_blocks * config.block_size)
        self.device = device
        self._clock = StepClock(device)
        rates = spec.synthetic_acceptance_rate if spec is not None else None
        # not lossless: drafts accepted at given rates whatever the tokens (benchmarks with dummy weights)
        self._synthetic: SyntheticAcceptance | None = None
        self.set_synthetic_acceptance(rates)
        fused_ops.BATCH_INVARIANT = self.config.batch_invariant
        self.graph_stats = self._enable_static()
        self.scheduler = Scheduler(
            self.allocator,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.proposer.unseen_tokens,
            self.proposer.catchup_tokens,
            self.proposer.free_rates,
            self.proposer.matches_only,
        )
        self._recordings: list[Recording] = []  # open ``recording()`` blocks
        self.device = device
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self._reset_counters()
        spec = config.speculative_config
        self._k_policy: KPolicy | None = None
        # "auto": K fixed at the largest, and no step, until ``profile_auto`` installs the profiled policy
        self._profile_pending = spec is not None and spec.dynamic_config_path == AUTO
        if self._profile_pending:
            self._k_policy = FixedK(spec.max_k)
        elif spec is not None:
            self._k_policy = make_policy(spec)

    def _prefix_caching(self, spec: SpeculativeConfig | None) -> bool:
        wanted = self.config.enable_prefix_caching
        if self.proposer.shares_cached_blocks():
            return wanted is not False
        if wanted:
            raise ValueError(
                f"enable_prefix_caching: not with speculative_config.method {spec.method!r}: its "
                "drafter reads the target's hidden states of every position, which a cached prefix "
                "skips computing (use draft_model, ngram or suffix drafts, or leave prefix caching off)"
            )
        return False

    @property
    def prefix_caching(self) -> bool:
        return self.allocator.prefix_caching

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt block (a benchmark's next configuration starts cold)."""
        self.allocator.reset_prefix_cache()

    @contextlib.contextmanager
    def prefix_caching_off(self) -> Iterator[None]:
        """No block is shared or cached inside the block (the profiler times prefills as asked);
        the cache is empty after it."""
        was = self.allocator.prefix_caching
        self.allocator.reset_prefix_cache()
        self.allocator.prefix_caching = False
        try:
            yield
        finally:
            self.allocator.prefix_caching = was

    def _enable_static(self) -> dict:
        """Decode-only steps on fixed shapes, captured as CUDA graphs for every batch bucket and K
        (on CUDA, unless ``enforce_eager``): capture time and graph memory, or {} when off."""
        config = self.config
        on = config.static_decode if config.static_decode is not None else self.device.type == "cuda"
        if not on:
            return {}
        spec = config.speculative_config
        max_k = spec.max_k if spec is not None else 0
        static = self.runner.enable_static(config.max_num_seqs, max_k + 1, self.max_model_len)
        if max_k:
            self.proposer.enable_static(config.max_num_seqs, max_k, self.max_model_len)
        if self.device.type != "cuda" or config.enforce_eager:
            return {"graphs": 0}
        start, before = time.perf_counter(), torch.cuda.memory_allocated(self.device)
        pool = torch.cuda.graph_pool_handle()
        static.capture(pool)
        self.proposer.capture(pool)
        torch.cuda.synchronize(self.device)
        stats = {
            "graphs": len(static.graphs.graphs),
            "capture_s": round(time.perf_counter() - start, 2),
            "graph_memory_gib": round((torch.cuda.memory_allocated(self.device) - before) / 2**30, 3),
        }
        log.info("captured CUDA graphs: %s", stats)
        return stats

    def _reset_counters(self) -> None:
        """Statistics, request ids and seeds start afresh (after the engine's own profiling)."""
        self.counters = EngineCounters()
        self.allocator.num_evicted = self.allocator.num_unshared = 0
        self._seeds = random.Random(self.config.seed)
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int] | list[dict],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> Request:
        """Queue a prompt (text, token ids, or chat messages); bad input raises ValueError."""
        prompt_ids = self.prompt_token_ids(prompt)
        if not prompt_ids:
            raise ValueError("prompt: must not be empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_ids)} tokens leaves no room to generate in the model's context of "
                f"{self.max_model_len} tokens"
            )
        if any(t < 0 or t >= self.model_config.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt: token ids must be in [0, {self.model_config.vocab_size})")
        request_id = request_id if request_id is not None else str(next(self._ids))
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            eos_token_ids=self.eos_token_ids,
            max_total_tokens=self.max_model_len,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids),
            seed=seed,
        )
        self.scheduler.add(request)
        self.counters.num_prompt_tokens += len(prompt_ids)
        return request

    def prompt_token_ids(self, prompt: str | list[int] | list[dict]) -> list[int]:
        """Token ids of a prompt given as text, token ids, or chat messages."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.tokenizer.apply_chat_template(prompt)
        return list(prompt)

    def abort(self, request_id: str) -> bool:
        request = self.scheduler.abort(request_id)
        if request is not None:
            self.proposer.release([request_id])
        return request is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the K policy ---------------------------------------------------------------------
    @property
    def k_policy(self) -> KPolicy | None:
        """The policy choosing K each step (None without speculation); the engine is its one owner."""
        return self._k_policy

    def set_k_policy(self, policy: KPolicy) -> KPolicy:
        """Swap the K policy (benchmarks, the profiler); returns the previous one."""
        if self._k_policy is None:
            raise ValueError("speculative_config: this engine has no proposer; a K policy needs one")
        previous, self._k_policy = self._k_policy, policy
        return previous

    @property
    def profile_pending(self) -> bool:
        """``"dynamic_config_path": "auto"`` not yet profiled: ``step`` refuses to run until it is."""
        return self._profile_pending

    def profile_auto(self, profile: Callable[[Engine, SpeculativeConfig], Profile]) -> None:
        """Resolve ``"auto"``: ``profile`` measures this engine (it steps it, under its own fixed Ks)
        and the goodput policy made from what it returns chooses K from then on. The engine never
        profiles itself: ``engine.build.build_engine`` passes ``profiler.auto_profile``."""
        if not self._profile_pending:
            raise RuntimeError('profile_auto: the engine has no pending "dynamic_config_path": "auto"')
        spec = self.config.speculative_config
        self._profile_pending = False  # the profiler's steps
        try:
            policy = make_policy(spec, profile(self, spec))
        except BaseException:
            self._profile_pending = True
            raise
        self._k_policy = policy
        self._reset_counters()  # the profiling steps are not the user's

    def set_synthetic_acceptance(self, rates: float | list[float] | None) -> None:
        """Accept drafts at these rates whatever the tokens (not lossless: benchmarks with dummy
        weights; ``synthetic_acceptance_rate``), or verify them (None)."""
        seed = self.config.seed
        self._synthetic = SyntheticAcceptance(rates, seed=seed) if rates is not None else None

    @contextlib.contextmanager
    def recording(self) -> Iterator[Recording]:
        """Statistics and pass timings of the steps taken inside the block only (one run's)."""
        recording = Recording()
        self._recordings.append(recording)
        try:
            yield recording
        finally:
            self._recordings.remove(recording)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._profile_pending:
            raise RuntimeError(
                '"dynamic_config_path": "auto": this engine is not profiled yet; build it with '
                "dynaspec.engine.build.build_engine(config), or call engine.profile_auto(auto_profile)"
            )
        began = time.perf_counter()
        plan = self.scheduler.schedule(self._k_policy)  # who runs, tokens each, K for this step
        if self._synthetic is not None:  # acceptance that ignores the tokens ignores their confidence
            plan.min_draft_confidence = 0.0
        self.proposer.release(plan.released)  # forget finished and preempted requests
        if plan.is_empty:
            return []
        # temperature, top-k/p, penalties, seeds and logprobs wanted per row
        sampling = SamplingTensors.of(plan.sampled, self.model_config.vocab_size, self.device)
        if self.allocator.num_shared:
            self._unshare_drafted_blocks(plan)
        drafts = self.proposer.propose(plan, sampling)  # up to k_caps[i] draft tokens per decode
        start = self._clock.mark()
        logits = self.runner.forward(plan, drafts)  # one target pass: last tokens + drafts + prefills
        end = self._clock.mark()
        self.proposer.read_hidden(plan, drafts, logits.hidden)  # an EAGLE head's input; else None
        # accepted drafts + one token each, logprobs
        result = verify(logits.sampled, drafts, sampling, self._synthetic)
        result.prompt_logprobs = score_prompts(logits.prompts, plan.prefills)  # for prompt_logprobs
        self.proposer.commit(plan, result)  # e.g. draft-model KV catch-up
        timing = StepTiming.of(plan, result, self._clock.ms(start, end), drafts.timed_passes())
        paid = self.proposer.pays_for_unfilled_positions()
        outputs = self.scheduler.update(plan, result)  # append, finish, free KV
        timing.step_ms = (time.perf_counter() - began) * 1000  # the whole step, as the profile's cells
        self._observe(StepRecord(plan, result, timing, result.draft_confidence, paid))
        return outputs

    def _unshare_drafted_blocks(self, plan: SchedulePlan) -> None:
        """Give each drafting request copies of the shared blocks its drafter will write into
        this step (``Proposer.kv_writes``): a drafter's K/V sits at indices of its own (its window
        shifts them), so a prefix-cached block's drafter K/V is its first holder's. A request left
        without a free block for a copy drafts nothing this step."""
        bs, allocator = self.config.block_size, self.allocator
        copies: list[tuple[int, int]] = []
        for i, r in enumerate(plan.decodes):
            span = self.proposer.kv_writes(r, plan.k_caps[i]) if plan.k_caps[i] else None
            if span is None:
                continue
            blocks = r.block_ids
            for j in range(span[0] // bs, min(len(blocks), cdiv(span[1], bs))):
                if allocator.is_shared(blocks[j]):
                    copy = allocator.unshare(blocks[j])
                    if copy is None:
                        plan.k_caps[i] = 0
                        break
                    copies.append((blocks[j], copy))
                    blocks[j] = copy
        if copies:
            self.runner.copy_blocks(copies)
            self.proposer.copy_kv_blocks(copies)

    def _observe(self, record: StepRecord) -> None:
        c = self.counters
        c.num_steps += 1
        c.num_generated_tokens += sum(len(t) for t in record.result.token_ids)
        cached = (p.request.num_cached_tokens for p in record.plan.prefills if p.first)
        c.num_cached_prompt_tokens += sum(cached)
        if record.plan.num_decodes:
            c.chosen_k = record.plan.chosen_k
        c.spec.observe(record)
        if self._k_policy is not None:
            self._k_policy.observe(record)
        for recording in self._recordings:
            recording.spec.observe(record)
            recording.timings.append(record.timing)

    def _prefix_cache_stats(self) -> dict:
        c, a = self.counters, self.allocator
        return {
            "enabled": a.prefix_caching,
            "cached_prompt_tokens": c.num_cached_prompt_tokens,
            "hit_rate": round(c.num_cached_prompt_tokens / max(1, c.num_prompt_tokens), 4),
            "cached_blocks": a.num_cached_blocks,
            "evicted_blocks": a.num_evicted,
            "unshared_blocks": a.num_unshared,  # copies a drafter took before writing its K/V
        }

    def stats(self) -> dict:
        out = {
            "num_steps": self.counters.num_steps,
            "num_prompt_tokens": self.counters.num_prompt_tokens,
            "num_generated_tokens": self.counters.num_generated_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_cache_usage": round(self.allocator.usage, 4),
            # bytes of the KV budget written at least once (resident on the CPU from then on)
            "kv_cache_touched_bytes": self.allocator.num_touched * self.kv_bytes_per_block,
            "prefix_cache": self._prefix_cache_stats(),
        }
        if self.config.speculative_config is not None:
            out["spec"] = self.counters.spec.to_dict()
            out["spec"]["policy"] = self._k_policy.snapshot()
            out["spec"]["proposer"] = self.proposer.stats()  # e.g. the suffix trees' tokens and nodes
        return out
