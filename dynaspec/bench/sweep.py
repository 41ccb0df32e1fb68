"""`dynaspec bench sweep`: no speculation vs fixed K vs the profiled table vs the goodput policy,
at several concurrencies, side by side in one run.

Each concurrency C runs a closed loop: C requests in flight, a new prompt joins as one finishes,
max(4·C, ``--min-prompts``) prompts in all (small concurrencies finish their 4·C prompts in seconds,
too short to average out a shared machine's noise). One engine with the drafter serves every
speculative configuration (only the K policy is swapped, so weights and caches are shared); "none"
is a separate engine without a drafter. The order of configurations rotates from one concurrency
(and round) to the next so slow drift of the machine does not favour one of them. ``--rounds R``
(default 2) splits a concurrency's prompts into R rounds; each round runs every configuration on its
share, in reversed order every other round (A B C … C B A), so a machine that slows down or speeds
up linearly favours no one. A row pools its rounds (tokens / wall time) and keeps each round's rate.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from dynaspec.bench.common import DYNAMIC_CONFIGS, command_args, k_policies, profile_path, save_plot
from dynaspec.engine.args import add_engine_args

TABLE_HEADER = (
    f"{'C':>4} {'config':<11} {'tok/s':>8} {'TPOT mean':>10} {'TPOT med':>9} {'AL':>5} {'vs best':>8} "
    f"{'by round':>13} {'wall s':>7}"
)


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="concurrency sweep: none, fixed K, profiled table, goodput policy")
    add_engine_args(p, model_required=False)  # not needed with --from-json
    p.add_argument(
        "--profile",
        help='profile JSON from `dynaspec profile`, or "auto": the engine\'s own auto profile for the '
        "speculative config, made on first use and cached (also taken from a config saying "
        '"dynamic_config_path": "auto"); required unless --from-json',
    )
    p.add_argument(
        "--from-json",
        default=None,
        metavar="PATH",
        help="run nothing: re-compare, print and plot a sweep saved earlier (with --plot)",
    )
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--prompts-per-concurrency", type=int, default=4, help="prompts = this x concurrency ...")
    p.add_argument("--min-prompts", type=int, default=16, help="... but at least this many per concurrency")
    p.add_argument(
        "--fixed-ks",
        default="1,3,5",
        help="fixed Ks to run beside the policies (K=0: the speculative engine drafting nothing, its "
        "overhead against none)",
    )
    p.add_argument(
        "--configs",
        default=None,
        help="run only these configurations, comma-separated "
        "(none, K=<k> from --fixed-ks, table, goodput, per-request, cells-off: per-request without live "
        "grid cells, stops-off: per-request without confidence stops, matches-off: per-request pricing "
        "an n-gram's rows by acceptance, not their matches, hold-on: per-request whose hysteresis holds "
        "its K at any gap, and ctx-blind with a profile that has a context axis: per-request without "
        "it); default all but cells-off, stops-off, matches-off and hold-on",
    )
    p.add_argument(
        "--max-tokens", type=int, default=48, help="output cap per request (keeps the sweep short)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="split each concurrency's prompts into this many rounds; every round runs all configurations, "
        "in reversed order every other round (ABBA), so linear drift of the machine cancels",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy (outputs compared with none's); > 0: sampled, probabilistic verification",
    )
    p.add_argument("--sampling-seed", type=int, default=0, help="seed of sampled requests")
    p.add_argument(
        "--result-file",
        default="bench-results/sweep.json",
        help="JSON path (default %(default)s: out of the record under results/)",
    )
    p.add_argument("--plot", default=None, help="PNG of throughput and TPOT against concurrency")
    p.add_argument(
        "--warm-prompts",
        action="store_true",
        help="prefill every prompt once on each engine before the clock starts and keep them in the "
        "prefix cache, so the runs time decoding (long prompts whose prefill would otherwise dominate); "
        "every concurrency then runs the first of the same prompts; needs prefix caching, so not with an "
        "EAGLE head (a draft model still reads each prompt it drafts for: its window's worth)",
    )
    p.add_argument(
        "--warm-policies",
        action="store_true",
        help="one K policy per configuration for the whole sweep, as a server keeps its own, where by "
        "default every run starts a fresh one (its acceptance and step costs learnt from nothing)",
    )
    p.set_defaults(func=run)


@dataclass(slots=True)
class RunResult:
    concurrency: int
    config: str
    output_tokens: int
    wall_s: float
    tpot_ms: list[float]
    acceptance_length: float | None
    token_ids: list[list[int]]
    policy: dict | None = None  # the K policy's snapshot after the run (K per batch size, gates, costs)
    drafts: int = 0
    accepted: int = 0
    rates: list[float] = field(default_factory=list)  # output tok/s of each round

    def merge(self, other: RunResult) -> None:
        """Pool another round of the same (concurrency, config)."""
        self.output_tokens += other.output_tokens
        self.wall_s += other.wall_s
        self.tpot_ms += other.tpot_ms
        self.token_ids += other.token_ids  # rounds run in the same order for every configuration
        self.drafts += other.drafts
        self.accepted += other.accepted
        self.acceptance_length = (1 + self.accepted / self.drafts) if self.drafts else None
        self.rates += other.rates
        self.policy = other.policy or self.policy

    def row(self) -> dict:
        return {
            "concurrency": self.concurrency,
            "config": self.config,
            "output_tokens": self.output_tokens,
            "wall_s": round(self.wall_s, 3),
            "output_tokens_per_s": round(self.output_tokens / self.wall_s, 3) if self.wall_s > 0 else 0.0,
            "tpot_mean_ms": round(statistics.fmean(self.tpot_ms), 2) if self.tpot_ms else None,
            "tpot_median_ms": round(statistics.median(self.tpot_ms), 2) if self.tpot_ms else None,
            "acceptance_length": None if self.acceptance_length is None else round(self.acceptance_length, 3),
            "tokens_per_s_by_round": [round(r, 3) for r in self.rates],
            **({"policy": self.policy} if self.policy else {}),
        }


def closed_loop(engine, prompts: list, concurrency: int, params) -> tuple[float, list, list[float]]:
    """Run prompts with at most ``concurrency`` in flight; returns wall time, requests, TPOTs (ms)."""
    queue = list(prompts)
    requests, inflight = [], 0
    start = time.perf_counter()
    finish: dict[str, float] = {}
    while queue or engine.has_unfinished():
        while queue and inflight < concurrency:
            requests.append(engine.add_request(queue.pop(0), params))
            inflight += 1
        for out in engine.step():
            if out.finished:
                finish[out.request_id] = time.monotonic()
                inflight -= 1
    wall = time.perf_counter() - start
    tpot = [
        (finish[r.request_id] - r.first_token_time) * 1000 / (len(r.output_token_ids) - 1)
        for r in requests
        if len(r.output_token_ids) > 1 and r.first_token_time is not None
    ]
    return wall, requests, tpot


def run(args: argparse.Namespace) -> int:
    from dynaspec.datasets import load_prompts
    from dynaspec.engine.args import check_at_least, engine_kwargs
    from dynaspec.engine.engine import AUTO, Engine, EngineConfig
    from dynaspec.engine.profiler import auto_profile, auto_profile_key, auto_profile_path
    from dynaspec.kpolicy.config import SpeculativeConfig
    from dynaspec.kpolicy.profile import load_profile
    from dynaspec.sampling_params import SamplingParams

    if args.from_json:
        return report_saved(args.from_json, args.plot)
    spec = SpeculativeConfig.parse(args.speculative_config)
    if spec is None:
        raise ValueError("--speculative-config: the sweep needs the drafter's config")
    path = profile_path(args.profile, spec)
    for flag, value in (("--model", args.model), ("--profile", path)):
        if not value:
            raise ValueError(f"{flag}: required to run a sweep (only --from-json runs without it)")
    check_at_least(
        ("--rounds", args.rounds, 1),
        ("--prompts-per-concurrency", args.prompts_per_concurrency, 1),
        ("--min-prompts", args.min_prompts, 1),
    )
    profile = None if path == AUTO else load_profile(path)
    concurrencies = _ints(args.concurrency, "--concurrency")
    fixed_ks = _ints(args.fixed_ks, "--fixed-ks", least=0)
    profiled_k = profile.max_num_speculative_tokens if profile else spec.max_k
    max_k = max([*fixed_ks, profiled_k])
    prompts = load_prompts(args.dataset, chat=True)
    kwargs = engine_kwargs(args)
    # rounds and configurations repeat the prompts, which a prefix cache would make cheaper the second
    # time: off unless --enable-prefix-caching asks for it, and then each run starts with it empty;
    # --warm-prompts caches every prompt before the clock starts, for every configuration alike
    kwargs["enable_prefix_caching"] = bool(args.enable_prefix_caching or args.warm_prompts)
    kwargs["max_num_seqs"] = max(kwargs["max_num_seqs"], max(concurrencies))
    kwargs["max_num_batched_tokens"] = max(kwargs["max_num_batched_tokens"], max(concurrencies) * (max_k + 1))
    spec_dict = {**spec.to_dict(), "num_speculative_tokens": max_k}
    spec_dict.pop("num_speculative_tokens_per_batch_size", None)
    spec_dict.pop("dynamic_config_path", None)
    spec_engine = None
    if profile is None:  # "auto": the profile an engine with this config makes (or reads back) on first use
        spec_engine = Engine(EngineConfig(model=args.model, **{**kwargs, "speculative_config": spec_dict}))
        profile = auto_profile(spec_engine, spec)
        path = str(auto_profile_path(auto_profile_key(spec_engine, spec)))  # where it is cached
    table = profile.num_speculative_tokens_per_batch_size
    policies = k_policies(fixed_ks, profile, max_k, spec.hysteresis_steps)
    configs = ["none", *policies]
    # A/Bs of the engine's own policy: asked for by name only
    opt_in = ["cells-off", "stops-off", "matches-off", "hold-on"]
    if args.configs is None:
        configs = [c for c in configs if c not in opt_in]
    else:
        wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
        unknown = [c for c in wanted if c not in configs]
        if unknown or len(wanted) < 2:
            raise ValueError(
                f"--configs: {', '.join(unknown) or 'at least two are needed to compare'} "
                f"(choose two or more of {', '.join(configs)})"
            )
        configs = [c for c in configs if c in wanted]
    engines = {}  # only the engines the chosen configurations run on
    if "none" in configs:
        engines["none"] = Engine(EngineConfig(model=args.model, **{**kwargs, "speculative_config": None}))
    if any(c != "none" for c in configs):
        engines["spec"] = spec_engine or Engine(
            EngineConfig(model=args.model, **{**kwargs, "speculative_config": spec_dict})
        )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed)

    for engine in engines.values():  # first-call overheads (allocations, kernel selection) off the clock
        closed_loop(engine, prompts[:2], 2, SamplingParams(max_tokens=4, temperature=0.0))
    counts = {c: max(args.prompts_per_concurrency * c, args.min_prompts) for c in concurrencies}
    if args.warm_prompts:  # the prompts every concurrency takes its first from, prefilled once an engine
        warm = [prompts[i % len(prompts)] for i in range(max(counts.values()))]
        for name, engine in engines.items():
            warm_prompts(engine, warm, name)

    if args.warm_policies:  # each configuration's one policy, carried from run to run
        kept = {name: make() for name, make in policies.items()}
        policies = {name: (lambda p=p: p) for name, p in kept.items()}
    pooled: dict[tuple[int, str], RunResult] = {}
    cursor = 0
    with tqdm(total=len(concurrencies) * len(configs) * args.rounds, desc="sweep", unit="run") as bar:
        for ci, c in enumerate(concurrencies):
            count = counts[c]
            chosen = [prompts[(cursor + i) % len(prompts)] for i in range(count)]
            cursor += 0 if args.warm_prompts else len(chosen)
            order = configs[ci % len(configs) :] + configs[: ci % len(configs)]
            for rnd in range(args.rounds):
                part = chosen[rnd * len(chosen) // args.rounds : (rnd + 1) * len(chosen) // args.rounds]
                if not part:
                    continue
                for name in order if rnd % 2 == 0 else order[::-1]:
                    run = _run_config(engines, policies, name, part, c, params, not args.warm_prompts)
                    if (c, name) in pooled:
                        pooled[(c, name)].merge(run)
                    else:
                        pooled[(c, name)] = run
                    bar.update(1)
            results = list(pooled.values())
            _save(
                args.result_file, summarize(results, configs, concurrencies[: ci + 1], args.temperature == 0)
            )  # partial, in case the run is cut
    results = list(pooled.values())
    report = summarize(results, configs, concurrencies, args.temperature == 0)
    report["command_args"] = command_args(args)
    report["profile_table"] = table
    report["profile"] = path
    report["warm_prompts"] = args.warm_prompts
    report["warm_policies"] = args.warm_policies
    report["prefix_cache"] = {name: engine.stats()["prefix_cache"] for name, engine in engines.items()}
    print(format_report(report))
    if args.result_file:
        _save(args.result_file, report)
        print(f"results written to {args.result_file}")
    if args.plot:
        plot_sweep(report, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def report_saved(path: str, plot: str | None) -> int:
    """Re-compare a saved sweep (also a partial one, cut after some concurrencies), print, plot."""
    from pathlib import Path

    try:
        saved = json.loads(Path(path).read_text())
        rows = saved["rows"]
        configs = list(dict.fromkeys(r["config"] for r in rows))
        concurrencies = sorted({r["concurrency"] for r in rows})
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"--from-json: {path}: not a saved sweep ({e})") from None
    complete = [
        c
        for c in concurrencies
        if all(any(r["concurrency"] == c and r["config"] == n for r in rows) for n in configs)
    ]
    report = {**saved, **compare([r for r in rows if r["concurrency"] in complete], configs, complete)}
    print(format_report(report))
    if plot:
        plot_sweep(report, plot)
        print(f"plot written to {plot}")
    return 0


def warm_prompts(engine, prompts: list, name: str) -> None:
    """Prefill ``prompts`` (one output token each) so their blocks sit in ``engine``'s prefix cache."""
    from dynaspec.sampling_params import SamplingParams

    start = time.perf_counter()
    with tqdm(total=len(prompts), desc=f"warming {name}", unit="prompt") as bar:
        for i in range(0, len(prompts), 4):
            closed_loop(engine, prompts[i : i + 4], 4, SamplingParams(max_tokens=1, temperature=0.0))
            bar.update(len(prompts[i : i + 4]))
    cached = engine.allocator.num_cached_blocks * engine.allocator.block_size
    seconds = time.perf_counter() - start
    print(f"{name}: {len(prompts)} prompts prefilled in {seconds:.0f} s, {cached} tokens cached")


