"""`dynaspec bench rollout`: an RL-rollout batch, the long tail included, per K configuration.

N prompts are submitted at once and sampled (temperature 1.0 by default, as rollouts are; verification
is then probabilistic), with output lengths left to the model (EOS under a high `--max-tokens`) or
drawn per request from a long-tailed (log-normal) distribution with a seed, so the batch drains to a
tail of a few long requests. Configurations run side by side on the same prompts and the same
per-request sampling seeds, in interleaved rounds (A B C ... then C B A ...): no speculation, fixed
K, and with a `--profile` the profiled table and the goodput policy. The seeds change from round to
round, so rounds average over texts; every configuration of a round emits the same text as no
speculation (spec_decode/rejection.py), so a round compares K choices alone. `--samples-per-prompt
N` makes it GRPO-shaped (each prompt sampled N times, each sample its own seed) and `--epochs E`
runs the same prompts again with new seeds, the proposer's memory kept (a suffix cache: the next
epoch of RL), reported per epoch. Reported per configuration: the makespan (until the last request
finishes), the times until 50% / 90% / 100% of requests finished, output tokens/s, and over time
the running batch size and the K chosen (plotted).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import math
import random
import time

from dynaspec.bench.common import (
    DYNAMIC_CONFIGS,
    command_args,
    format_table,
    k_policies,
    profile_path,
    save_plot,
    write_result,
)
from dynaspec.engine.args import add_engine_args


def add_parser(sub) -> None:
    p = sub.add_parser("rollout", help="RL-rollout batch: makespan and the tail, per K configuration")
    add_engine_args(p, model_required=False)
    p.set_defaults(model="qwen2.5-coder-1.5b-instruct")
    p.add_argument(
        "--profile",
        default=None,
        help='profile JSON: adds the table and goodput configs (a spec with "dynamic_config_path": "auto" '
        "uses the engine's own cached profile, made on first use)",
    )
    p.add_argument(
        "--policies",
        default="table,goodput,per-request",
        help="with a profile, which of its policies run: table, goodput (one K for the load), "
        "per-request (a K per request: what an engine with a profile uses), ctx-blind (per-request "
        "without the profile's context axis), cells-off (per-request without live grid cells), "
        "stops-off (per-request without confidence stops), matches-off (per-request pricing an "
        "n-gram's rows by acceptance, not their matches), hold-on (per-request whose hysteresis "
        "holds its K at any gap)",
    )
    p.add_argument("--dataset", default="mtbench")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=512, help="cap per request (EOS ends most before)")
    p.add_argument(
        "--lengths",
        default="eos",
        choices=["eos", "longtail"],
        help="eos: the model's own; longtail: per-request lengths from a log-normal (ignore EOS)",
    )
    p.add_argument("--median-tokens", type=int, default=48, help="longtail: the median output length")
    p.add_argument(
        "--length-sigma",
        type=float,
        default=0.8,
        help="longtail: the log-normal's sigma (larger: a longer tail of a few long requests)",
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--fixed-ks", default="1,3,5", help="fixed K configurations ('' for none)")
    p.add_argument(
        "--draft-context-window",
        type=int,
        default=None,
        help="also run every speculative configuration with this draft_context_window (named '... w=N'; "
        "0: the whole context, '... w=all'), on the same engine",
    )
    p.add_argument(
        "--samples-per-prompt",
        type=int,
        default=1,
        help="GRPO's group: each prompt sampled this many times, each sample its own seed (to the engine "
        "the n samples of one request and identical prompts sent apart are the same requests)",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=1,
        help="the same prompts again with new seeds, the proposer's memory kept (a suffix cache: RL's next "
        "epoch); reported per epoch as '<config> e<N>'",
    )
    p.add_argument(
        "--also-speculative-config",
        action="append",
        default=[],
        metavar="JSON",
        help="another drafter run side by side, in the same rounds, with the same fixed Ks and policies "
        '(its own profile: its "dynamic_config_path", a file or "auto"); repeatable. With several '
        "drafters each config's name starts with its drafter's method",
    )
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--rollout-seed", type=int, default=0, help="lengths and per-request sampling seeds")
    p.add_argument(
        "--result-file",
        default="bench-results/rollout.json",
        help="JSON path (default %(default)s: out of the record under results/)",
    )
    p.add_argument("--plot", default=None, help="PNG: running batch size and K over time per config")
    p.set_defaults(func=run)


class _Traced:
    """A K policy that remembers the K it chose last (for the time series)."""

    def __init__(self, inner) -> None:
        self.inner, self.last_k = inner, 0

    def choose(self, candidates):
        k, caps = self.inner.choose(candidates)
        self.last_k = k
        return k, caps

    def observe(self, record) -> None:
        self.inner.observe(record)

    def min_draft_confidence(self) -> float:
        return self.inner.min_draft_confidence()

    def free_rows(self) -> list[bool]:
        return self.inner.free_rows()

    def snapshot(self) -> dict:
        return self.inner.snapshot()


def drafter_names(specs: list) -> list[str]:
    """The prefix of each drafter's config names: none for a lone drafter, else its method (and its
    place among drafters of the same method)."""
    if len(specs) == 1:
        return [""]
    methods = [s.label for s in specs]
    return [m if methods.count(m) == 1 else f"{m}#{methods[: i + 1].count(m)}" for i, m in enumerate(methods)]


def is_fixed(config: str) -> bool:
    """A configuration without a K policy: no speculation or a fixed K, of any drafter."""
    return any(word == "none" or word.startswith("K=") for word in config.split(" "))


def lengths_for(args: argparse.Namespace, n: int) -> list[int]:
    """Per-request output caps: --max-tokens for all (eos), or log-normal draws with a seed."""
    if args.lengths == "eos":
        return [args.max_tokens] * n
    rng = random.Random(args.rollout_seed)
    return [
        max(1, min(args.max_tokens, round(args.median_tokens * math.exp(rng.gauss(0.0, args.length_sigma)))))
        for _ in range(n)
    ]


def rollout(engine, prompts: list, params: list) -> dict:
    """Submit every prompt at once, step until all finish; the finish times and per-step series."""
    start = time.perf_counter()
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    finish: list[float] = []
    series = []  # (seconds since start, running requests, K chosen, tokens generated so far)
    policy = engine.k_policy
    generated = engine.counters.num_generated_tokens
    sources = _sources(engine)
    with engine.recording() as run:
        while engine.has_unfinished():
            running = len(engine.scheduler.running) + len(engine.scheduler.waiting)
            outs = engine.step()
            now = time.perf_counter() - start
            k = policy.last_k if isinstance(policy, _Traced) else 0
            series.append((round(now, 3), running, k, engine.counters.num_generated_tokens - generated))
            finish += [now for o in outs if o.finished]
    tokens = sum(len(r.output_token_ids) for r in requests)
    alpha = run.spec.acceptance_rate_per_pos
    text = hashlib.sha1(repr([r.output_token_ids for r in requests]).encode()).hexdigest()[:16]
    out = {
        "finish": sorted(finish),
        "series": series,
        "tokens": tokens,
        "acceptance_per_pos": alpha,
        "text": text,
    }
    if sources:  # a draft model with suffix matches: this run's rows, drafts and accepted per source
        after = _sources(engine)
        out["sources"] = {
            src: {key: after[src][key] - sources[src][key] for key in sources[src]}
            for src in ("suffix", "model")
        }
    return out


def _sources(engine) -> dict | None:
    """The proposer's drafting by source so far (a draft model with suffix matches), else None."""
    return engine.proposer.stats().get("sources")


