"""Synthetic acceptance: drafts accepted at given per-position rates whatever their tokens."""

from __future__ import annotations

import json
import math

import pytest
import torch
from support.sampling import sampling_rows

from dynaspec.engine.types import Drafts
from dynaspec.kpolicy.config import SpeculativeConfig
from dynaspec.spec_decode.rejection import verify
from dynaspec.spec_decode.synthetic import SyntheticAcceptance, synthetic_emitted

ROWS = 20000
EAGLE_LIKE = [0.80, 0.57, 0.41, 0.30, 0.22]


def _measured(synthetic: SyntheticAcceptance, k: int) -> list[float]:
    """α_i measured over ROWS drafts of k tokens: the fraction whose token i was accepted."""
    accepted = synthetic.accepted([k] * ROWS)
    return [sum(a >= i for a in accepted) / ROWS for i in range(1, k + 1)]


def _within_binomial(measured: list[float], expected: list[float]) -> None:
    for i, (got, alpha) in enumerate(zip(measured, expected, strict=True), start=1):
        sigma = math.sqrt(alpha * (1 - alpha) / ROWS)
        assert abs(got - alpha) <= 4.5 * sigma + 1e-12, f"alpha_{i}: measured {got:.4f}, expected {alpha:.4f}"


def test_per_position_rates_are_produced():
    _within_binomial(_measured(SyntheticAcceptance(EAGLE_LIKE, seed=0), 5), EAGLE_LIKE)


def test_one_number_means_powers():
    synthetic = SyntheticAcceptance(0.7, seed=1)
    expected = [0.7**i for i in range(1, 7)]
    assert [synthetic.rate(i) for i in range(1, 7)] == pytest.approx(expected)
    _within_binomial(_measured(synthetic, 6), expected)


def test_positions_beyond_the_rates_repeat_the_last_ratio():
    synthetic = SyntheticAcceptance([0.9, 0.6], seed=2)
    expected = [0.9, 0.6, 0.6 * (0.6 / 0.9), 0.6 * (0.6 / 0.9) ** 2]
    _within_binomial(_measured(synthetic, 4), expected)


def test_fewer_drafts_and_seeds():
    a = SyntheticAcceptance(EAGLE_LIKE, seed=3)
    lens = [0, 1, 3, 5, 2] * 100
    out = a.accepted(lens)
    assert all(0 <= got <= n for got, n in zip(out, lens, strict=True))
    assert out == SyntheticAcceptance(EAGLE_LIKE, seed=3).accepted(lens)
    assert SyntheticAcceptance(1.0).accepted([4, 2]) == [4, 2]


def test_emitted_tokens():
    assert synthetic_emitted([5, 6, 7], 2, 9) == [5, 6, 9]
    assert synthetic_emitted([5, 6, 7], 0, 9) == [9]
    assert synthetic_emitted([5, 6, 7], 3, 9) == [5, 6, 7, 9]


def test_verify_accepts_by_the_rates_and_emits_the_target_token():
    """Drafts the target would reject are accepted anyway; the token after them is the target's at
    that window position (argmax when greedy; a sample from p, here top-k 1, when sampled)."""
    k, vocab, rows = 3, 11, 400
    torch.manual_seed(0)
    logits = torch.randn(rows + 1, k + 1, vocab)  # one prefill row after the decodes
    drafts = torch.randint(0, vocab, (rows, k))
    synthetic = SyntheticAcceptance([0.9, 0.6, 0.3], seed=0)
    expected_accepted = SyntheticAcceptance([0.9, 0.6, 0.3], seed=0).accepted([k] * rows + [0])
    temperatures = [0.0 if b % 2 else 1.0 for b in range(rows + 1)]
    result = verify(
        logits, Drafts(drafts, [k] * rows), sampling_rows(temperatures, top_k=1), synthetic=synthetic
    )
    assert result.num_accepted == expected_accepted[:rows]
    argmax = logits.argmax(-1)
    for b, emitted in enumerate(result.token_ids):
        a = expected_accepted[b]
        prefix = drafts[b, :a].tolist() if b < rows else []
        assert emitted == [*prefix, int(argmax[b, a])]
    measured = [sum(a >= i for a in result.num_accepted) / rows for i in (1, 2, 3)]
    assert measured == pytest.approx([0.9, 0.6, 0.3], abs=0.1)


