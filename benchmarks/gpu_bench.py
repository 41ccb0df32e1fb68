"""The GPU benchmark of issue 38, in one run: dummy-weight models of real shapes, no weight files.

Stages (each with its own time limit; the JSON is rewritten after every measurement, so a stage
that runs out of time or fails still leaves the others' figures):
  env       the device, torch/triton versions, the device's copy bandwidth (a 2 GiB copy) and the
            bf16 weight-streaming roofline of each shape at batch 1
  invariant the fixed-shape step in each of --invariant-variants, in order: ``off`` as it is,
            ``on`` batch invariant (``batch_invariant``: each row's numbers whatever the rows
            beside it), ``dispatch`` with few-row projections on the faster of cuBLAS and the
            skinny kernel (``fused_ops.SKINNY_DISPATCH``; its timings recorded): the 1.5B/0.5B
            pair's drafter pass and ITL(1 and 4, K), a plain 7B step at batch 1 and 8, and a kernel
            profile of the drafter. A variant named again is measured again (``off,dispatch,
            dispatch,off``: an ABBA pair), its figures under ``invariant_<variant>_2``
  plain     plain decode of the 7B shape, ms a step at batch 1..256 (CUDA graphs), and at batch 1
            and 64 the same step eager on fixed shapes and on the varlen path (today's)
  pair15    ITL(bs, K) for bs in {1, 4, 16, 64, 256}, K = 0..5, of the 1.5B/0.5B pair (synthetic
            acceptance: every K is timed whatever the random weights propose); the drafter's pass
            at batch 1; a K=0 step against a plain one
  pair7     the same grid for the 7B/0.5B pair, then on that engine the synthetic-acceptance sweep:
            none (K=0), fixed K = 1/3/5, the table derived from the grid, goodput batch-level and
            per-request, at concurrency {1, 4, 16, 64, 256}, with EAGLE-3-like and code-pair-like
            rates
  equality  greedy speculative == plain, float32, bfloat16 and bfloat16 batch invariant, on the
            0.5B shape drafting for itself and with the 1.5B shape's drafter
Run it on the GPU machine with the tokenizer files of the Qwen2.5 packs in --tokenizer:
  python benchmarks/gpu_bench.py --tokenizer .gpu/tokenizer --out results/h200/h200.json
On a CPU, ``--dry-run`` runs every stage on tiny shapes in seconds (no figures worth keeping).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from dynaspec.bench.common import environment, format_table, k_policies
from dynaspec.bench.sweep import closed_loop
from dynaspec.engine.build import build_engine
from dynaspec.engine.engine import Engine, EngineConfig
from dynaspec.engine.profiler import ProfileSettings, measure_itl
from dynaspec.kpolicy.policy import FixedK
from dynaspec.kpolicy.profile import Profile, derive_table
from dynaspec.models import fused_ops
from dynaspec.sampling_params import SamplingParams

SHAPES = Path(__file__).parent / "shapes"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
RATES = {
    "eagle3": [0.80, 0.57, 0.41, 0.30, 0.22],  # an EAGLE-3 head's per-position acceptance
    "code_pair": [0.90, 0.86, 0.81, 0.76, 0.75],  # the offline Qwen2.5-Coder 1.5B/0.5B pair on code
}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
TINY_KV = {"num_key_value_heads": 2, "vocab_size": 151936}


class Report:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict = {"environment": environment(), "stages": {}, "errors": {}}

    def put(self, stage: str, key: str, value) -> None:
        self.data["stages"].setdefault(stage, {})[key] = value
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def over(self) -> bool:
        return time.perf_counter() > self.end


def model_dirs(tokenizer: Path, work: Path, dry_run: bool) -> dict[str, str]:
    """A Hugging Face directory per shape: its config.json and the packs' tokenizer files."""
    out = {}
    for shape in ("qwen2.5-7b", "qwen2.5-1.5b", "qwen2.5-0.5b"):
        d = work / shape
        d.mkdir(parents=True, exist_ok=True)
        config = json.loads((SHAPES / shape / "config.json").read_text())
        if dry_run:
            config |= TINY | TINY_KV
        (d / "config.json").write_text(json.dumps(config))
        for name in TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                shutil.copy(tokenizer / name, d / name)
        out[shape] = str(d)
    return out


