"""`dynaspec bench qmatmul`: ms per linear-layer forward against rows, for each QuantLinear path.

Speculative verification pushes batch x (K+1) rows through every layer, so what matters is the curve
of cost against rows, not the one-row figure. Weights are random valid GGUF blocks (default Q4_K,
the target's main type) of the target's real layer shapes, decoded by `gguf_blocks`; every path runs
the same weight (int4 only takes 4-bit types, int8 re-rounds, dense is bf16). Paths are interleaved
within every repeat and the median is reported; each sample loops enough calls to last about a
millisecond or more. Path "ggml" (when the optional `ggml-python` package is installed) multiplies
the same raw blocks with llama.cpp's own CPU kernels (a plain ggml context, float32 activations, the
threads given); "ggml-repack" first loads them into ggml's CPU_REPACK buffer type (the interleaved
layout llama.cpp itself uses for Q4_0/Q4_K/IQ4_NL on AVX-512).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import time

import numpy as np

from dynaspec.bench.common import command_args, format_table, save_plot, write_result

# (out, in) of the Qwen2.5-Coder-1.5B linear layers
SHAPES = {
    "qkv": (2048, 1536),
    "o": (1536, 1536),
    "gate_up": (17920, 1536),
    "down": (1536, 8960),
    "head": (151936, 1536),
}
FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
SAMPLE_S = 0.002  # a timing sample repeats the call to last at least this long
GGML_PATHS = ("ggml", "ggml-repack")
GGML_REPACK_FORMATS = ("Q4_0", "Q4_K")  # formats ggml-python 0.0.45's CPU_REPACK takes (others crash it)


def add_parser(sub) -> None:
    p = sub.add_parser("qmatmul", help="quantized linear layers: ms per forward vs rows, per path")
    p.add_argument(
        "--shapes", default="qkv,o,gate_up,down,head", help=f"comma-separated, of {', '.join(SHAPES)}"
    )
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    p.add_argument(
        "--paths",
        default="dense,int4,int8,vnni,ggml,ggml-repack",
        help="QuantLinear paths (dense = bf16 F.linear) and ggml, ggml-repack (skipped without ggml-python)",
    )
    p.add_argument("--format", default="Q4_K", choices=FORMATS, help="GGUF block type of the random weights")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--result-file",
        default="bench-results/qmatmul.json",
        help="JSON path (default %(default)s: out of the record under results/)",
    )
    p.add_argument(
        "--plot", default=None, help="PNG path for a plot of ms vs rows (e.g. bench-results/qmatmul.png)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from gguf import GGMLQuantizationType

    from dynaspec.models.gguf_blocks import decode_blocks, random_blocks
    from dynaspec.models.qlinear import INT4_GROUPS, PATHS, QuantLinear, kernel_error

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not shapes:
        raise ValueError(f"--shapes: unknown {unknown}; choose from {list(SHAPES)}")
    rows_list = [int(r) for r in args.rows.split(",") if r.strip()]
    if not rows_list or min(rows_list) < 1:
        raise ValueError("--rows: need comma-separated integers >= 1")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if any(p not in (*PATHS, *GGML_PATHS) for p in paths):
        raise ValueError(f"--paths: choose from {(*PATHS, *GGML_PATHS)}")
    if any(p in GGML_PATHS for p in paths) and _ggml_error() is not None:
        print(f"skipping {', '.join(GGML_PATHS)}: {_ggml_error()}")
        paths = [p for p in paths if p not in GGML_PATHS]
    if "vnni" in paths and kernel_error() is not None:
        print(f"skipping vnni: {kernel_error()}")
        paths.remove("vnni")
    qtype = GGMLQuantizationType[args.format]
    if args.repeats < 1:
        raise ValueError("--repeats: need >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    records, table = [], []
    for shape in shapes:
        n_out, n_in = SHAPES[shape]
        raw = random_blocks(qtype, (n_out, n_in), args.seed)
        weight = decode_blocks(raw, qtype, (n_out, n_in))
        takes = [p for p in paths if p != "int4" or (weight.bits == 4 and weight.group in INT4_GROUPS)]
        takes = [p for p in takes if p != "ggml-repack" or args.format in GGML_REPACK_FORMATS]
        layers = {
            p: _GgmlLayer(raw, qtype, (n_out, n_in), rows_list, args.threads, repack=p == "ggml-repack")
            if p in GGML_PATHS
            else QuantLinear(weight, path=p, dtype=torch.bfloat16)
            for p in takes
        }
        del weight, raw
        for rows in rows_list:
            x = torch.randn(rows, n_in).bfloat16()
            calls = {p: _calls_per_sample(layer, x) for p, layer in layers.items()}
            samples: dict[str, list[float]] = {p: [] for p in layers}
            with torch.inference_mode():
                for _ in range(args.repeats):
                    for p, layer in layers.items():
                        start = time.perf_counter()
                        for _ in range(calls[p]):
                            layer(x)
                        samples[p].append((time.perf_counter() - start) / calls[p])
            ms = {p: statistics.median(v) * 1e3 for p, v in samples.items()}
            table.append([shape, rows, *(f"{ms[p]:.3f}" if p in ms else None for p in paths)])
            records += [
                {"shape": shape, "out": n_out, "in": n_in, "rows": rows, "path": p, "ms": round(t, 4)}
                for p, t in ms.items()
            ]
        del layers
        print(f"{shape} ({n_out}x{n_in}) done", flush=True)
    print(f"ms per forward, median of {args.repeats}, {args.format} weights, {args.threads} threads")
    print(format_table(["shape", "rows", *(f"{p} ms" for p in paths)], table))
    write_result(
        args.result_file,
        {
            "benchmark": "qmatmul",
            "args": command_args(args),
            "kernel": kernel_error() or "built",
            "results": records,
        },
    )
    if args.plot:
        _plot(records, shapes, paths, args.plot)
    return 0


def _ggml_error() -> str | None:
    try:
        import ggml  # noqa: F401
    except (ImportError, OSError) as e:
        return f"ggml-python is not usable ({type(e).__name__}: {e})"
    return None


class _GgmlLayer:
    """llama.cpp's CPU matmul on the raw GGUF blocks: one ggml graph per row count, planned once;
    a call copies x into the graph's float32 input and computes it. `repack`: the weight lives in
    the CPU_REPACK buffer type, which re-lays supported types out for its interleaved kernels."""

    def __init__(
        self, raw: np.ndarray, qtype, shape: tuple[int, int], rows_list: list[int], threads: int, repack: bool
    ) -> None:
        import ggml

        self._ggml = ggml
        n_out, n_in = shape
        raw = np.ascontiguousarray(raw)
        per_graph = ggml.ggml_graph_overhead() + (1 << 20)
        mem = sum(r * (n_in + n_out) * 4 for r in rows_list) + len(rows_list) * per_graph + (16 << 20)
        self._weight_ctx = self._buffer = None
        if repack:  # a tensor of its own in a CPU_REPACK buffer; setting its data re-lays it out
            self._weight_ctx = ggml.ggml_init(
                ggml.ggml_init_params(
                    mem_size=ggml.ggml_tensor_overhead() * 4, mem_buffer=None, no_alloc=True
                )
            )
            weight = ggml.ggml_new_tensor_2d(self._weight_ctx, int(qtype), n_in, n_out)
            self._buffer = ggml.ggml_backend_alloc_ctx_tensors_from_buft(
                self._weight_ctx, _ggml_repack_buffer_type(ggml)
            )
            ggml.ggml_backend_tensor_set(weight, raw.ctypes.data, 0, raw.nbytes)
        else:
            mem += raw.nbytes
        self._ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=False))
        if not repack:
            weight = ggml.ggml_new_tensor_2d(self._ctx, int(qtype), n_in, n_out)
            ctypes.memmove(ggml.ggml_get_data(weight), raw.ctypes.data, raw.nbytes)
        self._graphs = {}
        for rows in rows_list:
            x = ggml.ggml_new_tensor_2d(self._ctx, ggml.GGML_TYPE_F32, n_in, rows)
            graph = ggml.ggml_new_graph(self._ctx)
            ggml.ggml_build_forward_expand(graph, ggml.ggml_mul_mat(self._ctx, weight, x))
            plan = ggml.ggml_graph_plan(graph, threads, None)
            work = np.empty(max(plan.work_size, 1), dtype=np.uint8)  # kept alive with the plan
            plan.work_data = work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            data = ctypes.cast(ggml.ggml_get_data(x), ctypes.POINTER(ctypes.c_float))
            self._graphs[rows] = (graph, plan, work, np.ctypeslib.as_array(data, shape=(rows, n_in)))

    def __call__(self, x) -> None:  # x [rows, in]; the result stays in the graph
        graph, plan, _, x_in = self._graphs[x.shape[0]]
        x_in[...] = x.float().numpy()
        self._ggml.ggml_graph_compute(graph, ctypes.byref(plan))

    def __del__(self) -> None:
        self._ggml.ggml_free(self._ctx)
        if self._buffer is not None:
            self._ggml.ggml_backend_buffer_free(self._buffer)
            self._ggml.ggml_free(self._weight_ctx)


def _ggml_repack_buffer_type(ggml) -> int:
    """The CPU backend's CPU_REPACK buffer type, found through its extra-buffer-types hook."""
    reg = ggml.ggml_backend_cpu_reg()
    address = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    get_extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)
    types = get_extra(ggml.ggml_backend_reg_dev_get(reg, 0))
    found = []
    while types[len(found)]:
        found.append(types[len(found)])
    for buft in found:
        if ggml.ggml_backend_buft_name(buft) == b"CPU_REPACK":
            return buft
    raise ValueError(
        f"ggml has no CPU_REPACK buffer type (has {[ggml.ggml_backend_buft_name(b) for b in found]})"
    )


def _calls_per_sample(layer, x) -> int:
    """Warm the layer up and pick how many calls one timing sample makes."""
    import torch

    with torch.inference_mode():
        layer(x)
        start = time.perf_counter()
        layer(x)
        once = time.perf_counter() - start
    return max(1, math.ceil(SAMPLE_S / max(once, 1e-6)))


def _plot(records: list[dict], shapes: list[str], paths: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for p in paths:
            pts = [(r["rows"], r["ms"]) for r in records if r["shape"] == shape and r["path"] == p]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=p)
        first = next(r for r in records if r["shape"] == shape)
        ax.set(title=f"{shape} {first['out']}x{first['in']}", xlabel="rows", xscale="log", yscale="log")
        ticks = sorted({r["rows"] for r in records})
        ax.set_xticks(ticks, [str(r) for r in ticks])
    axes[0][0].set_ylabel("ms per forward (median)")
    axes[0][0].legend()
    fig.tight_layout()
    save_plot(fig, path)
    print(f"plot written to {path}")
