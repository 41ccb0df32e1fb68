"""Shared by the benchmarks: environment record, tables, JSON results, timing a call."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dynaspec.provenance import git_commit


def environment() -> dict[str, Any]:
    from dynaspec.engine.profiler import cpu_name
    from dynaspec.models.kernels import kernel_march

    cpu = cpu_name()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu,
        "kernel_march": kernel_march(),  # the CPU the C++ kernels were built for (DYNASPEC_KERNEL_MARCH)
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "command": " ".join(sys.argv),
    }


def ms_per_call(fn: Callable[[], object], calls: int) -> float:
    """Milliseconds per call of fn over ``calls`` calls, after one warm-up call."""
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1000


def median_ms(fn: Callable[[], object], calls: int, warmup: int = 3) -> float:
    """The median milliseconds of ``calls`` timed calls of fn, after ``warmup`` untimed ones (a
    median, not a mean: one call preempted on a shared CPU does not move it)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def decoder_projections(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """Each decoder layer's four projections (q/k/v, o, gate/up, down) with their input widths:
    what the probes time alone, beside the decoder stack that runs them."""

    def width(mod) -> int:
        return width(mod.parts[0]) if hasattr(mod, "parts") else mod.in_features

    return [
        (mod, width(mod))
        for layer in model.model.layers
        for mod in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]


def command_args(args: argparse.Namespace) -> dict[str, Any]:
    """A benchmark's command-line arguments, as its JSON result records them."""
    return {k: v for k, v in vars(args).items() if k != "func"}


def save_plot(fig, path: str | Path, dpi: int = 110) -> None:
    """Write a matplotlib figure as a PNG with a 256-colour palette (a third of the RGBA file's size,
    the same look for line plots), then close it."""
    import io

    import matplotlib.pyplot as plt
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    buffer.seek(0)
    image = Image.open(buffer).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    image.save(path, format="PNG", optimize=True)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def write_result(path: str | None, data: dict[str, Any]) -> None:
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"environment": environment(), **data}, indent=2) + "\n")
    print(f"results written to {p}")


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


# policies that choose K themselves (not a fixed K); "ctx-blind" is per-request on the profile
# without its context axis (only where the profile has one), "cells-off" per-request without live
# grid cells (``CellCorrection``: the grid moved by the live drift alone), "stops-off" per-request
# without confidence stops (every draft the proposer makes is verified), "matches-off" per-request
# pricing an n-gram's rows by the request's acceptance, not by each row's match, "hold-on"
# per-request whose hysteresis holds its K at any gap (not only a near tie)
DYNAMIC_CONFIGS = ("goodput", "per-request", "ctx-blind", "cells-off", "stops-off", "matches-off", "hold-on")


def k_policies(fixed_ks: Sequence[int], profile, max_k: int, hysteresis_steps: int) -> dict[str, Any]:
    """The K policies benchmarks compare, by name, as factories (each run gets a fresh policy):
    ``K=<k>`` fixed; with a profile, ``table`` (its per-batch-size table), ``goodput`` (one K for
    the load, who drafts: the batch-level rule) and ``per-request`` (a K per request and confidence
    stops tuned online: the engine's default with a profile), ``cells-off`` (per-request without
    live grid cells), ``stops-off`` (per-request without confidence stops), ``matches-off``
    (per-request pricing an n-gram's rows by acceptance, not by their matches), ``hold-on``
    (per-request whose hysteresis holds its K at any gap, not only a near tie), and with a profile
    that has a context axis, ``ctx-blind`` (per-request without it)."""
    from dynaspec.kpolicy.goodput import GoodputK
    from dynaspec.kpolicy.policy import FixedK, TableK

    policies: dict[str, Any] = {f"K={k}": (lambda k=k: FixedK(k)) for k in fixed_ks}
    if profile is not None:
        table = profile.num_speculative_tokens_per_batch_size
        policies["table"] = lambda: TableK(table, max_k, hysteresis_steps)
        policies["goodput"] = lambda: GoodputK(
            profile, max_k, hysteresis_steps, per_request=False, min_confidence=0.0
        )
        policies["per-request"] = lambda: GoodputK(profile, max_k, hysteresis_steps, per_request=True)
        policies["cells-off"] = lambda: GoodputK(
            profile, max_k, hysteresis_steps, per_request=True, live_cells=False
        )
        policies["stops-off"] = lambda: GoodputK(
            profile, max_k, hysteresis_steps, per_request=True, min_confidence=0.0
        )
        policies["matches-off"] = lambda: GoodputK(
            profile, max_k, hysteresis_steps, per_request=True, price_matches=False
        )
        policies["hold-on"] = lambda: GoodputK(
            profile, max_k, hysteresis_steps, per_request=True, hold_within=1.0
        )
        if profile.context_tokens is not None and profile.context_stats:
            blind = without_context_axis(profile)
            policies["ctx-blind"] = lambda: GoodputK(blind, max_k, hysteresis_steps, per_request=True)
    return policies


def profile_path(flag: str | None, spec) -> str | None:
    """The profile a benchmark prices its policies with: ``--profile`` (a file, or "auto"), else the
    speculative config's own ``dynamic_config_path``; a file beside a config saying "auto" is refused."""
    from dynaspec.engine.engine import AUTO

    if flag and spec.dynamic_config_path == AUTO:
        raise ValueError('--profile: the speculative config already says "dynamic_config_path": "auto"')
    return flag or spec.dynamic_config_path


def without_context_axis(profile):
    """The profile as a context-blind policy reads it (every step priced at the grid's contexts)."""
    from dynaspec.kpolicy.profile import Profile

    return Profile(
        **{
            **profile.__dict__,
            "context_stats": {},
            "context_tokens": None,
            "context_cost": None,
            "context_cost_by_batch": None,
        }
    )


def free_port() -> int:
    """A loopback port no one listens on now (for a server a benchmark or test starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