def spread_of(values: list[float]) -> float:
    """(largest - smallest) / mean: how far apart the rounds of one configuration ran."""
    return (max(values) - min(values)) / (sum(values) / len(values))


RUNNING_BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 1 << 30))


def k_by_running(runs: list[list]) -> list[dict]:
    """How many steps chose each K, per range of running requests (the load), over all rounds."""
    out = []
    for lo, hi in RUNNING_BUCKETS:
        counts: dict[int, int] = {}
        for series in runs:
            for _, running, k, _ in series:
                if lo <= running <= hi:
                    counts[k] = counts.get(k, 0) + 1
        if counts:
            out.append({"running": [lo, hi], "steps_by_k": {str(k): counts[k] for k in sorted(counts)}})
    return out


def format_k_by_running(buckets: list[dict]) -> str:
    rows = []
    for b in buckets:
        lo, hi = b["running"]
        steps = b["steps_by_k"]
        total = sum(steps.values())
        mean = sum(int(k) * n for k, n in steps.items()) / total
        where = str(lo) if lo == hi else f"{lo}-{hi}" if hi < 1 << 30 else f">={lo}"
        rows.append([where, total, mean, " ".join(f"K={k}:{n}" for k, n in steps.items())])
    return format_table(["running", "steps", "mean K", "steps by K"], rows)


