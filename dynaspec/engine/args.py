"""Flags shared by the subcommands that build an engine."""

from __future__ import annotations

import argparse


def add_engine_args(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        required=model_required,
        help="pack name (see `dynaspec models list`), HF directory or .gguf file",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        help="JSON, or @path/to/file.json: method, model, num_speculative_tokens, ...",
    )
    g.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="auto: a GGUF's own blocks (dense for HF directories); none: dense weights; int8/int4: "
        "round-to-nearest at load, lower quality than a GGUF's own",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="activations (auto: float32 around quantized layers, bfloat16 for dense ones)",
    )
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    add_load_format_arg(g)
    g.add_argument("--max-num-seqs", type=int, default=32, help="cap on running requests")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per engine step")
    g.add_argument("--kv-cache-memory-gb", type=float, default=2.0, help="KV cache budget")
    g.add_argument("--seed", type=int, default=0, help="engine seed for requests without one")
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: decode steps on fixed shapes run eagerly (CUDA; graphs are the default there)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share the K/V of prompt blocks already computed (default: on, except with a draft model "
        "or EAGLE head, whose own K/V live in the same blocks)",
    )
    g.add_argument(
        "--batch-invariant",
        action="store_true",
        help="fixed-shape steps whose rows do not depend on each other: greedy speculation equals plain "
        "decoding in bfloat16 too (CUDA; slower)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        speculative_config=args.speculative_config,
        dtype=args.dtype,
        quantization=args.quantization,
        load_format=args.load_format,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        batch_invariant=args.batch_invariant,
        enable_prefix_caching=args.enable_prefix_caching,
    )


def add_load_format_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="auto: the model's weights; dummy: random weights of the model's shape (from its config: "
        "a pack needs no download), no weight file read: for profiling and benchmarking a machine",
    )


def check_at_least(*checks: tuple[str, float, float]) -> None:
    """(flag, value, least) triples: a ValueError naming the first flag whose value is below its least
    (or is not a number: NaN)."""
    for flag, value, least in checks:
        if not value >= least:
            raise ValueError(f"{flag}: must be >= {least}, got {value}")
