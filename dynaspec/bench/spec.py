"""`dynaspec bench spec`: speculative speedup at batch size 1, greedy, against plain decoding and
against Hugging Face transformers' assisted generation with the same pair, in one run (with
``--eagle3 DIR``, an EAGLE-3 head beside the draft model and n-gram; with ``--with-suffix``, the
draft model and the head each with suffix drafts beside them, under the goodput policy on their
auto profiles: the configuration a user of ``enable_suffix_decoding`` gets).

Configurations are interleaved prompt by prompt (every configuration runs prompt 1, then prompt 2,
...) so machine noise hits them alike. Speeds are output tokens over wall time, prefill included.
"""

from __future__ import annotations

import argparse
import gc
import time

from dynaspec.bench.common import command_args, format_table, write_result
from dynaspec.engine.args import add_load_format_arg


def add_parser(sub) -> None:
    p = sub.add_parser("spec", help="batch-1 speculative speedup: K sweep, ngram, transformers assisted")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--ks", default="0,1,2,3,4,5,6", help="draft_model K values (K=0: drafter loaded, never run)"
    )
    p.add_argument("--ngram-k", type=int, default=4, help="K for the ngram proposer (0: skip)")
    p.add_argument(
        "--eagle3", default=None, metavar="DIR", help="also an EAGLE-3 head (a checkpoint directory)"
    )
    p.add_argument(
        "--eagle-k", default="3", help="K values for --eagle3 (comma-separated; its head int8 on the CPU)"
    )
    p.add_argument(
        "--with-suffix",
        action="store_true",
        help="also the draft model (and --eagle3's head) with enable_suffix_decoding, under the goodput "
        "policy on an auto profile (made on first use, then cached)",
    )
    p.add_argument(
        "--suffix-profile",
        default="auto",
        metavar="PATH",
        help="the --with-suffix configs' dynamic_config_path (default: auto)",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="the target's (and drafter's)",
    )
    p.add_argument(
        "--draft-quantization",
        default=None,
        choices=["auto", "none", "int8", "int4"],
        help="the drafter's, if not the target's (drafts only: lossless)",
    )
    p.add_argument(
        "--llamacpp-lookup",
        type=int,
        default=10,
        help="llama.cpp reference (if llama-cpp-python is installed): prompt-lookup draft tokens (0: plain)",
    )
    p.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp reference")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: torch's)")
    p.add_argument("--draft-vocab-size", type=int, default=32768, help="drafter LM head rows kept (0: all)")
    p.add_argument(
        "--draft-context-window",
        type=int,
        default=None,
        help="the drafter's draft_context_window (default: the config's, 256; 0: the whole context)",
    )
    p.add_argument("--no-hf", action="store_true", help="skip transformers (plain and assisted generation)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    add_load_format_arg(p)
    p.add_argument(
        "--result-file",
        default="bench-results/spec.json",
        help="JSON path (default %(default)s: out of the record under results/)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dynaspec.bench.llamacpp import lookup_generate
    from dynaspec.datasets import load_prompts
    from dynaspec.engine.build import build_engine
    from dynaspec.engine.engine import Engine, EngineConfig
    from dynaspec.kpolicy.policy import FixedK
    from dynaspec.sampling_params import SamplingParams

    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    if not ks or min(ks) < 0 or max(ks) < 1:
        raise ValueError("--ks: need comma-separated integers >= 0, at least one >= 1")
    if args.load_format == "dummy" and not (args.no_hf and args.no_llamacpp):
        raise ValueError(
            "--load-format dummy: add --no-hf and --no-llamacpp (the references read the weights)"
        )
    prompts = load_prompts(args.dataset, chat=True)[: args.num_prompts]
    base = dict(
        dtype=args.dtype,
        quantization=args.quantization,
        load_format=args.load_format,
        max_num_seqs=1,
        kv_cache_memory_gb=1.0,
        enable_prefix_caching=False,  # each prompt runs once per configuration: all start cold
    )
    draft_spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": max(ks)}
    if args.draft_quantization:
        draft_spec["draft_quantization"] = args.draft_quantization
    if args.draft_vocab_size:
        draft_spec["draft_vocab_size"] = args.draft_vocab_size
    if args.draft_context_window is not None:
        draft_spec["draft_context_window"] = args.draft_context_window
    engines = {"plain": Engine(EngineConfig(model=args.model, **base))}
    engines["draft"] = Engine(EngineConfig(model=args.model, speculative_config=draft_spec, **base))
    configs = [("dynaspec plain", "plain", None)] + [(f"dynaspec K={k}", "draft", k) for k in ks]
    if args.ngram_k:
        ngram = {"method": "ngram", "num_speculative_tokens": args.ngram_k}
        engines["ngram"] = Engine(EngineConfig(model=args.model, speculative_config=ngram, **base))
        configs.append((f"dynaspec ngram K={args.ngram_k}", "ngram", args.ngram_k))
    if args.eagle3:
        eagle_ks = [int(k) for k in args.eagle_k.split(",") if k.strip()]
        if not eagle_ks or min(eagle_ks) < 1:
            raise ValueError(f"--eagle-k: need comma-separated integers >= 1, got {args.eagle_k!r}")
        eagle = {"method": "eagle3", "model": args.eagle3, "num_speculative_tokens": max(eagle_ks)}
        engines["eagle3"] = Engine(EngineConfig(model=args.model, speculative_config=eagle, **base))
        configs += [(f"dynaspec eagle3 K={k}", "eagle3", k) for k in eagle_ks]
    if args.with_suffix:  # each drafter with suffix drafts, K chosen by goodput on its auto profile
        for name, spec in [("draft", draft_spec)] + ([("eagle3", eagle)] if args.eagle3 else []):
            hybrid = spec | {"dynamic_config_path": args.suffix_profile, "enable_suffix_decoding": True}
            config = EngineConfig(model=args.model, speculative_config=hybrid, **base)
            engines[f"{name}+suffix"] = build_engine(config)
            configs.append((f"dynaspec {name}+suffix goodput", f"{name}+suffix", None))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    tokenizer = engines["plain"].tokenizer
    prompt_ids = [tokenizer.apply_chat_template(p) for p in prompts]

    llamas = _llamacpp_engines(args)
    configs += [(name, name, None) for name in llamas]
    totals = {
        name: {"tokens": 0, "wall": 0.0, "outputs": [], "accepted": 0, "drafts": 0, "per_pos": []}
        for name, _, _ in configs
    }
    for ids in prompt_ids:
        for name, engine_name, k in configs:
            if engine_name in llamas:
                wall, out = lookup_generate(
                    llamas[engine_name], ids, args.max_tokens, tokenizer.eos_token_ids
                )
                t = totals[name]
                t["wall"] += wall
                t["tokens"] += len(out)
                t["outputs"].append(out)
                continue
            engine = engines[engine_name]
            if k is not None:
                engine.set_k_policy(FixedK(k))
                engine.proposer.reset()  # no run drafts from another's output of the same prompt
            start = time.perf_counter()
            with engine.recording() as run:
                request = engine.add_request(ids, params)
                while engine.has_unfinished():
                    engine.step()
            t = totals[name]
            t["wall"] += time.perf_counter() - start
            t["tokens"] += len(request.output_token_ids)
            t["outputs"].append(request.output_token_ids)
            t["accepted"] += run.spec.num_accepted_tokens
            t["drafts"] += run.spec.num_drafts
            t["per_pos"] = _add(t["per_pos"], run.spec.accepted_per_pos)
        print(f"prompt done: {len(ids)} prompt tokens", flush=True)
    del engines, llamas
    gc.collect()
    if not args.no_hf:
        _run_transformers(args, prompt_ids, totals)

    plain = totals["dynaspec plain"]
    plain_speed = plain["tokens"] / plain["wall"] if plain["wall"] else 0.0
    rows, records = [], []
    for name, t in totals.items():
        speed = t["tokens"] / t["wall"] if t["wall"] else 0.0
        al = 1 + t["accepted"] / t["drafts"] if t["drafts"] else None
        per_pos = [round(a / t["drafts"], 3) for a in t["per_pos"]] if t["drafts"] else []
        same = sum(a == b for a, b in zip(t["outputs"], plain["outputs"]))
        rows.append(
            [
                name,
                t["tokens"],
                round(t["wall"], 2),
                speed,
                speed / plain_speed if plain_speed else None,
                al,
                " ".join(f"{a:.2f}" for a in per_pos) or "-",
                f"{same}/{len(plain['outputs'])}",
            ]
        )
        records.append(
            {
                "config": name,
                "output_tokens": t["tokens"],
                "wall_s": round(t["wall"], 3),
                "tokens_per_s": round(speed, 3),
                "speedup_vs_dynaspec_plain": round(speed / plain_speed, 3) if plain_speed else None,
                "acceptance_length": None if al is None else round(al, 3),
                "acceptance_rate_per_pos": per_pos,
                "outputs_identical_to_dynaspec_plain": same,
            }
        )
    print(
        format_table(
            ["config", "tokens", "wall s", "tok/s", "speedup", "AL", "accept per pos", "same as plain"], rows
        )
    )
    write_result(
        args.result_file,
        {
            "benchmark": "spec",
            "args": command_args(args),
            "draft_config": draft_spec,
            "rows": records,
        },
    )
    return 0


def _llamacpp_engines(args) -> dict:
    """The llama.cpp reference configs on the same GGUF file: plain, and with prompt lookup."""
    import torch

    from dynaspec.bench import llamacpp

    if args.no_llamacpp:
        return {}
    gguf = llamacpp.reference_file(args.model)
    if gguf is None:
        return {}
    threads = args.threads or torch.get_num_threads()
    llamas = {"llama.cpp plain": llamacpp.make_llama(gguf, threads)}
    if args.llamacpp_lookup:
        llamas[f"llama.cpp lookup {args.llamacpp_lookup}"] = llamacpp.make_llama(
            gguf, threads, lookup_tokens=args.llamacpp_lookup
        )
    return llamas


def _run_transformers(args, prompt_ids, totals) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from dynaspec.models.loader import resolve_model

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(
        **resolve_model(args.model).transformers_kwargs(), dtype=dtype
    ).eval()
    draft = AutoModelForCausalLM.from_pretrained(
        **resolve_model(args.draft).transformers_kwargs(), dtype=dtype
    ).eval()
    for name in ("transformers plain", "transformers assisted"):
        totals[name] = {"tokens": 0, "wall": 0.0, "outputs": [], "accepted": 0, "drafts": 0, "per_pos": []}
    for ids in prompt_ids:
        x = torch.tensor([ids])
        for name, extra in (
            ("transformers plain", {}),
            ("transformers assisted", {"assistant_model": draft}),
        ):
            start = time.perf_counter()
            with torch.inference_mode():
                out = target.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=args.max_tokens,
                    do_sample=False,
                    **extra,
                )
            t = totals[name]
            t["wall"] += time.perf_counter() - start
            new = out[0, len(ids) :].tolist()
            t["tokens"] += len(new)
            t["outputs"].append(new)


def _add(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]
