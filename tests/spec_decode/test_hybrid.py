"""A drafter (a draft model or an EAGLE head) with suffix drafts beside it
(``"enable_suffix_decoding": true``): the config, the goodput policy's choice of which rows take
their match, and lossless output on the tiny models."""

import pytest
from support.eagle import target_config, write_head
from support.engine import PROMPTS, make_engine, run_alone, run_staggered
from support.kpolicy import step_record

from dynaspec import SamplingParams
from dynaspec.engine.types import DraftCandidate
from dynaspec.kpolicy.config import SpeculativeConfig
from dynaspec.kpolicy.goodput import GoodputK
from dynaspec.kpolicy.profile import Profile


# ---- the config ----------------------------------------------------------------------------------
def test_suffix_options_apply_to_a_draft_model_that_enables_suffix_decoding():
    spec = SpeculativeConfig.parse(
        {
            "method": "draft_model",
            "model": "x",
            "num_speculative_tokens": 3,
            "enable_suffix_decoding": True,
            "suffix_decoding_min_token_prob": 0.2,
        }
    )
    assert spec.uses_suffix and spec.suffix.min_token_prob == 0.2 and spec.label == "draft_model+suffix"
    assert SpeculativeConfig.parse(spec.to_dict()) == spec


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_an_eagle_head_takes_suffix_decoding_too(method):
    spec = SpeculativeConfig.parse(
        {"method": method, "model": "x", "num_speculative_tokens": 3, "enable_suffix_decoding": True}
    )
    assert spec.uses_suffix and spec.label == f"{method}+suffix"


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_enable_suffix_decoding_names_the_field_beside_another_method(method):
    with pytest.raises(ValueError, match=r"^speculative_config\.enable_suffix_decoding: only applies"):
        SpeculativeConfig.parse(
            {"method": method, "num_speculative_tokens": 3, "enable_suffix_decoding": True}
        )


# ---- the policy: which rows take their match -----------------------------------------------------
# a CPU-like grid: a verified row costs 4 ms, a drafter pass ``pass_ms`` (dear by default)
def grid(bs: int, k: int, pass_ms: float = 30.0) -> float:
    return 40.0 + 4.0 * bs + k * (pass_ms + 4.0 * bs)


STATS = {bs: {k: grid(bs, k) for k in range(4)} for bs in (1, 2, 4, 8, 16)}
COST = {"target_ms": [40.0, 4.0, 4.0], "draft_pass_ms": [30.0, 0.0, 0.0]}


def policy(alpha=(0.8, 0.7, 0.6), pass_ms=30.0) -> GoodputK:
    stats = {bs: {k: grid(bs, k, pass_ms) for k in range(4)} for bs in STATS}
    cost = {"target_ms": [40.0, 4.0, 4.0], "draft_pass_ms": [pass_ms, 0.0, 0.0]}
    return GoodputK(Profile(3, list(alpha), stats, cost_model=cost), 3, hysteresis_steps=1)


def load(n: int, matches: dict[int, tuple[float, ...]]) -> list[DraftCandidate]:
    return [
        DraftCandidate(1, 100, request_id=f"r{i}", context_tokens=200, free_rates=matches.get(i, ()))
        for i in range(n)
    ]


def test_a_wide_batch_drafts_its_confident_matches_where_the_drafter_does_not_pay():
    rule = policy()
    assert rule.k_for_batch(16) == 0  # the drafter alone: 16 rows do not pay its passes
    k, drafts = rule.choose(load(16, {0: (1.0, 1.0, 1.0), 5: (1.0, 0.9), 9: (0.2,)}))
    assert rule.free_rows()[0] and rule.free_rows()[5]
    assert drafts[0] == 3 and drafts[5] == 2  # verified rows only: each accepted token pays
    assert drafts[9] == 0  # one unlikely token is not worth its verified row
    assert all(d == 0 for i, d in enumerate(drafts) if i not in (0, 5, 9))  # the drafter stays off
    assert k == 3


def test_one_request_keeps_the_drafter_where_its_match_expects_less():
    rule = policy(alpha=(0.95, 0.9, 0.85), pass_ms=5.0)  # a cheap drafter that is nearly always right
    _, drafts = rule.choose(load(1, {0: (0.3, 0.3)}))
    assert rule.free_rows() == [] and drafts == [3]  # the drafter's 3 tokens beat the weak match
    _, drafts = rule.choose(load(1, {0: (1.0, 1.0, 1.0)}))
    assert rule.free_rows() == [True] and drafts == [3]  # as many tokens, none of its passes