def _run_config(
    engines: dict, policies: dict, name: str, prompts: list, concurrency: int, params, cold: bool = True
) -> RunResult:
    engine = engines["none" if name == "none" else "spec"]
    if name != "none":
        engine.set_k_policy(policies[name]())  # fresh (unless --warm-policies): no history carried over
        engine.proposer.reset()  # nor a proposer's memory of earlier outputs (a suffix cache)
    if cold:
        engine.reset_prefix_cache()  # nor another run's prompt blocks
    with engine.recording() as run:
        wall, requests, tpot = closed_loop(engine, prompts, concurrency, params)
    drafts, accepted = run.spec.num_drafts, run.spec.num_accepted_tokens
    tokens = sum(len(r.output_token_ids) for r in requests)
    return RunResult(
        concurrency=concurrency,
        config=name,
        output_tokens=tokens,
        wall_s=wall,
        tpot_ms=tpot,
        acceptance_length=(1 + accepted / drafts) if drafts else None,
        token_ids=[r.output_token_ids for r in requests],
        policy=engine.k_policy.snapshot() if name != "none" else None,
        drafts=drafts,
        accepted=accepted,
        rates=[tokens / wall if wall > 0 else 0.0],
    )


def _save(path: str | None, report: dict) -> None:
    if path:
        from pathlib import Path

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2) + "\n")