def make_engine(model: str, dtype: str = "bfloat16", spec: dict | None = None, **kw) -> Engine:
    kw.setdefault("max_num_seqs", 256)
    kw.setdefault("max_num_batched_tokens", 32768)  # a whole batch's drafter catch-up in one step
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("kv_cache_memory_gb", 12.0)
    config = EngineConfig(
        model=model, dtype=dtype, load_format="dummy", speculative_config=spec, progress=False, **kw
    )
    return build_engine(config)


def free(engine: Engine | None) -> None:
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 100_000, (n, length), generator=g).tolist()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(gib: float) -> float:
    """GB/s of a device-to-device copy, counting bytes read and written (best of 5)."""
    if not torch.cuda.is_available():
        return 0.0
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / best / 1e9


def weight_bytes(engine: Engine) -> int:
    model = engine.runner.model
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def decode_ms(engine: Engine, bs: int, steps: int, warmup: int = 3) -> list[float]:
    """Step times (ms) with exactly ``bs`` requests decoding (their prompts prefilled first)."""
    params = SamplingParams(max_tokens=warmup + steps + 8, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts(bs, 64, seed=bs)]
    while not all(r.is_decoding for r in requests):
        engine.step()
    times = []
    for i in range(warmup + steps):
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1000)
    for r in requests:
        engine.abort(r.request_id)
    return times


def stage_env(report: Report, dirs: dict, args) -> None:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {
            "device": props.name,
            "sms": props.multi_processor_count,
            "memory_gib": props.total_memory / 2**30,
        }
    info["copy_gbps"] = round(copy_bandwidth(0.05 if args.dry_run else 2.0), 1)
    report.put("env", "info", info)
    print("env:", info, flush=True)


def stage_plain(report: Report, dirs: dict, args) -> None:
    deadline = Deadline(args.stage_s["plain"])
    engine = make_engine(dirs["qwen2.5-7b"])
    report.put("plain", "graphs", engine.graph_stats)
    nbytes = weight_bytes(engine)
    copy = report.data["stages"]["env"]["info"]["copy_gbps"] or 1.0
    report.put("plain", "weights_gib", round(nbytes / 2**30, 3))
    report.put("plain", "roofline_ms_bs1", round(nbytes / (copy * 1e9) * 1000, 3))
    rows = []
    for bs in args.batch_sizes:
        if deadline.over():
            break
        t = decode_ms(engine, bs, steps=30 if bs <= 16 else 12)
        ms = statistics.median(t)
        row = {"bs": bs, "ms": round(ms, 3), "tok_s": round(bs * 1000 / ms, 1)}
        rows.append(row)
        report.put("plain", "graphs_by_bs", rows)
        print("plain", row, flush=True)
    free(engine)
    for name, kw in (("eager_fixed_shape", {"enforce_eager": True}), ("varlen", {"static_decode": False})):
        if deadline.over():
            break
        engine = make_engine(dirs["qwen2.5-7b"], **kw)
        out = []
        for bs in (1, 64):
            t = decode_ms(engine, bs, steps=8)
            out.append({"bs": bs, "ms": round(statistics.median(t), 3)})
        report.put("plain", name, out)
        print("plain", name, out, flush=True)
        free(engine)


def pair_spec(draft_dir: str, rates: list[float] | None, max_k: int = 5) -> dict:
    spec = {
        "method": "draft_model",
        "model": draft_dir,
        "num_speculative_tokens": max_k,
        "load_format": "dummy",
    }
    if rates is not None:
        spec["synthetic_acceptance_rate"] = rates
    return spec