def test_a_free_token_costs_the_rows_cheapest_verified_token_where_its_cell_reads_none():
    """A grid whose K=1 cell at 2 requests came out cheaper than a plain step and a drafter pass
    (the xeon pair profile's did): its verified share reads 0 a token, so the free token takes the
    cheapest verified token of the row's other cells, here K=2's."""
    stats = {bs: {k: grid(bs, k) for k in range(4)} for bs in STATS}
    stats[2][1] = stats[2][0] + 20.0  # less than one 30 ms drafter pass
    rule = GoodputK(Profile(3, [0.8, 0.7, 0.6], stats, cost_model=COST), 3, hysteresis_steps=1)
    one_pass = rule.drafted_cost(2, (1,))  # a drafter layer of one row: its pass (the cell's share is 0)
    cheapest = (rule.itl(2, 2) - rule.itl(2, 0) - 2 * one_pass) / 4  # K=2 over 2 rows: 4 tokens
    assert cheapest > 0 and rule.drafted_cost(2, (), 2) == pytest.approx(2 * cheapest)


def test_matched_rows_teach_their_calibration_and_not_the_drafters_acceptance():
    rule = policy()
    before = rule.acceptance.rates()
    record = step_record([3, 3], [0, 3])
    record.plan.free_rows = [True, False]
    record.draft_confidence = [[1.0, 1.0, 1.0], [0.9, 0.9, 0.9]]
    for _ in range(20):
        rule.observe(record)
    # the matched row, rejected at its first token, lowers its bin; the drafter accepted all of its
    assert rule.match_calibration.rate(9) < 0.3
    assert rule.acceptance.rates()[0] > before[0]
    assert rule.snapshot()["match_acceptance_by_frequency"][0][9] < 0.3


# ---- the engine on the tiny models ----------------------------------------------------------------
SIBLINGS = [PROMPTS[0]] * 3 + [PROMPTS[3]] + [PROMPTS[0]]  # n samples of one prompt, and strays


class HalfFree:
    """Every decode drafts K; those with a match take it on alternate rows and steps (or always)."""

    def __init__(self, k: int, always: bool = False) -> None:
        self.k, self.steps, self._free, self.always = k, 0, [], always
        self.sources: list[tuple[bool, int]] = []  # (took its match, drafts verified) per row
        self.matched_rows: list[int] = []  # per step: rows that drafted their match

    def choose(self, candidates):
        self.steps += 1
        self._free = [
            bool(c.free_rates) and (self.always or (i + self.steps) % 2 == 0)
            for i, c in enumerate(candidates)
        ]
        drafts = [self.k if c.decoding else 0 for c in candidates]
        return max(drafts, default=0), drafts

    def free_rows(self):
        return self._free

    def min_draft_confidence(self):
        return 0.0

    def observe(self, record):
        free = record.plan.free_rows or [False] * record.plan.num_decodes
        self.sources += list(zip(free, record.result.draft_lens))
        self.matched_rows.append(sum(f and n > 0 for f, n in zip(free, record.result.draft_lens)))

    def snapshot(self):
        return {"policy": "half-free"}


def hybrid_engine(target_dir, k, **kw):
    """The target drafts for itself (its drafts are kept), with suffix matches beside it."""
    spec = {
        "method": "draft_model",
        "model": str(target_dir),
        "num_speculative_tokens": k,
        "enable_suffix_decoding": True,
    }
    return make_engine(target_dir, speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def plain(target_dir):
    return run_alone(target_dir, PROMPTS)


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_with_matches_and_drafts_in_one_step_equals_plain(target_dir, plain, k):
    engine = hybrid_engine(target_dir, k)
    rule = HalfFree(k)
    engine.set_k_policy(rule)
    outs = run_staggered(engine, SIBLINGS + PROMPTS, arrive_every=2)
    assert outs == [plain[0]] * 3 + [plain[3], plain[0]] + plain
    assert any(f and n for f, n in rule.sources) and any(not f and n for f, n in rule.sources)
    sources = engine.stats()["spec"]["proposer"]["sources"]
    assert sources["suffix"]["accepted"] > 0 and sources["model"]["accepted"] > 0
    assert engine.stats()["spec"]["proposer"]["suffix"]["cached_requests"] > 0
    assert engine.allocator.usage == 0.0


SAMPLED = [
    SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=s, ignore_eos=True)
    for s in (11, 11, 12, 13, 11)
]