def summarize(
    results: list[RunResult], configs: list[str], concurrencies: list[int], greedy: bool = True
) -> dict:
    rows = [r.row() for r in results]
    by = {(r["concurrency"], r["config"]): r for r in rows}
    # greedy only: sampled outputs follow the target's distribution, not its tokens
    plain = {(r.concurrency): r.token_ids for r in results if r.config == "none" and greedy}
    for r in results:  # greedy: every configuration should emit the target's own tokens
        ref = plain.get(r.concurrency)
        if ref is None:  # "none" not among the configurations run
            continue
        same = sum(a == b for a, b in zip(ref, r.token_ids))
        by[(r.concurrency, r.config)]["requests_identical_to_none"] = f"{same}/{len(ref)}"
    return compare(rows, configs, concurrencies)


def compare(rows: list[dict], configs: list[str], concurrencies: list[int]) -> dict:
    """Each row against the best other configuration (the dynamic ones never count as one), pooled and
    round by round, and the sweep's totals. Works on saved rows too (``--from-json``).

    ``vs_best_other_by_round`` pairs the rounds: round r of this configuration over round r of
    the pooled best other, run minutes apart on the same prompts, so their spread shows how much
    of a gap is the machine's noise."""
    by = {(r["concurrency"], r["config"]): r for r in rows}
    for c in concurrencies:
        for name in configs:
            others = [o for o in configs if o != name and o not in DYNAMIC_CONFIGS]
            best = max(others, key=lambda o: by[(c, o)]["output_tokens_per_s"], default=None)
            row = by[(c, name)]
            rate = by[(c, best)]["output_tokens_per_s"] if best else 0.0
            row["vs_best_other"] = round(row["output_tokens_per_s"] / rate, 4) if rate else None
            row["best_other"] = best
            pairs = zip(
                row.get("tokens_per_s_by_round", []),
                by[(c, best)].get("tokens_per_s_by_round", []) if best else [],
            )
            row["vs_best_other_by_round"] = [round(a / b, 4) for a, b in pairs if b]
    totals = {}
    for name in configs:
        walls = [by[(c, name)]["wall_s"] for c in concurrencies]
        geomean = None  # without "none" among the configurations run
        if "none" in configs:
            speed = [
                by[(c, name)]["output_tokens_per_s"] / max(1e-9, by[(c, "none")]["output_tokens_per_s"])
                for c in concurrencies
            ]
            geomean = round(math.exp(statistics.fmean(math.log(max(s, 1e-9)) for s in speed)), 4)
        totals[name] = {"total_wall_s": round(sum(walls), 2), "geomean_speedup_vs_none": geomean}
    return {"rows": rows, "totals": totals}