def longest_step(series: list) -> float:
    """The longest step of a run (seconds): the longest every running request waited for a token."""
    times = [0.0, *(s[0] for s in series)]
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def modelled_makespans(
    lengths: list[int], profile, alpha: list[float], fixed_ks: list[int]
) -> dict[str, float]:
    """What the profile says the batch's decode takes (seconds; prefill left out): every request
    advances AL(K) tokens a step that costs ITL(active requests, K) (steps counted fractionally,
    as expectations), for no speculation, each fixed K, and the best K for each batch size
    (``best K per batch size``: by this model no policy that picks one K per step from the load
    does better, since between two finishes the batch size is fixed and the best K drains it
    fastest). ``alpha``: acceptance per position."""
    from dynaspec.kpolicy.profile import acceptance_length, argmax_goodput, interpolate_itl, smooth_itl

    grid = smooth_itl(profile.batch_stats)
    max_k = min(profile.max_num_speculative_tokens, len(alpha))

    def drain(choose) -> float:
        left, ms = [float(n) for n in lengths if n > 0], 0.0
        while left:
            k = choose(len(left))
            itl = interpolate_itl(grid, len(left), k)
            if itl is None:
                return float("nan")
            shortest = min(left)  # steps until the next request finishes: shortest / AL(K)
            ms += itl * shortest / acceptance_length(alpha, k)
            left = [n - shortest for n in left if n - shortest > 1e-9]
        return ms / 1000

    out = {"none": drain(lambda bs: 0)}
    out |= {f"K={k}": drain(lambda bs, k=k: k) for k in fixed_ks if k <= max_k}
    out["best K per batch size"] = drain(
        lambda bs: argmax_goodput(alpha, lambda k: interpolate_itl(grid, bs, k), max_k)
    )
    return out


def _rate(series: list, window_s: float) -> list[float]:
    """Tokens per second over the ``window_s`` before each step (from the cumulative count),
    measured from the last step that ended before the window, so a step longer than the window
    shows its own rate rather than 0."""
    out, lo = [], 0
    for t, *_, tokens in series:
        while series[lo][0] < t - window_s:
            lo += 1
        t0, tokens0 = (series[lo - 1][0], series[lo - 1][-1]) if lo else (0.0, 0)
        out.append((tokens - tokens0) / (t - t0) if t > t0 else 0.0)
    return out


def _at(finish: list[float], fraction: float) -> float:
    return finish[max(0, math.ceil(fraction * len(finish)) - 1)]


