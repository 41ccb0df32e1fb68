"""How often a sampled draft is kept: rejection sampling with a residual against coupled draws.

For every position a sampled draft_model step verifies, the probability that its draft is kept
under three rules, from the target's and the drafter's processed distributions p and q there:
rejection sampling (sum min(p, q)), the draws dynaspec uses since sampled verification became
counter-based (``coupled_draw``: Gumbel races for the 32 most likely tokens, the rest as one;
estimated over 64 noise draws a position), and a draw inverting each cumulative distribution at
one shared uniform (the overlap of the two tokens' cumulative intervals). It hooks the per-row
rejection step of the sampler before that change, so run it on a checkout of commit 9b6fe3c:

    git worktree add /tmp/before 9b6fe3c
    PYTHONPATH=/tmp/before .venv/bin/python benchmarks/probes/coupling_acceptance.py \
        --temperature 0.7 --dataset mt_bench
"""

import argparse

import torch

import dynaspec.spec_decode.rejection as rejection
from dynaspec import LLM, SamplingParams
from dynaspec.datasets import load_prompts

RACING, NOISE_DRAWS = 32, 64


def coupled_keep_rate(p: torch.Tensor, q: torch.Tensor) -> float:  # p, q: [vocab] normalized
    """P(draft == target token) when both race the same per-token noise (Monte Carlo)."""
    g = -(-torch.rand(NOISE_DRAWS, p.numel()).clamp_(min=1e-12).log()).log()  # [draws, vocab]
    g_rest = -(-torch.rand(NOISE_DRAWS).clamp_(min=1e-12).log()).log()
    u_rest = torch.rand(NOISE_DRAWS)

    def draw(d: torch.Tensor) -> torch.Tensor:  # [draws]
        ids = d.topk(RACING).indices
        rest = d.clone()
        rest[ids] = 0
        best = (d[ids].log()[None] + g[:, ids]).max(-1)
        rest_race = rest.sum().clamp(min=1e-30).log() + g_rest
        cdf = rest.cumsum(0)
        from_rest = torch.searchsorted(cdf, (u_rest * cdf[-1])[:, None], right=True)[:, 0].clamp(
            max=d.numel() - 1
        )
        return torch.where(rest_race > best.values, from_rest, ids[best.indices])

    return float((draw(p) == draw(q)).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    sums = {"rejection": 0.0, "coupled": 0.0, "one_uniform": 0.0}
    count = 0
    verify_row = rejection._verify_row

    def spy(p, drafts, n, q, generator):
        nonlocal count
        for i in range(n if q is not None else 0):
            pi, qi = p[i] / p[i].sum(), q[i] / q[i].sum()
            fp, fq = pi.cumsum(0), qi.cumsum(0)
            sums["rejection"] += float(torch.minimum(pi, qi).sum())
            sums["one_uniform"] += float(
                (torch.minimum(fp, fq) - torch.maximum(fp - pi, fq - qi)).clamp(min=0).sum()
            )
            sums["coupled"] += coupled_keep_rate(pi, qi)
            count += 1
        return verify_row(p, drafts, n, q, generator)

    rejection._verify_row = spy
    spec = {
        "method": "draft_model",
        "model": "qwen2.5-coder-0.5b-instruct",
        "num_speculative_tokens": 3,
        "draft_vocab_size": 32768,
    }
    llm = LLM("qwen2.5-coder-1.5b-instruct", speculative_config=spec)
    prompts = load_prompts(args.dataset)[: args.num_prompts]
    llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=1))
    print(f"{args.dataset} temperature {args.temperature}: {count} drafts")
    for name, total in sums.items():
        print(f"  {name:12s} {total / max(count, 1):.3f} kept a position")


if __name__ == "__main__":
    main()