def format_report(report: dict) -> str:
    lines = [TABLE_HEADER, "-" * len(TABLE_HEADER)]
    for r in report["rows"]:
        al = "" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        vs = "" if r["vs_best_other"] is None else f"{r['vs_best_other']:.3f}"
        rounds = r.get("vs_best_other_by_round") or []
        spread = f"{min(rounds):.2f}-{max(rounds):.2f}" if rounds else ""
        lines.append(
            f"{r['concurrency']:>4} {r['config']:<11} {r['output_tokens_per_s']:>8.2f} "
            f"{r['tpot_mean_ms'] or 0:>10.1f} {r['tpot_median_ms'] or 0:>9.1f} {al:>5} {vs:>8} {spread:>13} "
            f"{r['wall_s']:>7.1f}"
        )
    lines.append("")
    lines.append(f"{'config':<11} {'total wall s':>12} {'geomean speedup vs none':>24}")
    for name, t in report["totals"].items():
        geomean = t["geomean_speedup_vs_none"]
        lines.append(
            f"{name:<11} {t['total_wall_s']:>12.1f} {'n/a' if geomean is None else f'{geomean:.3f}':>24}"
        )
    return "\n".join(lines)


DYNAMIC_COLOURS = {"goodput": "black", "per-request": "crimson"}


