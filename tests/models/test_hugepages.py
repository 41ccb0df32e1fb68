"""Weights moved into one mapping advised for 2 MiB pages (`dynaspec.models.hugepages`): the same
bits, the same sharing between views, tensors left where moving them would copy far more than they
hold, and the places where it does not apply."""

from __future__ import annotations

import logging

import pytest
import torch
from support.tiny import make_tiny_gguf, make_tiny_model_dir
from torch import nn

from dynaspec.engine.kv_cache import allocate_kv_cache
from dynaspec.models import hugepages
from dynaspec.models.attention import build_attention_metadata
from dynaspec.models.loader import load_model, resolve_model

CPU = torch.device("cpu")
HERE = hugepages.unavailable(CPU)  # None where huge pages can be asked for
needs_thp = pytest.mark.skipif(HERE is not None, reason=f"no huge pages here: {HERE}")
pytestmark = pytest.mark.usefixtures("private_cache")


def _inside(t: torch.Tensor, placement: hugepages.Placement) -> bool:
    lo = placement.arena.data_ptr()
    return lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= lo + placement.arena.numel()


def _logits(model, ids: list[int]) -> torch.Tensor:
    kv = allocate_kv_cache(model.config, 64, torch.float32, CPU)
    meta = build_attention_metadata([len(ids)], [len(ids)], [[0, 1, 2, 3]], 16, CPU)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), kv, meta))


@needs_thp
def test_a_loaded_model_s_weights_move_and_compute_the_same_bits(tmp_path, monkeypatch):
    hf_dir = make_tiny_model_dir(tmp_path / "m", arch="qwen2", seed=3)
    gguf = tmp_path / "m.gguf"
    make_tiny_gguf(hf_dir, gguf, {"embed_tokens.weight": "Q8_0", "lm_head.weight": "Q8_0"})
    source = resolve_model(str(gguf), progress=False)
    monkeypatch.setenv(hugepages.OPT_OUT, "0")
    plain = load_model(source, "auto", torch.float32, CPU)
    assert plain.huge_pages is None
    monkeypatch.delenv(hugepages.OPT_OUT)
    monkeypatch.setattr(hugepages, "MIN_BYTES", 1)  # the tiny model's tensors are all small
    placed = load_model(source, "auto", torch.float32, CPU)
    p = placed.huge_pages
    tensors = [*placed.parameters(), *placed.buffers()]
    assert p is not None and p.tensors == len({id(t) for t in tensors if t.nbytes > 0})
    assert all(_inside(t, p) for t in tensors if t.nbytes > 0)
    ids = list(range(3, 40))
    assert torch.equal(_logits(placed, ids), _logits(plain, ids))
    assert p.huge_bytes is not None  # /proc/self/smaps names the mapping


@needs_thp
def test_views_move_together_and_large_tensors_sit_in_huge_pages(caplog):
    base = torch.randn(2, 1 << 20)  # 8 MiB: the mapping spans whole 2 MiB pages
    module = nn.Module()
    module.register_buffer("a", base[0])
    module.register_buffer("b", base[1])
    module.weight = nn.Parameter(torch.randn(1024, 1024), requires_grad=False)  # 4 MiB
    before = {name: t.clone() for name, t in [*module.named_buffers(), *module.named_parameters()]}
    with caplog.at_level(logging.INFO, logger=hugepages.__name__):
        p = hugepages.place_on_huge_pages([module], CPU)
    assert p is not None and p.tensors == 3
    assert "3 weight tensors (0.01 GB) moved to a mapping advised huge pages" in caplog.text
    assert module.a.untyped_storage().data_ptr() == module.b.untyped_storage().data_ptr()
    assert module.b.data_ptr() - module.a.data_ptr() == (1 << 20) * 4  # still one after the other
    for name, t in [*module.named_buffers(), *module.named_parameters()]:
        assert _inside(t, p) and torch.equal(t, before[name]), name
    if not p.huge_bytes:
        pytest.skip("the kernel backed the mapping with no huge page (memory fragmented?)")
    assert p.huge_bytes % hugepages.HUGE_PAGE == 0 and p.huge_bytes <= p.bytes + hugepages.HUGE_PAGE
    # moved again (the A/B probe's 4 KiB control): the same values, no huge page in the new mapping
    q = hugepages.place_on_huge_pages([module], CPU, huge=False)
    assert q is not None and q.huge_bytes == 0 and all(_inside(t, q) for t in (module.a, module.b))
    assert torch.equal(module.weight, before["weight"])


@needs_thp
def test_views_copy_what_they_cover_and_sparse_ones_stay():
    big = torch.randn(1 << 22)  # 16 MiB
    module = nn.Module()
    module.register_buffer("head", big[: 1 << 18])  # its first MiB
    p = hugepages.place_on_huge_pages([module], CPU)
    assert p is not None and p.bytes == 1 << 20 and torch.equal(module.head, big[: 1 << 18])
    # two MiB at both ends of 16: moving them would copy the 14 between
    module.register_buffer("head", big[: 1 << 18])
    module.register_buffer("tail", big[-(1 << 18) :])
    assert hugepages.place_on_huge_pages([module], CPU) is None
    assert module.head.data_ptr() == big.data_ptr()


@needs_thp
def test_a_full_arena_leaves_what_does_not_fit_where_it_is(caplog):
    module = nn.Module()
    module.register_buffer("a", torch.randn(1 << 18))  # 1 MiB each
    module.register_buffer("b", torch.randn(1 << 18))
    b_at, b = module.b.data_ptr(), module.b.clone()
    arena = hugepages.Arena(1 << 20)
    with caplog.at_level(logging.WARNING, logger=hugepages.__name__):
        assert arena.place([module]) == 1
    assert "weight arena full: 1048576 bytes stay" in caplog.text
    assert module.b.data_ptr() == b_at and torch.equal(module.b, b)
    p = arena.finish()
    assert p.tensors == 1 and p.bytes == 1 << 20 and _inside(module.a, p)
    assert arena.place([module]) == 0  # a is there already; b still does not fit


def test_where_it_does_not_apply(monkeypatch):
    assert hugepages.unavailable(torch.device("cuda")) == "the weights are on cuda"
    monkeypatch.setenv(hugepages.OPT_OUT, "0")
    assert hugepages.unavailable(CPU) == f"{hugepages.OPT_OUT}=0"
    module = nn.Linear(1024, 1024)
    assert hugepages.place_on_huge_pages([module], CPU) is None