def grid_of(
    report: Report, engine: Engine, target: str, args, batch_sizes: list[int] | None = None, stage: str = ""
) -> dict[int, dict[int, float]]:
    """ITL(bs, K) of the pair (synthetic acceptance: every row drafts and is timed at its K), the
    drafter's pass at batch 1, and a K=0 step against the plain target's."""
    batch_sizes = [b for b in batch_sizes or args.itl_batch_sizes if b <= engine.config.max_num_seqs]
    settings = ProfileSettings(batch_sizes=batch_sizes, max_k=5, rounds=2, measured_steps=4, revisits=0)
    timings = []
    grid = measure_itl(engine, prompts(max(batch_sizes), 64), settings, progress=False, timings=timings)
    stage = stage or f"pair_{target}"
    report.put(stage, "itl_ms", {str(b): row for b, row in grid.items()})
    passes = [p.ms for t in timings for p in t.draft_passes if p.rows == 1 and p.extra_tokens == 0]
    if passes:
        report.put(stage, "draft_pass_ms_bs1", round(statistics.median(passes), 4))
    if 1 in grid:
        report.put(
            stage, "itl_minus_k0_per_k_bs1", [round((grid[1][k] - grid[1][0]) / k, 3) for k in range(1, 6)]
        )
    print(target, "ITL", grid, flush=True)
    return grid


def kernel_profile(engine: Engine) -> str:
    """The GPU kernels of 6 steps at K=5, batch 1 (graph replays included), by total device time."""
    from torch.profiler import ProfilerActivity, profile

    engine.set_k_policy(FixedK(5))
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    request = engine.add_request(prompts(1, 64, seed=3)[0], params)
    for _ in range(4):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(6):
            engine.step()
    engine.abort(request.request_id)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)


def stage_invariant(report: Report, dirs: dict, args) -> None:
    """The step as it is, then batch invariant (each engine captures its graphs with its setting)."""
    deadline = Deadline(args.stage_s["invariant"])
    seen: dict[str, int] = {}
    for label in args.invariant_variants:
        if deadline.over():
            break
        seen[label] = seen.get(label, 0) + 1
        stage = f"invariant_{label}" + (f"_{seen[label]}" if seen[label] > 1 else "")
        on, dispatch_before = label == "on", fused_ops.SKINNY_DISPATCH
        fused_ops.SKINNY_DISPATCH = label == "dispatch" or (dispatch_before and label != "off")
        tuned = len(fused_ops.TUNING_RECORD)
        try:
            spec = pair_spec(dirs["qwen2.5-0.5b"], RATES["code_pair"])
            engine = make_engine(dirs["qwen2.5-1.5b"], spec=spec, max_num_seqs=8, batch_invariant=on)
            grid_of(report, engine, "qwen2.5-1.5b", args, batch_sizes=[1, 4], stage=stage)
            report.put(stage, "kernel_profile_k5_bs1", kernel_profile(engine))
            free(engine)
            plain = make_engine(dirs["qwen2.5-7b"], max_num_seqs=8, batch_invariant=on)
            for bs in (1, 8):
                ms = statistics.median(decode_ms(plain, bs, steps=30))
                report.put(stage, f"plain7_ms_bs{bs}", round(ms, 4))
            free(plain)
        finally:
            fused_ops.SKINNY_DISPATCH = dispatch_before
        report.put(stage, "projection_timings", fused_ops.TUNING_RECORD[tuned:])
        print(
            stage, {k: v for k, v in report.data["stages"][stage].items() if "profile" not in k}, flush=True
        )


def stage_pair15(report: Report, dirs: dict, args) -> None:
    engine = make_engine(dirs["qwen2.5-1.5b"], spec=pair_spec(dirs["qwen2.5-0.5b"], RATES["code_pair"]))
    report.put("pair_qwen2.5-1.5b", "graphs", engine.graph_stats)
    grid = grid_of(report, engine, "qwen2.5-1.5b", args)
    free(engine)
    plain = make_engine(dirs["qwen2.5-1.5b"])
    ms = statistics.median(decode_ms(plain, 1, steps=30))
    report.put("pair_qwen2.5-1.5b", "plain_ms_bs1", round(ms, 3))
    if 1 in grid:
        report.put("pair_qwen2.5-1.5b", "k0_over_plain_bs1", round(grid[1][0] / ms, 4))
    free(plain)


