"""What the goodput policy expected of each step against what the step did (issue 37: where the
per-request policy drafts at a load where no speculation is faster, is the step's time or the
drafts' acceptance mispriced?).

Runs a closed loop of ``--concurrency`` requests over ``--prompts`` prompts for each configuration
(fixed K or the benchmarks' named policies, ``bench.common.k_policies``), in rounds (ABBA), and
prices every whole decode step (nothing prefilled, the load all decoding) by a shadow policy that
never learns: the profile's grid at the step's rows, the drafts it actually verified (layer by
layer, as ``GoodputK.drafted_cost`` prices them) and its mean context. It reports, per
configuration and kind of step (no drafts, every row the same K, ragged K), the steps' wall time
over that price; and for the per-request policy's drafted rows, the tokens the target accepted
against those the policy expected of the rows it drafted (its per-request rates at choice time,
or, where it priced each row by its match, its match calibration's rates of the match).

    .venv/bin/python benchmarks/probes/step_forecast.py --profile ~/.cache/dynaspec/profiles/<ngram>.json \\
        --speculative-config '{"method":"ngram","num_speculative_tokens":5}' --dataset mtbench \\
        --concurrency 8 --prompts 16 --configs K=0,K=2,per-request --rounds 2 --out forecast.json

``--temperature 1.0`` samples (seed 0) and ``--ignore-eos`` runs every request to --max-tokens, as
the long-tailed rollout (`bench rollout --lengths longtail`) does.
"""

import argparse
import json
import statistics
from collections import defaultdict

from dynaspec.bench.common import k_policies
from dynaspec.bench.sweep import closed_loop
from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.kpolicy.goodput import GoodputK
from dynaspec.kpolicy.profile import load_profile
from dynaspec.sampling_params import SamplingParams


def kind_of(lens: list[int]) -> str:
    if not any(lens):
        return "none"
    return "uniform" if len(set(lens)) == 1 else "ragged"


class Recorder:
    """Wraps a policy: keeps each choice's per-request rates, and each whole step's forecast and
    outcome."""

    def __init__(self, policy, shadow: GoodputK, steps: list[dict]) -> None:
        self.policy, self.shadow, self.steps = policy, shadow, steps
        self.rates: dict[str, list[float]] = {}
        self.load = 0
        self._choose, self._observe = policy.choose, policy.observe
        policy.choose, policy.observe = self.choose, self.observe

    def choose(self, candidates):
        self.load = len(candidates)
        out = self._choose(candidates)
        policy = self.policy
        if isinstance(policy, GoodputK) and policy._matches_only:  # rows priced by their matches
            self.rates = {c.request_id: policy.match_calibration.expected(c.free_rates) for c in candidates}
        elif isinstance(policy, GoodputK):
            alpha = policy.acceptance.rates()
            self.rates = {c.request_id: policy.requests.rates(c.request_id, alpha) for c in candidates}
        return out

    def observe(self, record) -> None:
        timing, lens = record.timing, list(record.result.draft_lens)
        rows = timing.decode_rows
        if rows and not timing.prefill_tokens and rows == self.load and timing.step_ms > 0:
            shadow = self.shadow
            shadow.context = timing.context_tokens / rows if timing.context_tokens else None
            layers = tuple(sum(d > j for d in lens) for j in range(max(lens, default=0)))
            price = shadow.itl(rows, 0) + shadow.drafted_cost(rows, layers)
            ids = [r.request_id for r in record.plan.decodes]
            per_row = [
                (d, a, round(sum(self.rates.get(i, [])[:d]), 3))
                for i, d, a in zip(ids, lens, record.result.num_accepted)
                if d
            ]
            expected = sum(r[2] for r in per_row) if self.rates else None
            self.steps.append(
                {
                    "rows": rows,
                    "kind": kind_of(lens),
                    "drafted": sum(lens),
                    "accepted": sum(record.result.num_accepted),
                    "expected": expected,
                    "wall_ms": timing.step_ms - getattr(self.policy, "_choice_ms", 0.0),
                    "price_ms": price,
                    "target_ms": timing.target_ms,
                    "draft_ms": sum(p.ms for p in timing.draft_passes),
                    "catchup_tokens": sum(p.extra_tokens for p in timing.draft_passes),
                    "rows_drafted": per_row if self.rates else [],
                }
            )
        self._observe(record)