def test_verify_sampled_rows_draw_from_p():
    k, vocab, rows = 2, 5, 4000
    logits = torch.zeros(rows, k + 1, vocab)
    logits[:, :, 3] = 2.0  # p(3) = e^2 / (e^2 + 4)
    drafts = torch.zeros(rows, k, dtype=torch.long)
    result = verify(logits, Drafts(drafts, [k] * rows), sampling_rows([1.0] * rows), SyntheticAcceptance(0.5))
    last = torch.tensor([t[-1] for t in result.token_ids])
    p3 = math.exp(2) / (math.exp(2) + 4)
    assert float((last == 3).float().mean()) == pytest.approx(p3, abs=4.5 * math.sqrt(p3 * (1 - p3) / rows))


@pytest.mark.parametrize(
    ("rates", "message"),
    [
        ([0.5, 0.7], "must not increase"),
        ([], "non-empty"),
        (0.0, "in \\(0, 1\\]"),
        ([0.9, 1.5], "in \\(0, 1\\]"),
        ("high", "valid number"),
    ],
)
def test_config_errors_name_the_field(rates, message):
    d = {"method": "ngram", "num_speculative_tokens": 3, "synthetic_acceptance_rate": rates}
    with pytest.raises(ValueError, match=f"speculative_config.synthetic_acceptance_rate: .*{message}"):
        SpeculativeConfig.parse(d)


def test_config_forms():
    d = {"method": "ngram", "num_speculative_tokens": 3}
    assert SpeculativeConfig.parse({**d, "synthetic_acceptance_rate": 0.7}).synthetic_acceptance_rate == 0.7
    spec = SpeculativeConfig.parse(json.dumps({**d, "synthetic_acceptance_rate": EAGLE_LIKE}))
    assert spec.synthetic_acceptance_rate == tuple(EAGLE_LIKE)
    assert spec.to_dict()["synthetic_acceptance_rate"] == EAGLE_LIKE
    assert SpeculativeConfig.parse(spec.to_dict()) == spec


def test_serve_refuses_it(target_dir):
    from dynaspec.cli import build_parser
    from dynaspec.cli.serve import build_server

    spec = {"method": "ngram", "num_speculative_tokens": 3, "synthetic_acceptance_rate": 0.8}
    args = build_parser().parse_args(
        ["serve", "--model", str(target_dir), "--speculative-config", json.dumps(spec)]
    )
    with pytest.raises(ValueError, match="speculative_config.synthetic_acceptance_rate: serve refuses it"):
        build_server(args)


def test_engine_reports_the_synthetic_rates(target_dir, draft_dir, caplog):
    """generate (through the engine) takes it with a warning, and its statistics show the rates."""
    from dynaspec.engine.engine import Engine, EngineConfig
    from dynaspec.sampling_params import SamplingParams

    rates = [0.9, 0.7, 0.5]
    spec = {
        "method": "draft_model",
        "model": str(draft_dir),
        "num_speculative_tokens": 3,
        "synthetic_acceptance_rate": rates,
    }
    with caplog.at_level("WARNING"):
        engine = Engine(
            EngineConfig(
                model=str(target_dir), dtype="float32", device="cpu", speculative_config=spec, progress=False
            )
        )
    assert "synthetic_acceptance_rate" in caplog.text
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"def f{i}(x):", params)
    while engine.has_unfinished():
        engine.step()
    spec_stats = engine.stats()["spec"]
    assert spec_stats["num_drafts"] > 200
    assert spec_stats["acceptance_rate_per_pos"] == pytest.approx(rates, abs=0.1)