def stage_pair7(report: Report, dirs: dict, args) -> None:
    """The 7B/0.5B pair's grid, then the sweep on the same engine (each rate set in turn)."""
    deadline = Deadline(args.stage_s["pair7"])
    plain = make_engine(dirs["qwen2.5-7b"])
    engine = make_engine(dirs["qwen2.5-7b"], spec=pair_spec(dirs["qwen2.5-0.5b"], RATES["code_pair"]))
    report.put("pair_qwen2.5-7b", "graphs", engine.graph_stats)
    stats = grid_of(report, engine, "qwen2.5-7b", args)
    engine.set_k_policy(FixedK(0))  # a K=0 step against a plain one, interleaved on the warm GPU
    times: dict[str, list[float]] = {"plain": [], "k0": []}
    for _ in range(3):
        times["plain"] += decode_ms(plain, 1, steps=20)
        times["k0"] += decode_ms(engine, 1, steps=20)
    medians = {name: statistics.median(t) for name, t in times.items()}
    report.put("pair_qwen2.5-7b", "plain_vs_k0_ms_bs1", {n: round(m, 4) for n, m in medians.items()})
    report.put("pair_qwen2.5-7b", "k0_over_plain_bs1", round(medians["k0"] / medians["plain"], 4))
    free(plain)
    report.put("pair_qwen2.5-7b", "kernel_profile_k5_bs1", kernel_profile(engine))
    policies_of = {}
    for rate_name, rates in RATES.items():
        table = derive_table(rates, stats, 5, engine.config.max_num_seqs)
        profile = Profile(5, rates, stats, num_speculative_tokens_per_batch_size=table)
        report.put("sweep", f"{rate_name}_table", table)
        policies_of[rate_name] = {"none": lambda: FixedK(0)} | k_policies(
            [1, 3, 5], profile, 5, hysteresis_steps=2
        )
    params = SamplingParams(max_tokens=args.sweep_tokens, temperature=0.0, ignore_eos=True)
    for c in args.concurrencies:  # every rate set at a concurrency before the next one
        for rate_name, rates in RATES.items():
            if deadline.over():
                break
            engine.set_synthetic_acceptance(rates)
            policies = policies_of[rate_name]
            runs: dict[str, list[float]] = {name: [] for name in policies}
            for r in range(args.sweep_rounds):  # ABBA: each round reverses the order
                for name in list(policies) if r % 2 == 0 else reversed(list(policies)):
                    engine.set_k_policy(policies[name]())
                    wall, requests, _ = closed_loop(engine, prompts(max(c, 4), 64, seed=c), c, params)
                    runs[name].append(sum(len(q.output_token_ids) for q in requests) / wall)
            rows = report.data["stages"].get("sweep", {}).get(rate_name, [])
            for name, values in runs.items():
                mean = statistics.fmean(values)
                rows.append({"concurrency": c, "config": name, "tok_s": round(mean, 1), "runs": values})
            report.put("sweep", rate_name, rows)
            print(
                "sweep", rate_name, c, {n: round(statistics.fmean(v), 1) for n, v in runs.items()}, flush=True
            )
    free(engine)


def stage_equality(report: Report, dirs: dict, args) -> None:
    deadline = Deadline(args.stage_s["equality"])
    target = dirs["qwen2.5-0.5b"]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    # bf16 as it is: cuBLAS picks its kernels by row count, so a verify pass's rows need not round
    # as a plain step's; then batch invariant; float32 (measured in earlier runs) last
    runs = [("bfloat16", False, ""), ("bfloat16", True, "_batch_invariant"), ("float32", False, "")]
    for dtype, on, suffix in runs:
        engine = make_engine(target, dtype=dtype, max_num_seqs=8, kv_cache_memory_gb=1.0, batch_invariant=on)
        plain = [o for o in run_all(engine, prompts(8, 32, seed=7), params)]
        free(engine)
        for drafter in args.equality_drafters:
            if deadline.over():
                return
            spec = pair_spec(dirs[drafter], None, max_k=4)
            engine = make_engine(
                target, dtype=dtype, spec=spec, max_num_seqs=8, kv_cache_memory_gb=1.0, batch_invariant=on
            )
            out = run_all(engine, prompts(8, 32, seed=7), params)
            firsts = [
                next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(out, plain)
            ]
            stats = engine.stats()["spec"]
            result = {
                "equal": sum(f is None for f in firsts),
                "of": len(firsts),
                "first_differences": firsts,
                "acceptance_rate": stats.get("acceptance_rate"),
                "batch_invariant": on,
            }
            report.put("equality", f"{dtype}_{drafter}{suffix}", result)
            print("equality", dtype, drafter, suffix, result, flush=True)
            free(engine)