def run(args: argparse.Namespace) -> int:
    from dynaspec.datasets import load_prompts
    from dynaspec.engine.args import check_at_least, engine_kwargs
    from dynaspec.engine.engine import AUTO, Engine, EngineConfig
    from dynaspec.engine.profiler import auto_profile
    from dynaspec.kpolicy.config import SpeculativeConfig
    from dynaspec.kpolicy.profile import load_profile
    from dynaspec.sampling_params import SamplingParams

    check_at_least(
        ("--num-prompts", args.num_prompts, 1),
        ("--samples-per-prompt", args.samples_per_prompt, 1),
        ("--epochs", args.epochs, 1),
        ("--rounds", args.rounds, 1),
        ("--length-sigma", args.length_sigma, 0),
    )
    texts = [args.speculative_config, *args.also_speculative_config]
    specs = [SpeculativeConfig.parse(text) for text in texts]
    if specs[0] is None:
        raise ValueError(
            "--speculative-config: the rollout compares speculation, it needs the drafter's config"
        )
    if any(s is None for s in specs[1:]):
        raise ValueError("--also-speculative-config: a drafter's config, not null")
    fixed_ks = [int(k) for k in args.fixed_ks.split(",") if k.strip()]
    chosen = [name.strip() for name in args.policies.split(",") if name.strip()]
    unknown = sorted(set(chosen) - {"table", *DYNAMIC_CONFIGS})
    if unknown:
        raise ValueError(f"--policies: unknown {', '.join(unknown)} (table, {', '.join(DYNAMIC_CONFIGS)})")
    window = args.draft_context_window
    if window is not None and (all(s.method != "draft_model" for s in specs) or window < 0):
        raise ValueError(
            "--draft-context-window: a token count (0: the whole context), for method draft_model only"
        )
    # each drafter's profile: --profile for the first, else its own dynamic_config_path (a file, or
    # "auto": the engine's own, made on first use below); the deepest K any configuration drafts
    paths = [profile_path(args.profile, specs[0])] + [s.dynamic_config_path for s in specs[1:]]
    profiles = [load_profile(path) if path and path != AUTO else None for path in paths]
    deepest_k = [
        known.max_num_speculative_tokens if known else s.max_k if path == AUTO else 1
        for s, known, path in zip(specs, profiles, paths)
    ]
    max_k = max([*fixed_ks, *deepest_k])
    num_requests = args.num_prompts * args.samples_per_prompt
    kwargs = engine_kwargs(args)
    # rounds and configurations repeat the prompts, which a prefix cache would make cheaper the second
    # time: off unless --enable-prefix-caching asks for it, and then each run starts with it empty
    kwargs["enable_prefix_caching"] = bool(args.enable_prefix_caching)
    kwargs["max_num_seqs"] = max(kwargs["max_num_seqs"], num_requests)
    kwargs["max_num_batched_tokens"] = max(kwargs["max_num_batched_tokens"], num_requests * (max_k + 1))
    engines = {"none": Engine(EngineConfig(model=args.model, **{**kwargs, "speculative_config": None}))}
    # config name -> (engine, K policy factory, the drafter's context window); "none" runs on an
    # engine without a drafter, each drafter's configs on its own engine, whose window is set before
    # each run; with several drafters a config's name starts with its drafter's
    plan: dict[str, tuple[str, object, int | None]] = {"none": ("none", None, None)}
    for i, (spec, path, prefix) in enumerate(zip(specs, paths, drafter_names(specs))):
        engine_name = prefix or "spec"
        spec_dict = {**spec.to_dict(), "num_speculative_tokens": max_k}
        spec_dict.pop("num_speculative_tokens_per_batch_size", None)
        spec_dict.pop("dynamic_config_path", None)
        engines[engine_name] = engine = Engine(
            EngineConfig(model=args.model, **{**kwargs, "speculative_config": spec_dict})
        )
        if path == AUTO:  # the profile an engine with this config makes (or reads back) on first use
            profiles[i] = auto_profile(engine, spec)
        policies = k_policies(fixed_ks, profiles[i], max_k, spec.hysteresis_steps)
        policies = {name: f for name, f in policies.items() if name.startswith("K=") or name in chosen}
        windows = [spec.context_window]
        if window is not None and spec.method == "draft_model":
            windows.append(window or None)
        for j, w in enumerate(windows):
            for name, factory in policies.items():
                label = (prefix + " " if prefix else "") + name + (f" w={w or 'all'}" if j else "")
                plan[label] = (engine_name, factory, w)
    profile = profiles[0]
    configs = list(plan)
    all_prompts = load_prompts(args.dataset, chat=True)
    prompts = [all_prompts[i % len(all_prompts)] for i in range(args.num_prompts)]
    prompts = [p for p in prompts for _ in range(args.samples_per_prompt)]  # a prompt's samples together
    caps = lengths_for(args, len(prompts))
    epochs = [""] if args.epochs == 1 else [f" e{e + 1}" for e in range(args.epochs)]

    def params(rnd: int, epoch: int) -> list[SamplingParams]:
        # seeds change with the round and the epoch, so rounds average over texts; within one,
        # every config gets the same (and then emits the same text: rejection.py)
        return [
            SamplingParams(
                max_tokens=cap,
                temperature=args.temperature,
                seed=(args.rollout_seed * 1_000_003 + rnd) * 100_003 + i + epoch * 7_777_777_777,
                ignore_eos=args.lengths == "longtail",
            )
            for i, cap in enumerate(caps)
        ]

    for engine in engines.values():  # first-call overheads off the clock
        rollout(engine, prompts[:2], [SamplingParams(max_tokens=4, temperature=0.0)] * 2)

    results: dict[str, list[dict]] = {c + tag: [] for c in configs for tag in epochs}
    for rnd in range(args.rounds):
        for name in configs if rnd % 2 == 0 else configs[::-1]:
            engine_name, factory, w = plan[name]
            engine = engines[engine_name]
            if factory is not None:
                engine.set_k_policy(_Traced(factory()))
                engine.proposer.reset()  # no config drafts from another's outputs (a suffix cache)
                engine.proposer.window = w  # no request is running: each catches up afresh
            engine.reset_prefix_cache()  # a later epoch takes the blocks of earlier ones (RL's reuse)
            for epoch, tag in enumerate(epochs):  # later epochs keep what the proposer learned
                results[name + tag].append(rollout(engine, prompts, params(rnd, epoch)))
                done = results[name + tag][-1]
                print(f"round {rnd + 1} {name + tag}: makespan {done['finish'][-1]:.1f} s", flush=True)

    rows, records, same_text = [], [], {}
    baseline = {c + tag: results["none" + tag] for c in configs for tag in epochs}  # the same epoch's
    for name, runs in results.items():
        makespan = sum(r["finish"][-1] for r in runs) / len(runs)
        t50 = sum(_at(r["finish"], 0.5) for r in runs) / len(runs)
        t90 = sum(_at(r["finish"], 0.9) for r in runs) / len(runs)
        tokens = sum(r["tokens"] for r in runs)
        speed = tokens / sum(r["finish"][-1] for r in runs)
        stall = max(longest_step(r["series"]) for r in runs)
        same = sum(r["text"] == base["text"] for r, base in zip(runs, baseline[name]))
        # speed-up over no speculation within each round (the same texts and the same seeds)
        by_round = [base["finish"][-1] / r["finish"][-1] for r, base in zip(runs, baseline[name])]
        rows.append([name, makespan, t50, t90, speed, stall, " ".join(f"{x:.2f}" for x in by_round)])
        same_text[name] = f"{same}/{len(runs)}"
        records.append(
            {
                "config": name,
                "makespan_s": round(makespan, 3),
                "t50_s": round(t50, 3),
                "t90_s": round(t90, 3),
                "tokens_per_s": round(speed, 3),
                "longest_step_s": round(stall, 3),
                "output_tokens": tokens,
                "same_text_as_none": same,
                "vs_none_by_round": [round(x, 4) for x in by_round],
                "spread_between_rounds": round(spread_of([r["finish"][-1] for r in runs]), 4),
                "k_by_running": k_by_running([r["series"] for r in runs]),
                "rounds": [
                    {
                        "finish_s": r["finish"],
                        "series": r["series"],
                        "text": r["text"],
                        "acceptance_per_pos": [round(a, 4) for a in r["acceptance_per_pos"] or []],
                        **({"sources": r["sources"]} if "sources" in r else {}),
                    }
                    for r in runs
                ],
            }
        )
    for tag in epochs:  # against the best of none and fixed K in the same epoch
        mine = [r for r in rows if r[0].endswith(tag)]
        best_fixed = min(r[1] for r in mine if is_fixed(r[0].removesuffix(tag)))
        for row in mine:
            row += [row[1] / best_fixed, same_text[row[0]]]
    columns = ["config", "makespan s", "50% s", "90% s", "tok/s", "longest step s", "x none by round"]
    columns += ["vs best fixed", "rounds with none's text"]
    print(format_table(columns, rows))
    if args.rounds > 1:  # what the same configuration's makespan did from round to round
        spreads = {r["config"]: r["spread_between_rounds"] for r in records}
        print("\nrun-to-run spread, a configuration's makespan between rounds: ", end="")
        print(", ".join(f"{name} {spread:.1%}" for name, spread in spreads.items()))
    for record in records:
        if record["config"] != "none":
            print(f"\n{record['config']}: K chosen, steps by running requests")
            print(format_k_by_running(record["k_by_running"]))
    model = None
    deepest = next((name for name in plan if name.endswith(f"K={max(fixed_ks)}")), None) if fixed_ks else None
    if profile is not None and deepest is not None and deepest + epochs[0] in results:
        # the acceptance this batch showed at the deepest fixed K, every position drafted
        alpha = results[deepest + epochs[0]][0]["acceptance_per_pos"]
        if alpha:
            model = {"acceptance_per_pos": [round(a, 4) for a in alpha]}
            model["makespan_s"] = modelled_makespans(caps, profile, alpha, fixed_ks)
            fixed = min(v for name, v in model["makespan_s"].items() if name.startswith(("none", "K=")))
            print(
                f"\nmodelled decode makespans (the profile's ITL, the acceptance of {deepest} here: "
                + " ".join(f"{a:.2f}" for a in alpha)
                + "; prefill left out):"
            )
            print(
                format_table(
                    ["config", "makespan s", "vs best fixed"],
                    [[name, v, v / fixed] for name, v in model["makespan_s"].items()],
                )
            )
    write_result(
        args.result_file,
        {
            "benchmark": "rollout",
            "args": command_args(args),
            "lengths": caps,
            "rows": records,
            "model": model,
            # each drafter's profile as this run used it (an auto one may not be cached: one out of
            # line with itself prices its run only)
            "profiles": {
                (prefix or "spec"): known.to_json()
                for prefix, known in zip(drafter_names(specs), profiles)
                if known is not None
            },
        },
    )
    if args.plot:
        plot_rollout(records, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def plot_rollout(records: list[dict], path: str) -> None:
    """Running requests (top), output tokens/s over the last 2 s (middle) and K chosen (bottom)
    against time, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for rec in records:
        series = rec["rounds"][0]["series"]
        t = [s[0] for s in series]
        top.step(t, [s[1] for s in series], where="post", label=rec["config"])
        middle.plot(t, _rate(series, 2.0), label=rec["config"])
        bottom.step(t, [s[2] for s in series], where="post", label=rec["config"])
    top.set_ylabel("requests running or waiting")
    middle.set_ylabel("output tokens/s (last 2 s)")
    bottom.set_ylabel("K chosen (largest of the step)")
    bottom.set_xlabel("seconds since the batch was submitted")
    top.legend(fontsize=8)
    top.set_title("rollout: the batch drains to a tail (first round)")
    fig.tight_layout()
    save_plot(fig, path)