def run(
    engine, policy, prompts, concurrency: int, max_tokens: int, temperature: float = 0.0, ignore_eos=False
) -> tuple[int, float]:
    """One closed loop with ``policy`` (``bench sweep``'s): output tokens and wall seconds. Sampled
    (``temperature`` > 0) at seed 0, so every configuration emits the same text. The proposer's
    memory of earlier outputs (a suffix cache) and the prompts' cached blocks are cleared first, as
    `bench sweep` clears them, or a configuration would draft from another's identical answers."""
    engine.set_k_policy(policy)
    if engine.proposer is not None:
        engine.proposer.reset()
    engine.reset_prefix_cache()
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=0 if temperature else None, ignore_eos=ignore_eos
    )
    wall, requests, _ = closed_loop(engine, prompts, concurrency, params)
    return sum(len(r.output_token_ids) for r in requests), wall


def summary(steps: list[dict], rows: int) -> dict:
    out = {}
    for kind in ("none", "uniform", "ragged"):
        sel = [s for s in steps if s["kind"] == kind and s["rows"] == rows]
        if not sel:
            continue
        ratio = [s["wall_ms"] / s["price_ms"] for s in sel]
        entry = {
            "steps": len(sel),
            "wall_over_price_median": round(statistics.median(ratio), 4),
            "wall_ms_mean": round(statistics.fmean(s["wall_ms"] for s in sel), 2),
            "price_ms_mean": round(statistics.fmean(s["price_ms"] for s in sel), 2),
            "drafted_per_step": round(statistics.fmean(s["drafted"] for s in sel), 2),
            "accepted_per_step": round(statistics.fmean(s["accepted"] for s in sel), 2),
        }
        expected = [s["expected"] for s in sel if s["expected"] is not None]
        if expected:
            entry["expected_per_step"] = round(statistics.fmean(expected), 2)
        out[kind] = entry
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", required=True)
    p.add_argument("--speculative-config", required=True)
    p.add_argument("--dataset", default="mtbench")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled, seed 0 (a rollout's steps)")
    p.add_argument("--ignore-eos", action="store_true", help="each request runs to --max-tokens")
    p.add_argument(
        "--configs",
        default="K=0,K=2,per-request",
        help="K=k and the benchmarks' policies (stops-off: per-request without confidence stops)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()

    engine = Engine(
        EngineConfig(model="qwen2.5-coder-1.5b-instruct", speculative_config=args.speculative_config)
    )
    profile = load_profile(args.profile)
    names = args.configs.split(",")
    fixed = [int(n.removeprefix("K=")) for n in names if n.startswith("K=")]
    makers = k_policies(fixed, profile, 5, 3)
    prompts = load_prompts(args.dataset, chat=True)[: args.prompts]
    # a short run first: a process's first steps run slower (the first configuration would pay them)
    run(engine, makers[names[0]](), prompts[: args.concurrency], args.concurrency, 16)
    steps: dict[str, list[dict]] = defaultdict(list)
    rates: dict[str, list[float]] = defaultdict(list)
    for rnd in range(args.rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            policy = makers[name]()
            Recorder(policy, GoodputK(profile, 5, live_cells=False), steps[name])
            tokens, wall = run(
                engine, policy, prompts, args.concurrency, args.max_tokens, args.temperature, args.ignore_eos
            )
            rates[name].append(tokens / wall)
            cells = policy.snapshot().get("live_cells") if isinstance(policy, GoodputK) else None
            print(
                f"round {rnd} {name}: {tokens / wall:.2f} tok/s" + (f", live cells {cells}" if cells else "")
            )
    report = {
        "args": vars(args),
        "configs": {
            n: {
                "tokens_per_s_by_round": rates[n],
                "by_kind": summary(steps[n], args.concurrency),
                # rows, drafted, accepted, expected, rows_drafted, wall, price, target, drafter ms, catch-up
                "steps": [
                    [s[key] for key in ("rows", "drafted", "accepted", "expected", "rows_drafted")]
                    + [round(s[key], 2) for key in ("wall_ms", "price_ms", "target_ms", "draft_ms")]
                    + [s["catchup_tokens"]]
                    for s in steps[n]
                ],
            }
            for n in names
        },
    }
    for n in names:
        print(n, json.dumps({k: v for k, v in report["configs"][n].items() if k != "steps"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
