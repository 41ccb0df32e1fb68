"""How often the pair's drafts would be kept, position by position, on the target's own sampled
text (`git show e12b4e2:results/RESULTS.md`, "n-gram drafts take plain decoding's draws"):

- by rejection sampling, sum min(p, q) (what dynaspec runs);
- by a draft drawn at the very uniform plain decoding will use (q's CDF inverted there, kept iff
  p's inverse gives the same token): the pair would then emit plain decoding's text exactly;
- each with the drafter's whole head and with it cut to the first ``--draft-vocab-size`` ids (the
  pair's config), and the share of sampled tokens that lie beyond the cut (never draftable);
- with ``--draft-quantization``, for the drafter's weights re-quantized at load (int4, int8);
- with ``--context-ids``, with the cut head widened by the ids already in each request's context
  (its prompt and output so far): what a head that also scores a request's own rare tokens keeps;
- with ``--draft-context-windows``, for a drafter that sees only the context's first 4 tokens and its
  last W (``draft_context_window``, a sliding window), by rejection sampling with the cut head;
- with ``--draft-scales``, by rejection sampling from the cut head's distribution sharpened or
  flattened: drafted at these fractions of the request's temperature (q^(1/s), renormalized).

    .venv/bin/python benchmarks/probes/draft_acceptance.py [--dataset humaneval] [--prompts 6] \
        [--max-tokens 128]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from dynaspec import SamplingParams
from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.engine.runner import TokenRun


def engine_for(model: str, quantization: str = "auto") -> Engine:
    return Engine(
        EngineConfig(model=model, quantization=quantization, progress=False, kv_cache_memory_gb=0.5)
    )


def probabilities(engine: Engine, texts: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Per text, the model's next-token distribution at each output position: [outputs, vocab]."""
    out = []
    for prompt, output in texts:
        ids = prompt + output[:-1]
        blocks: list[int] = []
        assert engine.allocator.grow(blocks, len(ids))
        rows = list(range(len(prompt) - 1, len(ids)))
        out.append(torch.softmax(engine.runner.run([TokenRun(ids, 0, blocks, rows)]), -1))
        engine.allocator.free(blocks)
    return out


def kept(p: torch.Tensor, q: torch.Tensor) -> tuple[float, float]:
    """(sum over positions of min(p, q), of the overlap of p's and q's CDF intervals per token)."""
    fp, fq = p.double().cumsum(-1), q.double().cumsum(-1)
    start = torch.maximum(F.pad(fp, (1, 0))[:, :-1], F.pad(fq, (1, 0))[:, :-1])
    overlap = (torch.minimum(fp, fq) - start).clamp(min=0).sum()
    return float(torch.minimum(p, q).sum()), float(overlap)


def cut_head(q: torch.Tensor, cut: int) -> torch.Tensor:
    """q as a head cut to its first ``cut`` ids would give it: the rest zeroed, renormalized."""
    q = q.clone()
    q[:, cut:] = 0.0
    return q / q.sum(-1, keepdim=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--draft-vocab-size", type=int, default=32768)
    p.add_argument("--draft-scales", default="", help="e.g. 1.0,0.8: draft / request temperature")
    p.add_argument(
        "--draft-quantization",
        default="int4",
        help="the drafter's --quantization (auto, none, int8, int4; int4 is the engine's default on the CPU)",
    )
    p.add_argument("--context-ids", action="store_true", help="the cut head plus the context's own ids")
    p.add_argument("--draft-context-windows", default="", help="e.g. 64,256: sliding windows to compare")
    args = p.parse_args()
    target = engine_for(args.model)
    prompts = load_prompts(args.dataset)[: args.prompts]
    params = [
        SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    requests = [target.add_request(prompt, sp) for prompt, sp in zip(prompts, params)]
    while target.has_unfinished():
        target.step()
    texts = [(list(r.prompt_token_ids), list(r.output_token_ids)) for r in requests]
    sampled = [t for _, output in texts for t in output]
    beyond = sum(t >= args.draft_vocab_size for t in sampled) / len(sampled)
    cut = args.draft_vocab_size
    print(f"{args.dataset}: {len(sampled)} sampled tokens, {beyond:.3f} of them at ids >= {cut}")
    ps = probabilities(target, texts)
    del target
    drafter = engine_for(args.draft, args.draft_quantization)
    qs = probabilities(drafter, texts)
    print(f"drafter {args.draft}, quantization {args.draft_quantization}")
    for name, head in (("whole draft head", None), (f"draft head cut to {cut}", cut)):
        rejection = shared = 0.0
        for pt, q in zip(ps, qs):
            a, b = kept(pt, q if head is None else cut_head(q, head))
            rejection, shared = rejection + a, shared + b
        n = len(sampled)
        print(
            f"{name}: kept by rejection sampling {rejection / n:.3f}, by the shared uniform "
            f"{shared / n:.3f} ({shared / rejection:.3f}x)"
        )
    if args.context_ids:
        kept_sum, extra = 0.0, 0
        for (prompt, output), pt, q in zip(texts, ps, qs):
            allowed = torch.zeros(q.shape[-1], dtype=torch.bool)
            allowed[:cut] = True
            allowed[prompt] = True
            for t in range(len(output)):
                qt = torch.where(allowed, q[t], 0.0)
                kept_sum += float(torch.minimum(pt[t], qt / qt.sum()).sum())
                extra += int(allowed[cut:].sum())
                allowed[output[t]] = True
        print(
            f"draft head cut to {cut} plus the context's ids: kept by rejection sampling "
            f"{kept_sum / len(sampled):.3f} ({extra / len(sampled):.0f} ids beyond the cut on average)"
        )
    for window in [int(x) for x in args.draft_context_windows.split(",") if x.strip()]:
        drafter.runner.window = window
        kept_sum = 0.0
        for pt, q in zip(ps, probabilities(drafter, texts)):
            kept_sum += kept(pt, cut_head(q, cut))[0]
        drafter.runner.window = None
        kept_rate = kept_sum / len(sampled)
        print(f"draft head cut to {cut}, context window {window}: kept by rejection sampling {kept_rate:.3f}")
    for scale in [float(x) for x in args.draft_scales.split(",") if x.strip()]:
        kept_sum = 0.0
        for pt, q in zip(ps, qs):
            q = q.double().clamp_min(1e-30) ** (1.0 / scale)
            q[:, cut:] = 0.0  # the cut head never proposes these ids
            q /= q.sum(-1, keepdim=True)
            kept_sum += float(torch.minimum(pt.double(), q).sum())
        kept_rate = kept_sum / len(sampled)
        print(f"draft head cut to {cut}, drafted at {scale:g}x the temperature: kept {kept_rate:.4f}")


if __name__ == "__main__":
    main()
