"""Measuring what the goodput policy needs: acceptance per position and ITL(batch size, K).

Everything runs in this process on one engine: acceptance comes from generating on a dataset at the
maximum K; ITL(bs, K) is the median wall time of an engine step (draft + verify + sample) with
exactly bs requests decoding. A shared CPU drifts by tens of percent within minutes, and the policy
compares K against K at one batch size, so a batch size's K cells are measured interleaved:
``rounds`` visits of every K (0..max, then max..0, ...), each a warm-up step (which also absorbs the
drafter's catch-up after a K=0 visit) and ``measured_steps`` timed steps; drift then lands on every
K alike. The first, dense batch sizes (the policy's closest calls) go in passes, every dense batch
size in turn each round, so it lands on them alike too. Every step is also timed pass by pass
(target; each drafter pass) and, together with drafter passes over whole prompts (the catch-up a new
request costs), fitted into the profile's ``cost_model``, the prior of the goodput policy's live
cost model.

``auto_profile`` is ``"dynamic_config_path": "auto"``: a quick profile of the engine on first use
(``engine.build.build_engine`` runs it; the engine never profiles itself), cached under the cache
directory keyed by everything that changes its figures (target, drafter, quantization, dtypes,
device, CPU, threads, torch), and read back after.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine
from dynaspec.engine.kv_cache import fill_kv_noise
from dynaspec.engine.types import DraftPass, StepTiming
from dynaspec.kpolicy.config import SpeculativeConfig
from dynaspec.kpolicy.cost import fit_timings
from dynaspec.kpolicy.policy import FixedK
from dynaspec.kpolicy.profile import (
    Profile,
    acceptance_length,
    checked_cost_model,
    context_cost_by_batch_of,
    context_cost_of,
    derive_table,
    implausible_steps,
    load_profile,
    rows_out_of_line,
    save_profile,
    smooth_itl,
)
from dynaspec.models.kernels import kernel_digest, kernel_error
from dynaspec.models.packs import cache_root
from dynaspec.sampling_params import SamplingParams

log = logging.getLogger(__name__)
# how profiles are measured, in the auto profile's key: 2 = n-gram rows filled when timed (a
# cached profile of an earlier version is measured again), batch sizes 1-32 with 12 and 24;
# 3 = the engine's step costs changed under it (blocked attention, logits memory reused); 4 = cells
# visited in rotated order and outlying cells visited again; 5 = the first batch sizes timed
# densely, the cost model fitted within the grid's bounds (issue 37); 6 = a context axis (issue 40);
# 7 = close calls between drafting and not visited again (issue 37). Rows timed again when out of line
# with their neighbours' (``rows_out_of_line``) changed no cached profile: one out of line is not cached.
# 8 = the dense rows timed in passes, each pass every dense batch size in turn (issue 37); context
# cells at batch size 2 too, and a context cost per batch size (issue 40)
PROFILER_VERSION = 8


@dataclass(slots=True)
class ProfileSettings:
    batch_sizes: list[int]
    max_k: int
    num_acceptance_prompts: int = 16
    acceptance_max_tokens: int = 96
    warmup_steps: int = 1  # per visit of a (bs, K) cell
    measured_steps: int = 2  # timed steps per visit
    rounds: int = 3  # visits of every (bs, K) cell, in the order `visit_order` gives
    # the first this many batch sizes are visited max(rounds, dense_rounds) times with
    # max(measured_steps, dense_measured_steps) timed steps a visit: the cost model's fit and the
    # policy's close calls lean on them, and they are the cheapest cells to time
    dense_batch_sizes: int = 0
    dense_rounds: int = 0
    dense_measured_steps: int = 0
    revisits: int = 2  # times a cell off its batch size's line in K (`outlying_cells`) is visited again
    # rounds of visits (K=0, the best K, the best K, K=0) given a batch size whose best drafting K and
    # K=0 are a close call (`close_call`, by the acceptance measured first), while the time budget lasts
    close_rounds: int = 0
    catchup_rows: tuple[int, ...] = (1, 2, 4)  # whole prompts per timed drafter catch-up pass
    catchup_repeats: int = 2
    temperature: float = 0.0
    # once the grid has taken this long, the batch sizes not yet begun are left out (the policy
    # extends the grid along its last slope); the first MIN_BATCH_SIZES are always measured
    time_budget_s: float | None = None
    # the context axis (``measure_context_itl``): contexts per request (tokens) to time a few cells
    # over, at these batch sizes and Ks (default 0, max_k / 2 and max_k); () for none
    context_lengths: tuple[int, ...] = ()
    context_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    context_ks: tuple[int, ...] = ()
    context_rounds: int = 2


def measure_acceptance(
    engine: Engine,
    prompts: list,
    settings: ProfileSettings,
    progress: bool = True,
    timings: list | None = None,
) -> list[float]:
    """α_i for i = 1..max_k, from generating on ``prompts`` with K fixed at max_k."""
    params = SamplingParams(
        max_tokens=settings.acceptance_max_tokens, temperature=settings.temperature, seed=0
    )
    chosen = prompts[: settings.num_acceptance_prompts]
    with _fixed_k(engine, settings.max_k), engine.recording() as run:
        for p in chosen:
            engine.add_request(p, params)
        with tqdm(total=len(chosen), desc="acceptance", unit="req", disable=not progress) as bar:
            while engine.has_unfinished():
                bar.update(sum(o.finished for o in engine.step()))
    if timings is not None:
        timings.extend(run.timings)
    rates = run.spec.acceptance_rate_per_pos
    return [rates[i] if i < len(rates) else 0.0 for i in range(settings.max_k)]


REVISIT_TOLERANCE = 0.10  # a cell this far off its batch size's line in K is visited again
MIN_BATCH_SIZES = 3  # batch sizes a time budget never leaves out
AUTO_TIME_BUDGET_S = 150.0  # the quick profile's ITL grid (the whole profile: ~1 min on the AVX-512 EPYC)
AUTO_CONTEXT_TOKENS = 4096  # the quick profile's long context (the grid's is a few hundred tokens)


def visit_order(ks: list[int], rounds: int) -> list[list[int]]:
    """The K order of each round: round r starts r/rounds of the way along the Ks and every other
    round runs backwards, so no cell is visited twice in a row (given more Ks than rounds) and
    drift lands on the Ks alike. Plain alternation (0..5, 5..0, 0..5) visited K=0 and K=max twice
    in a row, so 4 of their 6 timed steps fell in one stretch of a shared CPU: the first EPYC
    profile's ITL(8, 0) was 62.7 ms where 51-55 is its cost, and the policy speculated at 8
    requests where plain decoding was faster (the results diary)."""
    orders = []
    for r in range(rounds):
        shift = r * len(ks) // rounds
        order = ks[shift:] + ks[:shift]
        orders.append(order[::-1] if r % 2 else order)
    return orders


def outlying_cells(row: dict[int, float], tolerance: float = REVISIT_TOLERANCE) -> list[int]:
    """The Ks of one batch size's cells (K -> ms) that look like noise, to be timed again.

    Each K adds a drafter pass and bs verified tokens, so for K >= 1 a step's time is close to a
    line in K; its Theil-Sen fit (median slope, median intercept) ignores one stray cell. A K >= 1
    cell more than ``tolerance`` off the line is an outlier. So is K = 0 above, by as much, the
    line through K = 1 and 2 at 0: plain decoding costs no more than a speculative step without
    its drafts (the local line, since verifying more rows per request gets dearer per row, and a
    line through all Ks would put 0 too low). Fewer than three K >= 1 cells fit no line: nothing
    is flagged."""
    spec = sorted((k, ms) for k, ms in row.items() if k >= 1)
    if len(spec) < 3:
        return []
    slope = statistics.median(
        (b - a) / (kb - ka) for i, (ka, a) in enumerate(spec) for kb, b in spec[i + 1 :]
    )
    intercept = statistics.median(ms - slope * k for k, ms in spec)
    line = {k: intercept + slope * k for k, _ in spec}
    flagged = [k for k, ms in spec if abs(ms - line[k]) > tolerance * line[k]]
    no_drafts = 2 * row[1] - row[2] if 1 in row and 2 in row else intercept
    if 0 in row and no_drafts > 0 and row[0] > (1 + tolerance) * no_drafts:
        flagged.insert(0, 0)
    return flagged


CLOSE_MARGIN = 0.15  # a batch size is a close call while neither side's goodput beats the other's by this


def close_call(row: dict[int, float], alpha: list[float], margin: float = CLOSE_MARGIN) -> list[int]:
    """[0, K] when drafting at one batch size is a close call: K the best drafting K of ``row``
    (K -> ms, read as the policy reads it: ``smooth_itl``) by goodput AL(K) / ITL
    (``acceptance_length`` over ``alpha``), and neither it nor K = 0 ahead of the other by
    ``margin``; [] otherwise. Two quick auto profiles of the pair on one machine (xeon, each cell
    the median of 9 steps) put ITL(2, 1) at 131.7 and 110.1 ms, and the policy drafted at 2
    requests by one and not by the other (issue 37): whether to draft is the decision whose noise
    a user sees, so its two cells get more steps, side by side."""
    smoothed = smooth_itl({1: row})[1] if row else {}
    scores = {k: acceptance_length(alpha, k) / ms for k, ms in smoothed.items() if k <= len(alpha)}
    drafting = [k for k in scores if k > 0]
    if 0 not in scores or not drafting:
        return []
    best = max(drafting, key=lambda k: (scores[k], -k))
    ratio = scores[best] / scores[0]
    return [0, best] if 1 / (1 + margin) < ratio < 1 + margin else []


def measure_itl(
    engine: Engine,
    prompts: list,
    settings: ProfileSettings,
    progress: bool = True,
    timings: list | None = None,
    revisited: dict[int, list[int]] | None = None,
    contexts: list[float] | None = None,
    alpha: list[float] | None = None,
    close_calls: dict[int, list[int]] | None = None,
    retimed: dict[int, int] | None = None,
) -> dict[int, dict[int, float]]:
    """Median step time in ms for each batch size and K = 0..max_k, K interleaved in rounds; each
    timed step's mean context per request goes into ``contexts`` (the grid's, for its context axis).

    After its rounds, a batch size's outlying cells (``outlying_cells``) are visited again, up to
    ``settings.revisits`` times, and such a cell's figure is the median of its new steps alone
    (the first ones are what made it look wrong); a cell that is truly off the line measures the
    same again and keeps its figure. The Ks visited again go into ``revisited`` per batch size.

    Then, given the acceptance ``alpha``, a batch size where drafting is a close call
    (``close_call``) has its two cells visited ``settings.close_rounds`` more times in the order
    0, K, K, 0 (drift lands on both alike) while the time budget lasts, their new steps pooled with
    the rest; the pairs go into ``close_calls`` per batch size.

    Last, rows whose plain step no quiet machine measures beside their neighbours'
    (``rows_out_of_line``) are timed again afresh, whole, up to ``settings.revisits`` times: a
    stretch of a shared VM that slows one row's steps 2-4x is what made them so, and a profile that
    keeps such a row is not cached (every later start would profile again). How often each batch
    size was timed again goes into ``retimed``.

    Every request drafts K tokens in a step timed at K: the proposer fills its rows
    (``fill_drafts``). An n-gram lookup that found no match would otherwise propose nothing, and
    the cell would time fewer verified tokens than bs x (K+1), as the first n-gram profile did:
    its ITL(16, 5) was 404 ms where 16 full rows of 5 cost 614 (the results diary, "The n-gram
    grid"). What a row is worth is the acceptance's business, per token proposed."""
    batch_stats: dict[int, dict[int, float]] = {}
    ks = list(range(settings.max_k + 1))
    visits = sum(len(ks) * _rounds(settings, i) for i in range(len(settings.batch_sizes)))
    began = time.perf_counter()

    def visit(k: int, measured_steps: int) -> list[float]:
        return _visit(engine, k, settings.warmup_steps, measured_steps, contexts)

    def time_row(i: int, bs: int, bar: tqdm, times: dict[int, list[float]] | None = None) -> dict[int, float]:
        """Row i (batch size bs): its rounds, unless ``times`` holds them already (the dense rows'
        passes), then its revisits and close calls."""
        rounds, measured_steps = _rounds(settings, i), _measured_steps(settings, i)
        visits_at_most = (
            (rounds if times is None else 0) * len(ks)
            + settings.revisits * len(ks)
            + 4 * settings.close_rounds
        )
        steps = visits_at_most * (settings.warmup_steps + measured_steps)
        with _decoding(engine, prompts, bs, settings, steps):
            if times is None:
                times = {k: [] for k in ks}
                for order in visit_order(ks, rounds):
                    for k in order:
                        times[k].extend(visit(k, measured_steps))
                        bar.update(1)
            return revisit_row(bs, times, measured_steps, bar)

    def dense_passes(sizes: list[int], bar: tqdm) -> dict[int, dict[int, list[float]]]:
        """The dense rows' rounds as passes: pass r visits every dense batch size in turn, each
        with fresh requests, at round r's K order. A stretch of a shared CPU slower than the rest
        then lands on every dense row alike, and each row's figures span the whole time all of
        them took: two zen5 auto profiles of the pair, each row timed whole in turn, put ITL(1, 0)
        at 23.6 and 18.9 ms and the line of the first one's drafting cells above its batch-2 line
        (24.6 against 23.4 ms at K=0), where 12 later rows timed pass by pass read 17.4-19.0
        (issue 37, the results diary)."""
        pooled: dict[int, dict[int, list[float]]] = {bs: {k: [] for k in ks} for bs in sizes}
        for order in visit_order(ks, _rounds(settings, 0)):
            for i, bs in enumerate(sizes):
                measured_steps = _measured_steps(settings, i)
                with _decoding(
                    engine, prompts, bs, settings, len(ks) * (settings.warmup_steps + measured_steps)
                ):
                    for k in order:
                        pooled[bs][k].extend(visit(k, measured_steps))
                        bar.update(1)
        return pooled

    def revisit_row(
        bs: int, times: dict[int, list[float]], measured_steps: int, bar: tqdm
    ) -> dict[int, float]:
        """Row bs's outlying cells visited again, then its close call, its requests decoding."""
        again: dict[int, list[float]] = {}
        for _ in range(settings.revisits):
            cells = outlying_cells(_medians(times, again))
            if not cells:
                break
            bar.total += len(cells)
            for k in cells:
                again.setdefault(k, []).extend(visit(k, measured_steps))
                bar.update(1)
        for _ in range(settings.close_rounds if alpha is not None else 0):
            spent = time.perf_counter() - began
            if settings.time_budget_s is not None and spent > settings.time_budget_s:
                break
            cells = close_call(_medians(times, again), alpha)
            if not cells:
                break
            if close_calls is not None:
                close_calls[bs] = cells
            bar.total += 2 * len(cells)
            for k in cells + cells[::-1]:
                (again[k] if k in again else times[k]).extend(visit(k, measured_steps))
                bar.update(1)
        if revisited is not None and again:
            revisited[bs] = sorted(again)
        return {k: round(ms, 3) for k, ms in _medians(times, again).items()}

    with (
        tqdm(total=visits, desc="ITL(bs, K)", unit="visit", disable=not progress) as bar,
        engine.recording() as run,
        filled_drafts(engine),
    ):
        dense = settings.batch_sizes[: settings.dense_batch_sizes]
        pooled = dense_passes(dense, bar) if len(dense) > 1 else {}
        for i, bs in enumerate(settings.batch_sizes):
            spent = time.perf_counter() - began
            if settings.time_budget_s is not None and i >= MIN_BATCH_SIZES and spent > settings.time_budget_s:
                log.warning(
                    "dynaspec: profile time budget (%.0f s) spent after %.0f s: batch sizes %s left to "
                    "the grid's last slope",
                    settings.time_budget_s,
                    spent,
                    settings.batch_sizes[i:],
                )
                break
            batch_stats[bs] = time_row(i, bs, bar, pooled.get(bs))
        for _ in range(settings.revisits):
            suspects = rows_out_of_line(batch_stats)
            if not suspects:
                break
            for bs in suspects:
                i = settings.batch_sizes.index(bs)
                bar.total += len(ks) * _rounds(settings, i)
                batch_stats[bs] = time_row(i, bs, bar)
                if retimed is not None:
                    retimed[bs] = retimed.get(bs, 0) + 1
    if timings is not None:
        timings.extend(run.timings)
    return batch_stats


@contextlib.contextmanager
def _decoding(
    engine: Engine, prompts: list, bs: int, settings: ProfileSettings, steps: int
) -> Iterator[list]:
    """``bs`` requests prefilled and decoding, with tokens enough for ``steps`` steps at any K
    without one finishing; aborted after."""
    budget = steps * (settings.max_k + 1) + 8
    params = SamplingParams(max_tokens=budget, temperature=settings.temperature, ignore_eos=True, seed=0)
    requests = [engine.add_request(prompts[j % len(prompts)], params) for j in range(bs)]
    try:
        with _fixed_k(engine, 0):
            while not all(r.is_decoding for r in requests):  # prefill everyone first
                engine.step()
        yield requests
    finally:
        for r in requests:
            engine.abort(r.request_id)


def _medians(times: dict[int, list[float]], again: dict[int, list[float]]) -> dict[int, float]:
    """Each cell's median step; a cell visited again (``again``) is its new steps' alone."""
    return {k: statistics.median(again.get(k) or t) for k, t in times.items() if t}


def _visit(
    engine: Engine, k: int, warmup_steps: int, measured_steps: int, contexts: list | None
) -> list[float]:
    """One visit of a cell: ``warmup_steps`` untimed steps at K, then the timed ones (ms)."""
    timed = []
    with _fixed_k(engine, k):
        for step in range(warmup_steps + measured_steps):
            start = time.perf_counter()
            engine.step()
            if step >= warmup_steps:
                timed.append((time.perf_counter() - start) * 1000)
                if contexts is not None:
                    running = engine.scheduler.running
                    contexts.append(sum(r.num_tokens for r in running) / max(1, len(running)))
    return timed


KEEP_PREFILLED = 16  # of a long context, the prompt tokens really prefilled (the rest are assumed read)


def measure_context_itl(
    engine: Engine, prompts: list, settings: ProfileSettings, progress: bool = True
) -> dict[int, dict[int, dict[int, float]]]:
    """ITL(bs, K) over long contexts: context -> bs -> K -> median ms, for ``settings.context_lengths``
    at ``context_batch_sizes`` and ``context_ks``, K interleaved in ``context_rounds`` rounds.

    Prefilling bs prompts of thousands of tokens would take minutes on a CPU, and only the step
    after it is timed. So each request's prompt (dataset prompts run together up to the length)
    has all but its last KEEP_PREFILLED tokens taken as computed (``Scheduler.admit_computed``),
    their K/V (the target's and a draft model's) filled with noise, which attention reads as
    it reads real K/V; the last tokens are prefilled and decoding starts from there. A context
    or batch size that does not fit the model's length or the KV cache is left out, with a notice;
    so are the batch sizes not begun once the cells have taken half the grid's time budget."""
    out: dict[int, dict[int, dict[int, float]]] = {}
    ks = sorted(set(settings.context_ks or (0, (settings.max_k + 1) // 2, settings.max_k)))
    steps = settings.warmup_steps + settings.measured_steps
    budget = settings.context_rounds * len(ks) * steps * (settings.max_k + 1) + 8
    ids = [engine.prompt_token_ids(p) for p in prompts]
    capacity = engine.allocator.num_free * engine.allocator.block_size
    cells = [
        (length, bs)
        for length in settings.context_lengths
        for bs in settings.context_batch_sizes
        if bs <= engine.config.max_num_seqs
    ]
    fits = [
        (length, bs)
        for length, bs in cells
        if length + budget < engine.max_model_len
        and bs * (length + budget + engine.allocator.block_size) < capacity
    ]
    if len(fits) < len(cells):
        log.warning(
            "dynaspec: profile: contexts x batch sizes %s do not fit the model's length (%d) or the KV "
            "cache (%d tokens); left out",
            sorted(set(cells) - set(fits)),
            engine.max_model_len,
            capacity,
        )
    cutoff = None if settings.time_budget_s is None else settings.time_budget_s / 2
    began = time.perf_counter()
    params = SamplingParams(max_tokens=budget, temperature=settings.temperature, ignore_eos=True, seed=0)
    with (
        tqdm(
            total=len(fits) * len(ks) * settings.context_rounds,
            desc="ITL over long contexts",
            unit="visit",
            disable=not progress,
        ) as bar,
        filled_drafts(engine),
    ):
        for n, (length, bs) in enumerate(fits):
            if n and cutoff is not None and time.perf_counter() - began > cutoff:
                log.warning(
                    "dynaspec: profile: long-context cells took half the time budget; %s left out", fits[n:]
                )
                break
            requests = [_long_context_request(engine, ids, length, i, params) for i in range(bs)]
            with _fixed_k(engine, 0):
                while not all(r.is_decoding for r in requests):
                    engine.step()
            times: dict[int, list[float]] = {k: [] for k in ks}
            for order in visit_order(ks, settings.context_rounds):
                for k in order:
                    times[k].extend(_visit(engine, k, settings.warmup_steps, settings.measured_steps, None))
                    bar.update(1)
            out.setdefault(length, {})[bs] = {k: round(statistics.median(t), 3) for k, t in times.items()}
            for r in requests:
                engine.abort(r.request_id)
    return out


def _long_context_request(
    engine: Engine, ids: list[list[int]], length: int, index: int, params: SamplingParams
):
    """A request of ``length`` prompt tokens (prompts run together, each request from another
    start), all but the last KEEP_PREFILLED assumed read, their K/V noise."""
    tokens: list[int] = []
    i = index
    while len(tokens) < length:
        tokens += ids[i % len(ids)]
        i += 1
    request = engine.add_request(tokens[:length], params)
    skipped = length - KEEP_PREFILLED
    if not engine.scheduler.admit_computed(request, skipped):
        raise RuntimeError("profile: the KV cache has no room for a long context")
    size = engine.allocator.block_size
    positions = torch.arange(skipped)
    slots = torch.tensor(request.block_ids)[positions // size] * size + positions % size
    fill_kv_noise(engine.runner.kv_caches, slots)
    engine.proposer.assume_read(request, skipped, slots)
    return request


def _rounds(settings: ProfileSettings, index: int) -> int:
    """Visits of every K at the index-th batch size (more for the first, dense ones)."""
    dense = index < settings.dense_batch_sizes
    return max(settings.rounds, settings.dense_rounds) if dense else settings.rounds


def _measured_steps(settings: ProfileSettings, index: int) -> int:
    dense = index < settings.dense_batch_sizes
    return max(settings.measured_steps, settings.dense_measured_steps) if dense else settings.measured_steps


def measure_catchup(engine: Engine, prompts: list, settings: ProfileSettings, timings: list) -> None:
    """Time drafter passes over whole prompts (what a new request costs the drafter) into ``timings``.

    In ordinary steps a catch-up pass is rare (once per request) and often the first of its size
    (slower), so those alone would pin the cost model's per-token catch-up slope poorly.
    """
    ids = [engine.prompt_token_ids(p) for p in prompts]
    for rows in settings.catchup_rows:
        chosen = [ids[i % len(ids)] for i in range(rows)]
        tables: list[list[int]] = [[] for _ in chosen]
        try:
            if not all(engine.allocator.grow(t, len(c)) for t, c in zip(tables, chosen)):
                break  # the KV budget holds no more prompts at once
            if (
                engine.proposer.catch_up(chosen, tables) is None
            ):  # warm-up: first passes of a shape are slower
                return  # a proposer with nothing to catch up on (ngram)
            for _ in range(settings.catchup_repeats):
                ms = engine.proposer.catch_up(chosen, tables)
                extra = sum(len(c) for c in chosen) - rows
                timings.append(StepTiming(0, 0, 0.0, [DraftPass(rows, extra, ms)]))
        finally:
            for t in tables:
                engine.allocator.free(t)


def run_profile(
    engine: Engine,
    prompts: list,
    settings: ProfileSettings,
    meta: dict,
    progress: bool = True,
    name: str = "(being measured)",
) -> Profile:
    """Acceptance, the ITL grid and the cost model; ``name`` (the file it goes to) names the
    profile in the notice given when its cost model contradicts its grid (``checked_cost_model``:
    the profile then has no ``cost_model`` and the policy prices passes from the grid). The
    prompts come back cell after cell, so prefix caching is off meanwhile: each cell prefills
    them as a user's new requests would."""
    with engine.prefix_caching_off():
        return _run_profile(engine, prompts, settings, meta, progress, name)


def _run_profile(
    engine: Engine, prompts: list, settings: ProfileSettings, meta: dict, progress: bool, name: str
) -> Profile:
    timings: list[StepTiming] = []
    seconds: dict[str, float] = {}  # what each part took
    clock = time.perf_counter()

    def lap(part: str) -> None:
        nonlocal clock
        seconds[part] = round(time.perf_counter() - clock, 1)
        clock = time.perf_counter()

    alpha = measure_acceptance(engine, prompts, settings, progress, timings)
    lap("acceptance")
    revisited: dict[int, list[int]] = {}
    close_calls: dict[int, list[int]] = {}
    retimed: dict[int, int] = {}
    contexts: list[float] = []
    batch_stats = measure_itl(
        engine, prompts, settings, progress, timings, revisited, contexts, alpha, close_calls, retimed
    )
    lap("grid")
    measure_catchup(engine, prompts, settings, timings)
    lap("catchup")
    fitted = fit_timings(timings, smooth_itl(batch_stats))
    caught_up = any(extra > 1 for t in timings for _, extra, _ in t.draft_passes)
    context_stats = (
        measure_context_itl(engine, prompts, settings, progress) if settings.context_lengths else {}
    )
    lap("context")
    profile = Profile(
        max_num_speculative_tokens=settings.max_k,
        acceptance_rate_per_pos=[round(a, 4) for a in alpha],
        batch_stats=batch_stats,
        num_speculative_tokens_per_batch_size=derive_table(
            alpha, batch_stats, settings.max_k, engine.config.max_num_seqs
        ),
        cost_model=fitted,
        catchup_ms_per_token=round(fitted["draft_pass_ms"][2], 4) if caught_up else None,
        context_tokens=round(statistics.mean(contexts), 1) if contexts and context_stats else None,
        context_stats=context_stats,
        meta={
            **meta,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "device": str(engine.device),
            "cpu": cpu_name(),
            "threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "seconds": seconds,
            "settings": {
                "batch_sizes": settings.batch_sizes,
                "warmup_steps": settings.warmup_steps,
                "measured_steps": settings.measured_steps,
                "rounds": settings.rounds,
                "dense_batch_sizes": settings.batch_sizes[: settings.dense_batch_sizes],
                "dense_rounds": settings.dense_rounds,
                "dense_measured_steps": settings.dense_measured_steps,
                "revisits": settings.revisits,
                "revisited": {str(bs): ks for bs, ks in revisited.items()},
                "close_rounds": settings.close_rounds,
                "close_calls": {str(bs): ks for bs, ks in close_calls.items()},
                "retimed": {str(bs): n for bs, n in retimed.items()},
                "batch_sizes_measured": sorted(batch_stats),
                "acceptance_prompts": settings.num_acceptance_prompts,
                "acceptance_max_tokens": settings.acceptance_max_tokens,
                "temperature": settings.temperature,
                "context_lengths": list(settings.context_lengths),
                "context_batch_sizes": list(settings.context_batch_sizes),
                "context_rounds": settings.context_rounds,
            },
        },
    )
    profile.cost_model = checked_cost_model(profile, name)
    profile.context_cost = context_cost_of(profile)
    profile.context_cost_by_batch = context_cost_by_batch_of(profile)
    return profile


@contextlib.contextmanager
def _fixed_k(engine: Engine, k: int) -> Iterator[None]:
    """Run the block with K fixed, then give the engine its own policy back."""
    previous = engine.set_k_policy(FixedK(k))
    try:
        yield
    finally:
        engine.set_k_policy(previous)


@contextlib.contextmanager
def filled_drafts(engine: Engine) -> Iterator[None]:
    """Run the block with every request drafting its whole K (see ``measure_itl``; the benchmarks
    that time steps by rows use it too)."""
    engine.proposer.fill_drafts = True
    try:
        yield
    finally:
        engine.proposer.fill_drafts = False


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown"
            )
    except OSError:
        return "unknown"


def auto_settings(max_k: int, max_num_seqs: int) -> ProfileSettings:
    """The quick profile: batch sizes 1..32 (up to max_num_seqs; above the largest, the grid goes
    on along its last slope), K = 0..max_k, one round, and acceptance from 8 short generations;
    the live estimates refine both afterwards. Batch sizes not begun within AUTO_TIME_BUDGET_S are
    left out: on a CPU without AVX-512 every verified row is dear (about 30 ms for the 1.5B on the
    2-core Zen 3 EPYC, where plain steps are linear in rows from 2 on) and the whole grid took
    10 minutes, most of it the larger sizes' prompts and rows. 12 and 24 are in because a step's cost is not
    linear between 8, 16 and 32: the quantized kernels take 16 rows at a time from 12 rows on, so
    24 plain rows cost nearly what 32 do (196 and 205 ms in the n-gram auto profile here, where a
    line through 16 and 32 says 162; the results diary, "The n-gram grid").

    The first three batch sizes get three rounds of three timed steps, in passes (1, 2, 4, 1, 2, 4,
    ...), and the drafter's catch-up two timed passes: they are the cheapest cells (about 15 s more
    on the AVX-512 EPYC, taken from the same budget) and the ones the cost model's fit and the
    policy's closest calls rest on. With two steps a cell and one round, a quick draft-pair grid
    fitted a drafter pass of 75 ms with a negative slope per row where its grid showed ~10 ms, and
    the policy never drafted (issue 37). A batch size where drafting or not is a close call by the
    measured acceptance gets two more rounds of its two cells (``close_call``).

    The context axis: batch sizes 1, 2, 4 and 8 at K = 0, max_k / 2 and max_k over contexts of
    AUTO_CONTEXT_TOKENS a request, two rounds (``measure_context_itl``: no prefill of the long
    prompts), within half the grid's budget; each batch size's cells get their own fit
    (``kpolicy.context.fit_context_cost_by_batch``), so the sizes the policy decides most (1, 2,
    4) each have theirs."""
    return ProfileSettings(
        batch_sizes=[b for b in (1, 2, 4, 8, 12, 16, 24, 32) if b <= max_num_seqs] or [1],
        max_k=max_k,
        num_acceptance_prompts=8,
        acceptance_max_tokens=48,
        warmup_steps=1,
        measured_steps=2,
        rounds=1,
        dense_batch_sizes=3,
        dense_rounds=3,
        dense_measured_steps=3,
        catchup_rows=(1, 2),
        catchup_repeats=2,
        close_rounds=2,
        time_budget_s=AUTO_TIME_BUDGET_S,
        context_lengths=(AUTO_CONTEXT_TOKENS,),
        context_batch_sizes=tuple(b for b in (1, 2, 4, 8) if b <= max_num_seqs) or (1,),
    )


def auto_profile_key(engine: Engine, spec: SpeculativeConfig) -> dict:
    """What the cached profile's figures depend on."""
    return {
        "profiler": PROFILER_VERSION,
        "target": _model_id(engine.config.model),
        "drafter": _model_id(spec.model) if spec.model else spec.method,
        "draft_vocab_size": spec.draft_vocab_size,
        "draft_quantization": spec.drafter_quantization(engine.device.type, engine.config.quantization),
        "quantization": engine.quantization,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "kv_dtype": str(engine.kv_dtype).removeprefix("torch."),
        "device": str(engine.device),
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        # the C++ operators' sources (their speed is the profile's prices), None where they do not build
        "kernels": kernel_digest() if kernel_error() is None else None,
        "max_k": spec.max_k,
        "ngram": [spec.prompt_lookup_min, spec.prompt_lookup_max] if spec.method == "ngram" else None,
        # only when set, so that the profiles cached before the window existed keep their keys
        **({"draft_context_window": spec.context_window} if spec.context_window else {}),
    }


def auto_profile_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = Path(key["target"]).name.removesuffix(".gguf")
    return cache_root() / "profiles" / f"{name}-{digest}.json"


def auto_profile(engine: Engine, spec: SpeculativeConfig) -> Profile:
    """The cached profile for this engine and machine, made (quickly) on first use.

    A cached file that cannot be read is removed and replaced, with a notice; nothing here fails a
    start-up that a profile could rescue."""
    key = auto_profile_key(engine, spec)
    path = auto_profile_path(key)
    if path.is_file():
        try:
            cached = load_profile(path)
        except ValueError as e:
            log.warning("dynaspec: the cached profile is unreadable (%s); profiling again", e)
            path.unlink(missing_ok=True)  # not read again, should this profile not be cached either
        else:
            implausible = implausible_steps(cached.batch_stats)
            if not implausible:
                return cached
            log.warning(
                "dynaspec: the cached profile %s was timed under load (%s); profiling again",
                path,
                "; ".join(implausible),
            )
    settings = auto_settings(key["max_k"], engine.config.max_num_seqs)
    steps = sum(
        _rounds(settings, i) * (settings.warmup_steps + _measured_steps(settings, i))
        for i in range(len(settings.batch_sizes))
    )
    log.warning(
        "dynaspec: profiling this machine for the goodput K policy (once, about %d steps); cached at %s",
        steps * (key["max_k"] + 1),
        path,
    )
    prompts = load_prompts("mixed", chat=True)
    profile = run_profile(
        engine, prompts, settings, {"auto_key": key}, progress=engine.config.progress, name=str(path)
    )
    implausible = implausible_steps(profile.batch_stats)
    if implausible:  # measured under load: used for this run only, so that the next start measures again
        log.warning(
            "dynaspec: the profile's steps look timed while something else held the cores (%s); "
            "it prices this run but is not cached: the next start profiles again",
            "; ".join(implausible),
        )
        return profile
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_profile(profile, tmp)
    tmp.replace(path)  # atomic: a concurrent start reads the old file or the new one, never half
    return profile


def _model_id(model: str) -> str:
    """A pack name as it is; a path made absolute, with its size and modification time."""
    path = Path(model).expanduser()
    if not path.exists():
        return model
    stat = path.stat()
    return f"{path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"
