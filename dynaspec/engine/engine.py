"""The engine: request -> scheduler -> proposer -> target forward -> rejection sampler -> outputs."""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass, field

import torch

from dynaspec.engine.kv_cache import BlockAllocator, kv_bytes_per_token
from dynaspec.engine.request import Request, RequestOutput
from dynaspec.engine.runner import ModelRunner, TokenRun
from dynaspec.engine.sampler import SamplingTensors
from dynaspec.engine.scheduler import SchedulePlan, Scheduler, StepResult
from dynaspec.models.llama import LlamaModel
from dynaspec.models.loader import load_hf_dir, resolve_model
from dynaspec.models.tokenizer import IncrementalDetokenizer
from dynaspec.sampling_params import SamplingParams
from dynaspec.spec.config import SpeculativeConfig
from dynaspec.spec.cost import StepTiming
from dynaspec.spec.policy import make_policy
from dynaspec.spec.proposer import Drafts, ProposerContext, make_proposer
from dynaspec.spec.rejection import rejection_sample
from dynaspec.spec.stats import SpecStats

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto: bfloat16 (the fast CPU/GPU choice); float32 is the exactness reference
    device: str = "auto"  # auto: cuda if present, else cpu
    max_num_seqs: int = 32
    max_model_len: int | None = None  # default: the model's context, capped by the KV budget
    max_num_batched_tokens: int = 512  # per step; prefill chunks fill what decodes leave
    kv_cache_memory_gb: float = 2.0
    block_size: int = 16
    speculative_config: SpeculativeConfig | dict | str | None = None
    seed: int = 0  # seeds requests that give no seed of their own
    progress: bool = True

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device: must be auto, cpu or cuda[:N]; got {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
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

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "auto" else DTYPES[self.dtype]


@dataclass(slots=True)
class EngineCounters:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    spec: SpecStats = field(default_factory=SpecStats)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        device, dtype = config.torch_device, config.torch_dtype
        path = resolve_model(config.model, progress=config.progress)
        model_config, weights, self.tokenizer = load_hf_dir(path)
        self.model_config = model_config
        self.proposer = make_proposer(
            config.speculative_config, ProposerContext(self.tokenizer, dtype, device, config.block_size)
        )
        model = LlamaModel.from_weights(model_config, weights, dtype, device)
        del weights

        bytes_per_token = kv_bytes_per_token(model_config, dtype) + self.proposer.kv_bytes_per_token()
        num_blocks = max(1, int(config.kv_cache_memory_gb * 2**30) // (bytes_per_token * config.block_size))
        capacity = num_blocks * config.block_size
        max_len = config.max_model_len or model_config.max_position_embeddings
        if max_len > capacity:
            log.warning("max_model_len %d exceeds the KV budget (%d tokens); capping it", max_len, capacity)
            max_len = capacity
        self.max_model_len = max_len
        self.allocator = BlockAllocator(num_blocks, config.block_size)
        self.runner = ModelRunner(model, num_blocks * config.block_size, config.block_size, dtype, device)
        self.proposer.allocate_kv(num_blocks * config.block_size)
        self.k_policy = make_policy(config.speculative_config) if config.speculative_config else None
        self.scheduler = Scheduler(
            self.allocator,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.k_policy,
            pending_draft_tokens=getattr(self.proposer, "pending_tokens", None),
        )
        self.last_timing: StepTiming | None = None  # pass times of the latest step (profiler, cost model)
        self.counters = EngineCounters()
        self._seeds = random.Random(config.seed)
        self._ids = itertools.count()
        self.device = device
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)

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
            generator=torch.Generator(device=self.device).manual_seed(seed),
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

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()  # who runs, tokens each, K for this step
        self.proposer.release(plan.released)
        if not plan.decodes and not plan.prefills:
            return []
        sampling = self._sampling(plan)
        drafts = self.proposer.propose(plan, sampling)  # drafts for the decode requests
        drafts = drafts.padded(len(plan.sampled))
        start = time.perf_counter()
        logits = self._verify(plan, drafts)  # one target pass over last tokens + drafts + prefills
        self._sync()
        target_ms = (time.perf_counter() - start) * 1000
        tokens = rejection_sample(logits, drafts.token_ids, drafts.num_drafts, drafts.probs, sampling)
        result = StepResult(token_ids=tokens, num_drafts=drafts.num_drafts[: plan.num_decodes])
        self.proposer.commit(plan, result)  # e.g. draft-model KV catch-up
        self._observe(plan, result)
        self.last_timing = StepTiming(
            verify_tokens=plan.num_decodes + sum(result.num_drafts),
            prefill_tokens=sum(c.num_tokens for c in plan.prefills),
            target_ms=target_ms,
            draft_passes=list(getattr(self.proposer, "last_pass_timings", ())) if plan.k else [],
        )
        if self.scheduler.k_chooser is not None:
            self.scheduler.k_chooser.observe_timing(self.last_timing)
        return self.scheduler.update(plan, result)  # append, finish, free KV

    def _sync(self) -> None:
        if self.device.type == "cuda":  # kernels are asynchronous: time what really ran
            torch.cuda.synchronize(self.device)

    def _sampling(self, plan: SchedulePlan) -> SamplingTensors:
        sampled = plan.sampled
        return SamplingTensors.build([r.params for r in sampled], [r.generator for r in sampled], self.device)

    def _verify(self, plan: SchedulePlan, drafts: Drafts) -> torch.Tensor:  # [len(sampled), k + 1, vocab]
        runs = []
        for i, r in enumerate(plan.decodes):
            n = drafts.num_drafts[i]
            last = r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1]
            runs.append(TokenRun([last] + drafts.token_ids[i, :n].tolist(), r.num_computed_tokens, r.block_ids, list(range(n + 1))))
        for chunk in plan.prefills:
            r = chunk.request
            start = r.num_computed_tokens
            rows = [chunk.num_tokens - 1] if chunk.completes else []
            runs.append(TokenRun(r.token_at(start, start + chunk.num_tokens), start, r.block_ids, rows))
        flat = self.runner.run(runs)  # [rows, vocab]
        width = drafts.k + 1
        padded = flat.new_zeros(len(plan.sampled), width, flat.shape[-1])
        row = 0
        sampled_i = 0
        for run in runs:
            n = len(run.logit_rows)
            if n:
                padded[sampled_i, :n] = flat[row : row + n]
                sampled_i += 1
                row += n
        return padded

    def _observe(self, plan: SchedulePlan, result: StepResult) -> None:
        c = self.counters
        c.num_steps += 1
        c.num_generated_tokens += sum(len(t) for t in result.token_ids)
        if plan.num_decodes:
            c.spec.observe(
                plan.num_decodes, plan.chosen_k, result.num_drafts, [len(t) for t in result.token_ids[: plan.num_decodes]]
            )

    def stats(self) -> dict:
        out = {
            "num_steps": self.counters.num_steps,
            "num_prompt_tokens": self.counters.num_prompt_tokens,
            "num_generated_tokens": self.counters.num_generated_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_cache_usage": round(self.allocator.usage, 4),
        }
        if self.config.speculative_config is not None:
            out["spec"] = self.counters.spec.to_dict()
            out["spec"]["policy"] = self.k_policy.snapshot()
        return out
