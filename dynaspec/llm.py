"""Offline batch API: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from dynaspec.engine.build import build_engine
from dynaspec.engine.engine import EngineConfig
from dynaspec.engine.types import TokenLogprob
from dynaspec.sampling_params import SamplingParams


@dataclass(slots=True)
class CompletionOutput:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    arrival_time: float
    first_token_time: float | None
    finish_time: float
    logprobs: list[TokenLogprob] | None = None  # with params.logprobs: one per output token (raw)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with params.prompt_logprobs


class LLM:
    def __init__(self, model: str, **engine_kwargs) -> None:
        self.engine = build_engine(EngineConfig(model=model, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str | list[int] | list[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[CompletionOutput]:
        """Run every prompt through the engine concurrently; outputs come back in input order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("params: one SamplingParams per prompt, or a single one for all")
        added = []
        try:
            for p, sp in zip(prompts, params):
                added.append(self.engine.add_request(p, sp))
        except ValueError:
            for r in added:
                self.engine.abort(r.request_id)
            raise
        requests = {r.request_id: r for r in added}
        ids = [r.request_id for r in added]
        finish_time: dict[str, float] = {}
        with tqdm(total=len(ids), desc="generate", disable=not progress, unit="req") as bar:
            while len(finish_time) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in requests:
                        finish_time[out.request_id] = time.monotonic()
                        bar.update(1)
        return [
            CompletionOutput(
                prompt_token_ids=requests[i].prompt_token_ids,
                text=requests[i].output_text,
                token_ids=list(requests[i].output_token_ids),
                finish_reason=requests[i].finish_reason.value if requests[i].finish_reason else None,
                arrival_time=requests[i].arrival_time,
                first_token_time=requests[i].first_token_time,
                finish_time=finish_time[i],
                logprobs=requests[i].output_logprobs if requests[i].params.logprobs is not None else None,
                prompt_logprobs=requests[i].prompt_logprobs,
            )
            for i in ids
        ]

    def stats(self) -> dict:
        return self.engine.stats()