def test_seeded_sampled_with_matches_and_drafts_equals_plain_sampled(target_dir):
    plain = [run_alone(target_dir, [p], params)[0] for p, params in zip(SIBLINGS, SAMPLED)]
    engine = hybrid_engine(target_dir, 3)
    rule = HalfFree(3)
    engine.set_k_policy(rule)
    requests = []
    for step in range(1000):
        if step % 2 == 0 and len(requests) < len(SIBLINGS):
            requests.append(engine.add_request(SIBLINGS[len(requests)], SAMPLED[len(requests)]))
        if not engine.has_unfinished() and len(requests) == len(SIBLINGS):
            break
        engine.step()
    assert [r.output_token_ids for r in requests] == plain
    assert any(f and n for f, n in rule.sources) and any(not f and n for f, n in rule.sources)


def test_goodput_takes_matches_on_the_tiny_pair_and_stays_lossless(tmp_path, target_dir, draft_dir, plain):
    from dynaspec.kpolicy.profile import save_profile

    save_profile(Profile(3, [0.8, 0.7, 0.6], STATS, cost_model=COST), tmp_path / "p.json")
    spec = {
        "method": "draft_model",
        "model": str(draft_dir),
        "num_speculative_tokens": 3,
        "enable_suffix_decoding": True,
        "dynamic_config_path": str(tmp_path / "p.json"),
    }
    engine = make_engine(target_dir, speculative_config=spec)
    first = run_staggered(engine, SIBLINGS, arrive_every=100)  # one at a time: the cache fills
    again = run_staggered(engine, SIBLINGS, arrive_every=1)  # a second epoch, all at once
    assert first == again == [plain[0]] * 3 + [plain[3], plain[0]]
    sources = engine.stats()["spec"]["proposer"]["sources"]
    assert sources["suffix"]["rows"] > 0 and sources["suffix"]["accepted"] > 0


def test_rows_drafting_their_match_owe_the_drafter_no_catch_up(target_dir, plain):
    """A step's catch-up room (the target's token budget) holds back drafter rows that have not
    read their prompts, but not rows that draft their match: the drafter has read nothing of any
    of the second epoch's requests, and they all draft in one step."""
    engine = hybrid_engine(target_dir, 3, max_num_batched_tokens=24)
    rule = HalfFree(3, always=True)
    engine.set_k_policy(rule)
    assert run_staggered(engine, SIBLINGS[:3], arrive_every=100) == [plain[0]] * 3  # the cache fills
    rule.matched_rows.clear()
    assert run_staggered(engine, SIBLINGS[:3], arrive_every=1) == [plain[0]] * 3
    assert max(rule.matched_rows) == 3


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_an_eagle_head_with_matches_in_one_step_equals_plain(tmp_path, target_dir, plain, method):
    """Rows that draft their match still hand the head the target's states of what they accepted:
    the head catches up on them at the row's next head step, and every output is plain's."""
    head = write_head(tmp_path / method, method, target_config(target_dir), draft_vocab=150)
    spec = {"method": method, "model": str(head), "num_speculative_tokens": 3, "enable_suffix_decoding": True}
    engine = make_engine(target_dir, speculative_config=spec)
    rule = HalfFree(3)
    engine.set_k_policy(rule)
    assert (
        run_staggered(engine, SIBLINGS + PROMPTS, arrive_every=2)
        == [plain[0]] * 3 + [plain[3], plain[0]] + plain
    )
    sources = engine.stats()["spec"]["proposer"]["sources"]
    assert sources["suffix"]["accepted"] > 0 and sources["model"]["draft_tokens"] > 0
    assert engine.proposer.hidden_layers() == engine.proposer.model.hidden_layers() != ()
    engine.step()  # the last finished requests are released at the next schedule
    assert engine.proposer.model.states == {} and engine.allocator.usage == 0.0
