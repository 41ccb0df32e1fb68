"""`dynaspec profile`: measure acceptance and ITL(bs, K), write the profile file, plot goodput."""

from __future__ import annotations

import argparse
import json

from dynaspec.engine.args import add_engine_args, check_at_least, engine_kwargs


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="profile acceptance and step time to drive the goodput K policy")
    add_engine_args(p)
    p.add_argument("--dataset", default="mtbench", help="mtbench, humaneval, or a prompt file")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="comma-separated batch sizes to time")
    p.add_argument(
        "--max-k", type=int, default=None, help="largest K to profile (default: num_speculative_tokens)"
    )
    p.add_argument("--num-prompts", type=int, default=16, help="prompts used to measure acceptance")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens generated per acceptance prompt")
    p.add_argument(
        "--warmup-steps", type=int, default=1, help="untimed steps at each visit of a (bs, K) cell"
    )
    p.add_argument(
        "--measured-steps", type=int, default=2, help="steps timed at each visit of a (bs, K) cell"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="visits of every (bs, K) cell, K interleaved so machine drift lands on every K alike; "
        "the median over all visits is kept",
    )
    p.add_argument(
        "--revisits",
        type=int,
        default=2,
        help="times a cell off its batch size's line in K is visited again (its new steps' median "
        "replaces its figure); 0: never",
    )
    p.add_argument(
        "--context-lengths",
        default="4096",
        help="the context axis: contexts per request (tokens, comma-separated) over which a few cells "
        "are timed too (their prompts' prefill skipped), so the goodput policy prices long contexts; "
        "'' for none",
    )
    p.add_argument(
        "--context-batch-sizes", default="1,2,4,8", help="batch sizes timed over each of --context-lengths"
    )
    p.add_argument("--output", required=True, help="profile JSON to write")
    p.add_argument("--plot", default=None, help="PNG of goodput per K against batch size")
    p.set_defaults(func=run)


def _batch_sizes(text: str, flag: str = "--batch-sizes", allow_empty: bool = False) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if (not sizes and not allow_empty) or (sizes and sizes[0] < 1):
        raise ValueError(
            f"{flag}: need at least one value >= 1" if not allow_empty else f"{flag}: values must be >= 1"
        )
    return sizes


