"""`dynaspec bench footprint`: what a user feels before the first token: the process's peak memory,
the time from starting the process to the first generated token (warm file cache), and the disk the
model cache takes, for dynaspec (target alone, target with its drafter) and llama.cpp on the same
GGUF file.

Each configuration runs in a fresh process (a child of this one): it imports, loads, prefills one
chat prompt and generates one token, then reports the time since the parent started it; the peak
resident set size comes from the child's own rusage (`os.wait4`). Each configuration is run once to
warm the file cache, then measured `--repeats` times in turn with the others; the median is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from dynaspec.bench.common import command_args, format_table, write_result

PROMPT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]

_CHILD = r"""
import json, sys, time
spawned = float(sys.argv[1]); cfg = json.loads(sys.argv[2])
if cfg["engine"] == "dynaspec":
    from dynaspec import SamplingParams
    from dynaspec.engine.engine import Engine, EngineConfig
    engine = Engine(EngineConfig(model=cfg["model"], speculative_config=cfg.get("spec"),
                                 quantization=cfg["quantization"], progress=False))
    request = engine.add_request(cfg["prompt"], SamplingParams(max_tokens=1, temperature=0.0))
    while not request.output_token_ids:
        engine.step()
else:
    from dynaspec.bench.llamacpp import make_llama
    from dynaspec.models.loader import resolve_model
    source = resolve_model(cfg["model"])
    ids = source.tokenizer().apply_chat_template(cfg["prompt"])
    llm = make_llama(source.gguf, cfg["threads"])
    next(iter(llm.generate(ids, top_k=1, temp=0.0)))
print(json.dumps({"first_token_s": time.time() - spawned}))
"""


def add_parser(sub) -> None:
    p = sub.add_parser("footprint", help="peak RSS, process start to first token, and disk, per engine")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="'' to skip the pair")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    p.add_argument(
        "--draft-quantizations",
        default="",
        help="e.g. int4,auto: a pair configuration per draft_quantization (default: the engine's)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument(
        "--result-file",
        default="bench-results/footprint.json",
        help="JSON path (default %(default)s: out of the record under results/)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from dynaspec.bench import llamacpp
    from dynaspec.models.packs import PACKS, pack_dir

    base = {"model": args.model, "quantization": args.quantization, "prompt": PROMPT}
    configs = [dict(base, engine="dynaspec", name="dynaspec target")]
    if args.draft:
        spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": 4}
        for q in [q for q in args.draft_quantizations.split(",") if q] or [None]:
            named = spec if q is None else dict(spec, draft_quantization=q)
            name = "dynaspec target + drafter" + ("" if q is None else f" ({q})")
            configs.append(dict(base, engine="dynaspec", name=name, spec=named))
    if not args.no_llamacpp and llamacpp.reference_file(args.model) is not None:
        configs.append(dict(base, engine="llama.cpp", name="llama.cpp", threads=torch.get_num_threads()))
    samples: dict[str, list[tuple[float, int]]] = {c["name"]: [] for c in configs}
    for c in configs:  # warm the file cache
        _child(c)
    for _ in range(args.repeats):
        for c in configs:
            samples[c["name"]].append(_child(c))
    rows, records = [], []
    for name, values in samples.items():
        first = statistics.median(v[0] for v in values)
        rss = max(v[1] for v in values)
        rows.append([name, first, rss / 2**30])
        records.append(
            {"config": name, "first_token_s": round(first, 3), "peak_rss_gib": round(rss / 2**30, 3)}
        )
    print(format_table(["config", "start to first token s", "peak RSS GiB"], rows))
    disk = {}
    for name in (args.model, args.draft):
        if name in PACKS:
            disk[name] = sum(f.stat().st_size for f in pack_dir(name).rglob("*") if f.is_file())
    if disk:
        print("model cache on disk: " + ", ".join(f"{k}: {v / 2**30:.2f} GiB" for k, v in disk.items()))
        print(f"total {sum(disk.values()) / 2**30:.2f} GiB")
    write_result(
        args.result_file,
        {
            "benchmark": "footprint",
            "args": command_args(args),
            "rows": records,
            "cache_bytes": disk,
        },
    )
    return 0


def _child(config: dict) -> tuple[float, int]:
    """(seconds from spawn to first token, peak RSS bytes) of one fresh process running config;
    the child is reaped with os.wait4 for its own rusage (RUSAGE_CHILDREN keeps a maximum over all)."""
    spawned = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, repr(spawned), json.dumps(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        last = err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"
        raise RuntimeError(f"{config['name']}: the child process failed: {last}")
    first = json.loads(out.strip().splitlines()[-1])["first_token_s"]
    return first, usage.ru_maxrss * 1024
