"""Measuring what the goodput policy needs: acceptance per position and ITL(batch size, K).

Everything runs in this process on one engine: acceptance comes from generating on a dataset at
the maximum K; ITL(bs, K) is the median wall time of an engine step (draft + verify + sample) with
exactly bs requests decoding, after warm-up steps, cycling K over 0..max with the same requests.
Every step of both phases is also timed pass by pass (target; each drafter pass, catch-ups
included) and fitted into the profile's ``cost_model``, the prior of the goodput policy's live
cost model.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from dynaspec.bench.common import environment
from dynaspec.engine.engine import Engine
from dynaspec.sampling_params import SamplingParams
from dynaspec.spec.cost import StepTiming, fit_timings
from dynaspec.spec.policy import FixedK
from dynaspec.spec.profile import Profile, derive_table


@dataclass(slots=True)
class ProfileSettings:
    batch_sizes: list[int]
    max_k: int
    num_acceptance_prompts: int = 16
    acceptance_max_tokens: int = 96
    warmup_steps: int = 2
    measured_steps: int = 5
    temperature: float = 0.0


def measure_acceptance(
    engine: Engine, prompts: list, settings: ProfileSettings, progress: bool = True, timings: list | None = None
) -> list[float]:
    """α_i for i = 1..max_k, from generating on ``prompts`` with K fixed at max_k."""
    engine.scheduler.k_chooser = FixedK(settings.max_k)
    before = engine.counters.spec.accepted_per_pos[:], engine.counters.spec.drafted_per_pos[:]
    params = SamplingParams(max_tokens=settings.acceptance_max_tokens, temperature=settings.temperature, seed=0)
    chosen = prompts[: settings.num_acceptance_prompts]
    for p in chosen:
        engine.add_request(p, params)
    with tqdm(total=len(chosen), desc="acceptance", unit="req", disable=not progress) as bar:
        while engine.has_unfinished():
            bar.update(sum(o.finished for o in _step(engine, timings)))
    stats = engine.counters.spec
    rates = []
    for i in range(settings.max_k):
        accepted = _at(stats.accepted_per_pos, i) - _at(before[0], i)
        drafted = _at(stats.drafted_per_pos, i) - _at(before[1], i)
        rates.append(accepted / drafted if drafted else 0.0)
    return rates


def measure_itl(
    engine: Engine, prompts: list, settings: ProfileSettings, progress: bool = True, timings: list | None = None
) -> dict[int, dict[int, float]]:
    """Median step time in ms for each batch size and K = 0..max_k."""
    batch_stats: dict[int, dict[int, float]] = {}
    cells = len(settings.batch_sizes) * (settings.max_k + 1)
    steps_per_cell = settings.warmup_steps + settings.measured_steps
    with tqdm(total=cells, desc="ITL(bs, K)", unit="cell", disable=not progress) as bar:
        for bs in settings.batch_sizes:
            # enough tokens for every K to run its steps without any request finishing
            budget = steps_per_cell * (settings.max_k + 1) * (settings.max_k + 1) + 8
            params = SamplingParams(max_tokens=budget, temperature=settings.temperature, ignore_eos=True, seed=0)
            requests = [engine.add_request(prompts[i % len(prompts)], params) for i in range(bs)]
            engine.scheduler.k_chooser = FixedK(0)
            while not all(r.is_decoding for r in requests):  # prefill everyone first
                _step(engine, timings)
            batch_stats[bs] = {}
            for k in range(settings.max_k + 1):
                engine.scheduler.k_chooser = FixedK(k)
                times = []
                for step in range(steps_per_cell):
                    start = time.perf_counter()
                    _step(engine, timings)
                    if step >= settings.warmup_steps:
                        times.append((time.perf_counter() - start) * 1000)
                batch_stats[bs][k] = round(statistics.median(times), 3)
                bar.update(1)
            for r in requests:
                engine.abort(r.request_id)
    return batch_stats


def run_profile(engine: Engine, prompts: list, settings: ProfileSettings, meta: dict, progress: bool = True) -> Profile:
    policy = engine.scheduler.k_chooser
    timings: list[StepTiming] = []
    try:
        alpha = measure_acceptance(engine, prompts, settings, progress, timings)
        batch_stats = measure_itl(engine, prompts, settings, progress, timings)
    finally:
        engine.scheduler.k_chooser = policy
    return Profile(
        max_num_speculative_tokens=settings.max_k,
        acceptance_rate_per_pos=[round(a, 4) for a in alpha],
        batch_stats=batch_stats,
        num_speculative_tokens_per_batch_size=derive_table(alpha, batch_stats, settings.max_k),
        cost_model=fit_timings(timings),
        meta={
            **meta,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "device": str(engine.device),
            "cpu": environment()["cpu"],
            "threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "settings": {
                "batch_sizes": settings.batch_sizes,
                "warmup_steps": settings.warmup_steps,
                "measured_steps": settings.measured_steps,
                "acceptance_prompts": settings.num_acceptance_prompts,
                "acceptance_max_tokens": settings.acceptance_max_tokens,
                "temperature": settings.temperature,
            },
        },
    )


def _step(engine: Engine, timings: list | None) -> list:
    outputs = engine.step()
    if timings is not None and engine.last_timing is not None:
        timings.append(engine.last_timing)
    return outputs


def _at(values: list[int], i: int) -> int:
    return values[i] if i < len(values) else 0