def run(args: argparse.Namespace) -> int:
    from dynaspec.datasets import load_prompts
    from dynaspec.engine.build import build_engine
    from dynaspec.engine.engine import EngineConfig
    from dynaspec.engine.profiler import ProfileSettings, run_profile
    from dynaspec.kpolicy.config import SpeculativeConfig
    from dynaspec.kpolicy.profile import save_profile

    spec = SpeculativeConfig.parse(args.speculative_config)
    if spec is None:
        raise ValueError("--speculative-config: profiling needs a speculative config (method, model, ...)")
    sizes = _batch_sizes(args.batch_sizes)
    context_lengths = _batch_sizes(args.context_lengths, "--context-lengths", allow_empty=True)
    context_sizes = _batch_sizes(args.context_batch_sizes, "--context-batch-sizes")
    max_k = args.max_k if args.max_k is not None else spec.num_speculative_tokens
    if not max_k or max_k < 1:
        raise ValueError("--max-k: must be >= 1")
    check_at_least(
        ("--rounds", args.rounds, 1),
        ("--measured-steps", args.measured_steps, 1),
        ("--warmup-steps", args.warmup_steps, 0),
        ("--revisits", args.revisits, 0),
    )
    prompts = load_prompts(args.dataset, chat=True)
    kwargs = engine_kwargs(args)
    kwargs["max_num_seqs"] = max(kwargs["max_num_seqs"], sizes[-1], args.num_prompts)
    kwargs["max_num_batched_tokens"] = max(kwargs["max_num_batched_tokens"], sizes[-1] * (max_k + 1))
    engine = build_engine(EngineConfig(model=args.model, **kwargs))
    settings = ProfileSettings(
        batch_sizes=sizes,
        max_k=max_k,
        num_acceptance_prompts=args.num_prompts,
        acceptance_max_tokens=args.max_tokens,
        warmup_steps=args.warmup_steps,
        measured_steps=args.measured_steps,
        rounds=args.rounds,
        revisits=args.revisits,
        context_lengths=tuple(context_lengths),
        context_batch_sizes=tuple(context_sizes),
    )
    meta = {
        "model": args.model,
        "speculative_config": json.loads(json.dumps(spec.to_dict())),
        "dataset": args.dataset,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "quantization": engine.quantization,
    }
    profile = run_profile(engine, prompts, settings, meta)
    save_profile(profile, args.output)
    print(f"profile written to {args.output}")
    print("acceptance per position: " + " ".join(f"{a:.2f}" for a in profile.acceptance_rate_per_pos))
    print(f"ITL ms by batch size (columns K = 0..{max_k}):")
    for bs, row in profile.batch_stats.items():
        print(f"  bs {bs:>3}: " + " ".join(f"{row[k]:8.1f}" for k in sorted(row)))
    for context, grid in profile.context_stats.items():
        print(f"ITL ms over {context}-token contexts (the grid's: {profile.context_tokens:.0f}):")
        for bs, row in grid.items():
            print(f"  bs {bs:>3}: " + "  ".join(f"K={k} {ms:8.1f}" for k, ms in sorted(row.items())))
    if profile.context_cost is not None:
        u, v = profile.context_cost
        print(f"context cost: {u:.3f} ms per request + {v:.3f} per draft token, per 1,000 context tokens")
        for bs, (u, v) in sorted((profile.context_cost_by_batch or {}).items()):
            print(f"  at {bs} requests: {u:.3f} ms per request + {v:.3f} per draft token")
    print("num_speculative_tokens_per_batch_size:", json.dumps(profile.num_speculative_tokens_per_batch_size))
    if args.plot:
        plot_goodput(profile, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def plot_goodput(profile, path: str) -> None:
    """Goodput (AL/ITL, tokens/s per request) for each K against batch size, and the chosen K.

    Dots are the measured grid, lines the smoothed one the policy uses (``smooth_itl``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dynaspec.bench.common import save_plot
    from dynaspec.kpolicy.profile import acceptance_length, best_k, smooth_itl

    sizes = sorted(profile.batch_stats)
    alpha = profile.acceptance_rate_per_pos
    smooth = smooth_itl(profile.batch_stats)
    fig, (ax, ax_k) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True, height_ratios=[3, 1])
    for k in range(profile.max_num_speculative_tokens + 1):
        al = acceptance_length(alpha, k)
        measured = [
            (bs, al / profile.batch_stats[bs][k] * 1000) for bs in sizes if profile.batch_stats[bs].get(k)
        ]
        fitted = [(bs, al / smooth[bs][k] * 1000) for bs in sizes if smooth[bs].get(k)]
        line = ax.plot(*zip(*fitted), label=f"K={k} (AL {al:.2f})")[0] if fitted else None
        if measured:
            ax.plot(*zip(*measured), "o", color=line.get_color() if line else None, markersize=4)
    best = [best_k(alpha, smooth, bs, profile.max_num_speculative_tokens) for bs in sizes]
    ax.set_xscale("log", base=2)
    ax.set_ylabel("goodput per request (tokens/s)")
    ax.set_title(
        f"goodput = AL(K) / ITL(bs, K): {profile.meta.get('model', '')}\n(dots: measured, lines: smoothed)"
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax_k.step(sizes, best, where="mid", color="black")
    ax_k.plot(sizes, best, "ko")
    ax_k.set_ylabel("chosen K")
    ax_k.set_xlabel("decoding requests (batch size)")
    ax_k.grid(alpha=0.3)
    fig.tight_layout()
    save_plot(fig, path)