def plot_sweep(report: dict, path: str) -> None:
    """Throughput (with the spread of its rounds), each configuration relative to the best one at
    its concurrency (the goodput target drawn at 0.97), and median TPOT, against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_rel, ax_tpot) = plt.subplots(1, 3, figsize=(16, 4.6))
    configs = list(report["totals"])
    best = {}
    for r in report["rows"]:
        best[r["concurrency"]] = max(best.get(r["concurrency"], 0.0), r["output_tokens_per_s"])
    for name in configs:
        rows = sorted((r for r in report["rows"] if r["config"] == name), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        style = dict(linewidth=2.5, color=DYNAMIC_COLOURS[name]) if name in DYNAMIC_COLOURS else {}
        ys = [r["output_tokens_per_s"] for r in rows]
        spread = [
            [y - min(r.get("tokens_per_s_by_round") or [y]) for y, r in zip(ys, rows)],
            [max(r.get("tokens_per_s_by_round") or [y]) - y for y, r in zip(ys, rows)],
        ]
        ax_tp.errorbar(xs, ys, yerr=spread, marker="o", capsize=3, label=name, **style)
        ax_rel.plot(
            xs, [y / best[x] if best[x] else 0.0 for x, y in zip(xs, ys)], marker="o", label=name, **style
        )
        ax_tpot.plot(xs, [r["tpot_median_ms"] for r in rows], marker="o", label=name, **style)
    ax_rel.axhline(0.97, color="grey", linestyle="--", linewidth=1)
    for ax, label in (
        (ax_tp, "output tokens/s (bars: rounds)"),
        (ax_rel, "tokens/s / best at this concurrency"),
        (ax_tpot, "TPOT median (ms)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax_tp.legend(fontsize=8)
    fig.suptitle("dynaspec concurrency sweep")
    fig.tight_layout()
    save_plot(fig, path)


def _ints(text: str, flag: str, least: int = 1) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < least:
        raise ValueError(f"{flag}: need integers >= {least}")
    return values