def run_all(engine: Engine, ps: list, params) -> list[list[int]]:
    requests = [engine.add_request(p, params) for p in ps]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in requests]


STAGES = {
    "env": stage_env,
    "invariant": stage_invariant,
    "plain": stage_plain,
    "pair15": stage_pair15,
    "pair7": stage_pair7,
    "equality": stage_equality,
}
STAGE_S = {"invariant": 120, "plain": 90, "pair7": 200, "equality": 120}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", help="directory with the packs' tokenizer files (required to run)")
    ap.add_argument("--out", default="results/h200/gpu_bench.json")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes (CPU): checks the script runs")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--itl-batch-sizes", default="1,4,16,64,256")
    ap.add_argument("--concurrencies", default="1,4,16,64,256")
    ap.add_argument("--sweep-tokens", type=int, default=96)
    ap.add_argument(
        "--sweep-rounds", type=int, default=1, help="runs of each sweep cell, configurations interleaved"
    )
    ap.add_argument(
        "--stage-s", dest="stage_limits", default="", help="time limits, e.g. plain=30,pair7=150 (seconds)"
    )
    ap.add_argument(
        "--invariant-variants",
        default="off,on",
        help="the invariant stage's, in order: off, on, dispatch (comma-separated, repeats allowed)",
    )
    ap.add_argument(
        "--skinny-dispatch",
        action="store_true",
        help="every stage's projections of few rows on the faster of cuBLAS and the skinny kernel",
    )
    ap.add_argument("--equality-drafters", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--plot", help="PNG of the ITL grids and the sweeps (after the run)")
    ap.add_argument("--plot-from", nargs="+", metavar="JSON", help="run nothing: plot saved runs (merged)")
    args = ap.parse_args(argv)
    if args.plot_from:
        data: dict = {"stages": {}, "environment": {}}
        for path in args.plot_from:
            saved = json.loads(Path(path).read_text())
            for stage, values in saved["stages"].items():
                data["stages"].setdefault(stage, {}).update(values)
            data["environment"] = saved["environment"]
        plot(data, args.plot or "gpu_bench.png")
        return 0
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.itl_batch_sizes = [int(b) for b in args.itl_batch_sizes.split(",")]
    args.concurrencies = [int(b) for b in args.concurrencies.split(",")]
    args.stage_s = dict(STAGE_S)
    for item in filter(None, args.stage_limits.split(",")):
        name, _, seconds = item.partition("=")
        args.stage_s[name] = float(seconds)
    args.invariant_variants = args.invariant_variants.split(",")
    fused_ops.SKINNY_DISPATCH = args.skinny_dispatch
    args.equality_drafters = args.equality_drafters.split(",")
    if args.dry_run:
        args.batch_sizes, args.itl_batch_sizes, args.concurrencies = [1, 4], [1, 4], [1, 4]
        args.sweep_tokens = 8
    if not args.tokenizer:
        ap.error("--tokenizer: required unless --plot-from")
    report = Report(Path(args.out))
    report.data["command"] = sys.argv
    with tempfile.TemporaryDirectory() as work:
        dirs = model_dirs(Path(args.tokenizer), Path(work), args.dry_run)
        for name in args.stages.split(","):
            start = time.perf_counter()
            try:
                STAGES[name](report, dirs, args)
            except Exception:  # a failed stage leaves the others' figures
                report.data["errors"][name] = traceback.format_exc()
                report.save()
                print(f"stage {name} failed:\n{traceback.format_exc()}", flush=True)
            print(f"stage {name}: {time.perf_counter() - start:.1f} s", flush=True)
            gc.collect()
    summarize(report.data)
    if args.plot:
        plot(report.data, args.plot)
    return 0


def plot(data: dict, path: str) -> None:
    """ITL(bs, K) of each pair, and each sweep's tokens/s over no speculation's, against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = data["stages"]
    device = stages.get("env", {}).get("info", {}).get("device") or data["environment"].get("device", "GPU")
    grids = [
        (k, stages[k]["itl_ms"])
        for k in ("pair_qwen2.5-1.5b", "pair_qwen2.5-7b")
        if "itl_ms" in stages.get(k, {})
    ]
    sweeps = [(n, r) for n, r in stages.get("sweep", {}).items() if not n.endswith("_table")]
    panels = len(grids) + len(sweeps)
    if not panels:
        return
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    for ax, (name, grid) in zip(axes[0], grids):
        for bs, row in grid.items():
            ks = sorted(int(k) for k in row)
            ax.plot(ks, [row[k] if k in row else row[str(k)] for k in ks], marker="o", label=f"bs {bs}")
        ax.set(title=f"{name.removeprefix('pair_')} + 0.5B: ITL(bs, K)", xlabel="K", ylabel="ms a step")
        ax.legend(fontsize=7)
    for ax, (name, rows) in zip(axes[0][len(grids) :], sweeps):
        none = {r["concurrency"]: r["tok_s"] for r in rows if r["config"] == "none"}
        for config in dict.fromkeys(r["config"] for r in rows):
            pts = [
                (r["concurrency"], r["tok_s"] / none[r["concurrency"]]) for r in rows if r["config"] == config
            ]
            style = "-" if config in ("goodput", "per-request") else ":"
            ax.plot(*zip(*pts), style, marker="o", label=config)
        ax.set(
            title=f"sweep, {name} rates",
            xlabel="concurrency",
            ylabel="tok/s over no speculation",
            xscale="log",
        )
        ax.legend(fontsize=7)
    fig.suptitle(f"dynaspec on {device} (7B/1.5B/0.5B shapes, dummy weights)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(data: dict) -> None:
    stages = data["stages"]
    plain = stages.get("plain", {}).get("graphs_by_bs", [])
    if plain:
        print(format_table(["bs", "ms/step", "tok/s"], [[r["bs"], r["ms"], r["tok_s"]] for r in plain]))
    for key in ("pair_qwen2.5-1.5b", "pair_qwen2.5-7b"):
        grid = stages.get(key, {}).get("itl_ms", {})
        if grid:
            rows = [[bs] + [row.get(k, row.get(str(k))) for k in range(6)] for bs, row in grid.items()]
            print(key, "ITL(bs, K) ms")
            print(format_table(["bs"] + [f"K={k}" for k in range(6)], rows))
    variants = [(k, v) for k, v in stages.items() if k.startswith("invariant_")]
    if variants:
        head = ["variant", "drafter pass ms", "ITL(1,K)-ITL(1,0) per K", "7B bs1 ms", "7B bs8 ms"]
        rows = [
            [
                k,
                v.get("draft_pass_ms_bs1"),
                v.get("itl_minus_k0_per_k_bs1"),
                v.get("plain7_ms_bs1"),
                v.get("plain7_ms_bs8"),
            ]
            for k, v in variants
        ]
        print(format_table(head, rows))
    with contextlib.suppress(KeyError):
        for rate_name, rows in stages["sweep"].items():
            if rate_name.endswith("_table"):
                continue
            print("sweep", rate_name)
            configs = list(dict.fromkeys(r["config"] for r in rows))
            by_c: dict[int, dict] = {}
            for r in rows:
                by_c.setdefault(r["concurrency"], {})[r["config"]] = r["tok_s"]
            print(
                format_table(["conc"] + configs, [[c] + [v.get(n) for n in configs] for c, v in by_c.items()])
            )


if __name__ == "__main__":
    sys.exit(main())
