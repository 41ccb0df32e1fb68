"""Time each fused op (models/fused_ops.py): its Triton kernel against its torch twin, on CUDA, at the
decode shapes of Qwen2.5-7B, -1.5B and -0.5B (bf16), batch 1/16/64, query_len 1 and 6 (decode, and
verify of K=5 drafts), a context of 512 tokens; the few-row projections (q/k/v with its bias, o,
gate/up, down, the head) as the skinny kernel against cuBLAS, and ``top1`` against a softmax and max.
Then the projection dispatch (``SKINNY_DISPATCH``): at each shape and --dispatch-rows, cuBLAS and
every skinny config timed as the engine times them (graph replays over weight copies larger than
L2), and which one the engine would run.

    python benchmarks/fused_ops_bench.py --out results/fused_ops.json --skinny-configs 16,128,4,3 32,256,4,3

    python benchmarks/fused_ops_bench.py --out results/fused_ops.json
    python benchmarks/fused_ops_bench.py --dry-run --out /tmp/fused_ops.json   # CPU: tiny shapes, twins

Prints tables and writes JSON (the device named). Each kernel is timed eagerly (launch overhead
included: what an uncaptured step pays) and replayed in a CUDA graph (the GPU's time); "x" is the
eager speed-up over the twin. Paged attention also reports the K/V bytes of the context over its
graph time (GB/s), against the device's memory bandwidth. The skinny kernel runs with its
batch-invariant configs in the main table (chosen by shape; --skinny-configs forces one).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dynaspec.bench.common import environment
from dynaspec.models import fused_ops
from dynaspec.models.fused_ops import capture_graph

BLOCK_SIZE = 16
GRAPH_CALLS = 20


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


SHAPES = {
    "7b": Shape(3584, 18944, 28, 4, 128),
    "1.5b": Shape(1536, 8960, 12, 2, 128),
    "0.5b": Shape(896, 4864, 14, 2, 64),
}
TINY = {"tiny": Shape(64, 96, 4, 2, 16)}
VOCAB = 151936
PROJECTIONS = ("qkv_linear", "o_linear", "gate_up_linear", "down_linear", "head_linear")


@dataclass(slots=True)
class Row:
    model: str
    batch: int
    query_len: int
    op: str
    kernel_us: float | None  # eager calls; None: twins only (dry run)
    graph_us: float | None  # per call, GRAPH_CALLS calls replayed as one CUDA graph: the GPU's time
    twin_us: float
    kv_gbps: float | None = None  # paged attention: K/V bytes of the context over graph_us


def _projections(
    shape: Shape, dtype: torch.dtype, device: str
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """{projection: (weight [out, in], bias or None)} of a layer of the shape, and its head."""
    hq, hk, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    vocab = VOCAB if device == "cuda" else 1000

    def matrix(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, device=device).to(dtype) * 0.02

    return {
        "qkv_linear": (
            matrix((hq + 2 * hk) * d, shape.hidden),
            torch.randn((hq + 2 * hk) * d, device=device).to(dtype),
        ),
        "o_linear": (matrix(shape.hidden, hq * d), None),
        "gate_up_linear": (matrix(2 * shape.intermediate, shape.hidden), None),
        "down_linear": (matrix(shape.hidden, shape.intermediate), None),
        "head_linear": (matrix(vocab, shape.hidden), None),
    }


def _cases(shape: Shape, b: int, query_len: int, context: int, dtype: torch.dtype, device: str):
    """{op: (call(fn), K/V bytes read or None)} with inputs for b sequences of `context` tokens."""
    n = b * query_len
    hq, hk, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    blocks = -(-context // BLOCK_SIZE)
    x = torch.randn(n, shape.hidden, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    weight = torch.randn(shape.hidden, device=device).to(dtype)
    gate_up = torch.randn(n, 2 * shape.intermediate, dtype=dtype, device=device)
    qkv = torch.randn(n, (hq + 2 * hk) * d, dtype=dtype, device=device)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(n, hq, d), k.view(n, hk, d), v.view(n, hk, d)
    cos, sin = torch.rand(n, d, device=device), torch.rand(n, d, device=device)
    k_cache = torch.randn(b * blocks * BLOCK_SIZE, hk, d, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.randperm(b * blocks, device=device).view(b, blocks).to(torch.int32)
    seq_lens = torch.full((b,), context, dtype=torch.int32, device=device)
    pos = torch.arange(context - query_len, context, device=device).repeat(b)
    slots = (block_table.long().repeat_interleave(query_len, 0).gather(1, (pos // BLOCK_SIZE)[:, None]))[:, 0]
    slots = slots * BLOCK_SIZE + pos % BLOCK_SIZE
    scale = d**-0.5
    kv_bytes = 2 * b * context * hk * d * k_cache.element_size()
    weights = _projections(shape, dtype, device)
    logits = torch.randn(n, weights["head_linear"][0].shape[0], dtype=dtype, device=device)
    projections = {}
    for op, (w, bias) in weights.items():
        inp = torch.randn(n, w.shape[1], dtype=dtype, device=device)
        projections[op] = (lambda f, inp=inp, w=w, bias=bias: f(inp, w, bias), None)
    return projections | {
        "top1": (lambda f: f(logits), None),
        "add_rms_norm": (lambda f: f(x, residual, weight, 1e-6), None),
        "silu_mul": (lambda f: f(gate_up), None),
        "rope_write_kv": (lambda f: f(q, k, v, cos, sin, k_cache, v_cache, slots), None),
        "paged_attention": (
            lambda f: f(q, k_cache, v_cache, block_table, seq_lens, query_len, BLOCK_SIZE, scale),
            kv_bytes,
        ),
    }


OPS = {
    "qkv_linear": (fused_ops.linear, fused_ops.linear_twin),
    "o_linear": (fused_ops.linear, fused_ops.linear_twin),
    "gate_up_linear": (fused_ops.linear, fused_ops.linear_twin),
    "down_linear": (fused_ops.linear, fused_ops.linear_twin),
    "head_linear": (fused_ops.linear, fused_ops.linear_twin),
    "top1": (fused_ops.top1, fused_ops.top1_twin),
    "add_rms_norm": (fused_ops.add_rms_norm, fused_ops.add_rms_norm_twin),
    "silu_mul": (fused_ops.silu_mul, fused_ops.silu_mul_twin),
    "rope_write_kv": (fused_ops.rope_write_kv, fused_ops.rope_write_kv_twin),
    "paged_attention": (fused_ops.paged_attention, fused_ops.paged_attention_twin),
}


def _time_us(fn: Callable[[], object], cuda: bool) -> float:
    """Median microseconds per call: triton's do_bench on CUDA (L2 flushed between calls), else a
    wall-clock loop after a warm-up."""
    if cuda:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


def _graph_us(fn: Callable[[], object]) -> float:
    """Microseconds per call of fn captured GRAPH_CALLS times in one CUDA graph: no launch overhead."""
    import triton.testing

    graph, _ = capture_graph(lambda: [fn() for _ in range(GRAPH_CALLS)])
    return triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median") * 1e3 / GRAPH_CALLS


def _dispatch(model: str, shape: Shape, rows: list[int], dtype: torch.dtype, device: str) -> list[dict]:
    """The dispatch's timings (``fused_ops.TUNING_RECORD``) of each projection of the shape at each
    row count, as the engine makes them at its first such call."""
    out = []
    fused_ops.SKINNY_DISPATCH = True
    try:
        for op, (w, bias) in _projections(shape, dtype, device).items():
            for n in rows:
                before = len(fused_ops.TUNING_RECORD)
                fused_ops.linear(torch.randn(n, w.shape[1], dtype=dtype, device=device), w, bias)
                out += [{"model": model, "op": op} | r for r in fused_ops.TUNING_RECORD[before:]]
    finally:
        fused_ops.SKINNY_DISPATCH = False
    return out


def main(argv: list[str] | None = None) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, twins only")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--query-lens", type=int, nargs="+", default=[1, 6])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument(
        "--skinny-configs",
        nargs="*",
        default=[],
        metavar="BN,BK,WARPS,STAGES",
        help="also time the projections at batch 1, query_len 1 with each of these kernel configs",
    )
    parser.add_argument(
        "--dispatch-rows",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1, 6, 16, 64],
        help="row counts at which the projection dispatch is timed (comma-separated; empty: none)",
    )
    args = parser.parse_args(argv)
    cuda = not args.dry_run
    if cuda and not (torch.cuda.is_available() and fused_ops.triton is not None):
        parser.error("needs CUDA and triton (or --dry-run)")
    torch.manual_seed(0)
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shapes = SHAPES if cuda else TINY
    batches, query_lens, context = args.batches, args.query_lens, args.context
    if not cuda:
        batches, query_lens, context = [1, 2], [1, 3], 40

    rows, dispatch = [], []
    for model, shape in shapes.items():
        for b in batches:
            for query_len in query_lens:
                for op, (call, kv_bytes) in _cases(shape, b, query_len, context, dtype, device).items():
                    kernel, twin = OPS[op]
                    kernel_us = graph_us = gbps = None
                    if cuda:
                        # the projections' kernel runs where batch invariance asks for it
                        fused_ops.BATCH_INVARIANT = op in PROJECTIONS
                        try:
                            kernel_us = _time_us(lambda c=call, f=kernel: c(f), cuda)
                            graph_us = _graph_us(lambda c=call, f=kernel: c(f))
                        finally:
                            fused_ops.BATCH_INVARIANT = False
                        gbps = kv_bytes / (graph_us * 1e3) if kv_bytes else None
                    twin_us = _time_us(lambda c=call, f=twin: c(f), cuda)
                    rows.append(Row(model, b, query_len, op, kernel_us, graph_us, twin_us, gbps))
        cases = _cases(shape, 1, 1, context, dtype, device)
        for config in args.skinny_configs if cuda else []:
            fused_ops.SKINNY_CONFIG = tuple(int(v) for v in config.split(","))
            fused_ops.BATCH_INVARIANT = True
            try:
                for op in PROJECTIONS:
                    call, kernel, twin = cases[op][0], *OPS[op]
                    graph_us = _graph_us(lambda c=call, f=kernel: c(f))
                    twin_us = _graph_us(lambda c=call, f=twin: c(f))
                    rows.append(Row(model, 1, 1, f"{op}[{config}]", None, graph_us, twin_us))
            finally:
                fused_ops.SKINNY_CONFIG, fused_ops.BATCH_INVARIANT = None, False
        if cuda:
            dispatch += _dispatch(model, shape, args.dispatch_rows, dtype, device)

    header = ("model", "b", "q", "op", "kernel us", "graph us", "twin us", "x", "KV GB/s")
    print("{:>6} {:>4} {:>2} {:<34} {:>10} {:>9} {:>10} {:>6} {:>8}".format(*header))
    for r in rows:
        kernel = f"{r.kernel_us:10.1f}" if r.kernel_us is not None else f"{'-':>10}"
        graph = f"{r.graph_us:9.2f}" if r.graph_us is not None else f"{'-':>9}"
        speedup = (
            f"{r.twin_us / (r.kernel_us or r.graph_us):6.2f}" if r.kernel_us or r.graph_us else f"{'-':>6}"
        )
        gbps = f"{r.kv_gbps:8.0f}" if r.kv_gbps is not None else f"{'-':>8}"
        where = f"{r.model:>6} {r.batch:>4} {r.query_len:>2} {r.op:<34}"
        print(f"{where} {kernel} {graph} {r.twin_us:10.1f} {speedup} {gbps}")
    if dispatch:
        print("\nprojection dispatch (us a call, graph replays over weight copies larger than L2)")
        print(
            "{:>6} {:<15} {:>4} {:>8} {:>8} {:<14} {}".format(
                "model", "op", "rows", "cublas", "skinny", "best config", "chosen"
            )
        )
        for d in dispatch:
            configs = {c: us for c, us in d["us"].items() if c != "cublas"}
            best = min(configs, key=configs.get) if configs else "-"
            skinny = f"{configs[best]:8.2f}" if configs else f"{'-':>8}"
            cublas = f"{d['us']['cublas']:8.2f}" if "cublas" in d["us"] else f"{'-':>8}"
            print(f"{d['model']:>6} {d['op']:<15} {d['rows']:>4} {cublas} {skinny} {best:<14} {d['chosen']}")
    record = {
        "environment": environment(),
        "device": torch.cuda.get_device_name() if cuda else "cpu (dry run)",
        "dtype": str(dtype),
        "context": context,
        "block_size": BLOCK_SIZE,
        "graph_calls": GRAPH_CALLS,
        "torch": torch.__version__,
        "triton": getattr(fused_ops.triton, "__version__", None),
        "rows": [asdict(r) for r in rows],
        "dispatch": dispatch,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
