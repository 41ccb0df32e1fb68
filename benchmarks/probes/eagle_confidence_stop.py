"""An EAGLE-3 head at K=1 with confidence stops (a draft kept only where the head's top
probability reaches t) against plain decoding at batch 1, engines interleaved prompt by prompt;
and how many of the target's output tokens the head's cut draft vocabulary holds at all (a token
outside it is never drafted).

    .venv/bin/python benchmarks/probes/eagle_confidence_stop.py bench-results/heads/xeon-eagle3 \
        [--thresholds 0,0.1,0.2,0.3] [--dataset mtbench] [--num-prompts 4] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from safetensors import safe_open

from dynaspec.datasets import load_prompts
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.kpolicy.policy import FixedK
from dynaspec.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("head", help="an EAGLE-3 checkpoint directory")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--thresholds", default="0,0.1,0.2,0.3")
    ap.add_argument("--dataset", default="mtbench")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = dict(model=args.model, max_num_seqs=1, kv_cache_memory_gb=1.0, progress=False)
    engines = {"plain": Engine(EngineConfig(**base))}
    for t in (float(x) for x in args.thresholds.split(",")):
        spec = {"method": "eagle3", "model": args.head, "num_speculative_tokens": 1}
        engine = engines[f"eagle3 K=1 t={t}"] = Engine(EngineConfig(speculative_config=spec, **base))
        engine.set_k_policy(FixedK(1, min_confidence=t))
    tokenizer = engines["plain"].tokenizer
    prompts = [tokenizer.apply_chat_template(p) for p in load_prompts(args.dataset, chat=True)]
    totals = {name: {"tokens": 0, "wall": 0.0, "drafts": 0, "accepted": 0, "outputs": []} for name in engines}
    for i, ids in enumerate(prompts[: args.num_prompts]):
        names = list(engines) if i % 2 == 0 else list(engines)[::-1]  # ABBA by prompt
        for name in names:
            engine, total = engines[name], totals[name]
            start = time.perf_counter()
            with engine.recording() as run:
                request = engine.add_request(ids, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
                while engine.has_unfinished():
                    engine.step()
            total["wall"] += time.perf_counter() - start
            total["tokens"] += len(request.output_token_ids)
            total["outputs"].append(request.output_token_ids)
            total["drafts"] += run.spec.num_drafts
            total["accepted"] += run.spec.num_accepted_tokens
    plain = totals["plain"]
    plain_speed = plain["tokens"] / plain["wall"]
    rows = []
    for name, t in totals.items():
        speed = t["tokens"] / t["wall"]
        same = sum(a == b for a, b in zip(t["outputs"], plain["outputs"]))
        rows.append(
            {
                "config": name,
                "tok_s": round(speed, 2),
                "x_plain": round(speed / plain_speed, 3),
                "drafts": t["drafts"],
                "accepted": t["accepted"],
                "same_as_plain": f"{same}/{len(plain['outputs'])}",
            }
        )
        print(
            f"{name:20s} {speed:6.2f} tok/s {speed / plain_speed:6.3f}x  drafts {t['drafts']:4d}  "
            f"accepted {t['accepted']:4d}  same as plain {same}/{len(plain['outputs'])}"
        )
    with safe_open(f"{args.head}/model.safetensors", framework="pt") as f:
        d2t = f.get_tensor("d2t").long() if "d2t" in f.keys() else None  # noqa: SIM118 (a safe_open handle)
    coverage = None
    if d2t is not None:
        vocab = set((torch.arange(len(d2t)) + d2t).tolist())
        tokens = [t for out in plain["outputs"] for t in out]
        coverage = round(sum(t in vocab for t in tokens) / len(tokens), 4)
        print(
            f"plain output tokens in the head's {len(d2t)}-id draft vocabulary: "
            f"{coverage:.3f} of {len(tokens)}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "draft_vocab_coverage": coverage}, f, indent=1)


if __name__ == "__main__":
    main()
