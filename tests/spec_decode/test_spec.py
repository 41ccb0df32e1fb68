"""Speculative decoding is lossless: greedy output equals plain greedy output token for token."""

import pytest
from support.engine import PROMPTS, make_engine, run_alone, run_staggered
from support.kpolicy import RaggedK

from dynaspec import SamplingParams


@pytest.fixture(scope="module")
def plain(target_dir):
    return run_alone(target_dir, PROMPTS)


def spec_engine(target_dir, spec, **kw):
    return make_engine(target_dir, speculative_config=spec, **kw)


@pytest.mark.parametrize("k", range(1, 8))
def test_draft_model_greedy_equals_plain(target_dir, draft_dir, plain, k):
    engine = spec_engine(
        target_dir, {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k}
    )
    assert run_staggered(engine, PROMPTS, arrive_every=2) == plain
    stats = engine.stats()["spec"]
    assert stats["num_draft_tokens"] > 0
    assert engine.allocator.usage == 0.0


@pytest.mark.parametrize("k", range(1, 8))
def test_ngram_greedy_equals_plain(target_dir, plain, k):
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    engine = spec_engine(target_dir, spec)
    assert run_staggered(engine, PROMPTS, arrive_every=2) == plain
    assert engine.stats()["spec"]["num_draft_tokens"] > 0


def test_per_batch_size_table_equals_plain_and_k_follows_batch_size(target_dir, draft_dir, plain):
    spec = {
        "method": "draft_model",
        "model": str(draft_dir),
        "num_speculative_tokens": 5,
        "num_speculative_tokens_per_batch_size": [[1, 1, 5], [2, 3, 2], [4, 8, 0]],
        "hysteresis_steps": 1,
    }
    engine = spec_engine(target_dir, spec)
    assert run_staggered(engine, PROMPTS, arrive_every=1) == plain
    steps = engine.stats()["spec"]["steps_by_batch_size"]
    assert set(steps.get("1", {})) <= {"5"} and set(steps.get("2", {})) <= {"2"}
    assert set(steps.get("4", {})) | set(steps.get("5", {})) <= {"0"}
    assert "5" in steps["1"] and "0" in steps["5"]


def test_draft_equal_to_target_accepts_almost_everything(target_dir):
    k = 4
    spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": k}
    engine = spec_engine(target_dir, spec | {"draft_quantization": "auto"})  # the target's own weights
    # 1 token from prefill + 20 steps of k + 1: no step is cut short by max_tokens
    params = SamplingParams(max_tokens=1 + 20 * (k + 1), temperature=0.0, ignore_eos=True)
    run_staggered(engine, PROMPTS, params, arrive_every=1)
    stats = engine.stats()["spec"]
    assert stats["acceptance_length"] >= 0.97 * (k + 1)
    assert stats["acceptance_rate"] >= 0.97


def test_k0_runs_no_drafter(target_dir, draft_dir, plain):
    spec = {
        "method": "draft_model",
        "model": str(draft_dir),
        "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": [[1, 256, 0]],
    }
    engine = spec_engine(target_dir, spec)
    with engine.recording() as run:
        assert run_staggered(engine, PROMPTS, arrive_every=2) == plain
    assert run.timings and all(t.draft_passes == [] for t in run.timings)  # the drafter never ran
    # each step timed whole (the goodput policy's live grid cells learn from it), passes inside it
    assert all(t.step_ms >= t.target_ms > 0 for t in run.timings)
    assert engine.stats()["spec"]["num_draft_tokens"] == 0


@pytest.fixture(scope="module")
def plain_sampled(target_dir):
    """Plain sampled decoding of PROMPTS[:3], each prompt alone (seed 7, top-p 0.95)."""
    return run_alone(target_dir, PROMPTS[:3], SEEDED)


SEEDED = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)


@pytest.mark.parametrize("k", [1, 5])
def test_draft_model_sampled_with_a_seed_equals_plain_sampled(target_dir, draft_dir, plain_sampled, k):
    """The drafter draws at the target's uniforms and verification keeps the target's own draws
    (rejection.py): a seeded sampled request emits plain decoding's tokens at any K, joining a
    running batch, with top-p, and drafts are kept."""
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k}
    engine = spec_engine(target_dir, spec)
    assert run_staggered(engine, PROMPTS[:3], SEEDED) == plain_sampled
    assert engine.stats()["spec"]["num_accepted_tokens"] > 0


def test_a_drafter_identical_to_the_target_has_its_sampled_drafts_kept(target_dir):
    """Drafter and target draw each position at the same uniform, so a drafter that is the target
    proposes the target's own draws (independent draws would be kept with sum p(x)^2 only)."""
    spec = {
        "method": "draft_model",
        "model": str(target_dir),
        "num_speculative_tokens": 4,
        "draft_quantization": "none",  # the target's own float32 weights (int4 by default on the CPU)
    }
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    engine = spec_engine(target_dir, spec)
    assert run_staggered(engine, PROMPTS[:3], params) == run_alone(target_dir, PROMPTS[:3], params)
    assert engine.stats()["spec"]["acceptance_rate"] > 0.95


@pytest.mark.parametrize("k", [1, 3, 6])
def test_ngram_sampled_with_a_seed_equals_plain_sampled(target_dir, k):
    """n-gram drafts take plain decoding's draws (rejection.py): a seeded sampled request emits the
    same tokens with speculation as without, even when it joins a running batch."""
    # a peaked temperature: the tiny random model's text repeats itself enough to keep some drafts
    params = SamplingParams(max_tokens=24, temperature=0.3, top_p=0.95, seed=11, ignore_eos=True)
    plain = run_alone(target_dir, PROMPTS, params)
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    engine = spec_engine(target_dir, spec)
    assert run_staggered(engine, PROMPTS, params, arrive_every=2) == plain
    stats = engine.stats()["spec"]
    assert stats["num_accepted_tokens"] > 0  # drafts were verified and some kept


def test_draft_with_another_tokenizer_is_refused(target_dir, tmp_path):
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(target_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="speculative_config.model: .*different tokenizer"):
        spec_engine(target_dir, {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2})


@pytest.mark.parametrize("catchup_ms", [0.0, 1e6])
def test_goodput_withholds_drafts_whose_catchup_cannot_pay(
    tmp_path, target_dir, draft_dir, plain, catchup_ms
):
    """A profile where K = 3 is far cheaper than K = 0 wants K = 3 whatever the live costs once the
    drafter is caught up; the catch-up price decides whether new requests get drafts at all.
    Either way the output is the plain one."""
    from dynaspec.kpolicy.profile import Profile, save_profile

    stats = {bs: {0: 100.0, 1: 10.0, 2: 10.0, 3: 10.0} for bs in (1, 8)}
    profile = Profile(
        3,
        [1.0, 1.0, 1.0],
        stats,
        cost_model={"target_ms": [1.0, 0.0, 0.0], "draft_pass_ms": [0.01, 0.0, catchup_ms]},
    )
    save_profile(profile, tmp_path / "p.json")
    spec = {
        "method": "draft_model",
        "model": str(draft_dir),
        "num_speculative_tokens": 3,
        "dynamic_config_path": str(tmp_path / "p.json"),
        "per_request_k": False,  # the batch-level rule: only catch-up withholds a request
    }
    engine = spec_engine(target_dir, spec)
    with engine.recording() as run:
        assert run_staggered(engine, PROMPTS, arrive_every=2) == plain
    passes = [p for t in run.timings for p in t.draft_passes]  # every drafter pass of the run
    snapshot = engine.stats()["spec"]["policy"]
    if catchup_ms:  # prompts would cost 1e6 ms per token to catch up: no request ever drafts
        assert passes == [] and set(snapshot["k_by_batch_size"].values()) == {0}
    else:  # catching up is free: requests draft (until live acceptance and costs say otherwise)
        assert passes and snapshot["requests_withheld"] == 0
        assert snapshot["cost_model"]["observations"]["draft_passes"] == len(passes)


@pytest.mark.parametrize("min_confidence", [0.0, 0.2])
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_ragged_per_request_k_with_confidence_stops_equals_plain(
    target_dir, draft_dir, plain, method, min_confidence
):
    spec = {"method": method, "num_speculative_tokens": 5}
    spec |= {"model": str(draft_dir)} if method == "draft_model" else {"prompt_lookup_min": 1}
    engine = spec_engine(target_dir, spec)
    policy = RaggedK(min_confidence)
    engine.set_k_policy(policy)
    assert run_staggered(engine, PROMPTS, arrive_every=2) == plain
    ragged = [lens for lens in policy.draft_lens if len(set(lens)) > 1]
    assert ragged, "no step drafted different lengths for its decodes"
    drafted = sum(map(sum, policy.draft_lens))
    if method == "draft_model":  # a confidence stop cuts drafts short of their K; without one, none is
        asked = sum(map(sum, policy.k_caps))
        assert drafted < asked if min_confidence else drafted == asked
    # every verified draft token has a confidence (the n-gram's: its match's), none below the stop
    confidence = [c for step in policy.confidence if step for row in step for c in row]
    assert drafted and len(confidence) == drafted and min(confidence) >= min_confidence


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_per_request_goodput_with_auto_confidence_equals_plain(
    tmp_path, target_dir, draft_dir, plain, method
):
    from dynaspec.kpolicy.profile import Profile, save_profile

    stats = {bs: {k: 50.0 + 5 * bs + (2 + bs) * k for k in range(4)} for bs in (1, 2, 4, 8)}
    save_profile(Profile(3, [0.8, 0.6, 0.45], stats), tmp_path / "p.json")
    spec = {
        "method": method,
        "num_speculative_tokens": 3,
        "dynamic_config_path": str(tmp_path / "p.json"),
        "draft_confidence_threshold": "auto",
    }
    spec |= {"model": str(draft_dir)} if method == "draft_model" else {"prompt_lookup_min": 1}
    engine = spec_engine(target_dir, spec)
    assert run_staggered(engine, PROMPTS, arrive_every=2) == plain
    snapshot = engine.stats()["spec"]["policy"]
    assert snapshot["per_request"] and engine.stats()["spec"]["num_draft_tokens"] > 0
    assert 0.0 <= snapshot["min_draft_confidence"] <= 0.8
    # what the target accepted taught the confidence bins (the n-gram's tokens have one too)
    assert any(abs(r - (b + 0.5) / 10) > 1e-3 for b, r in enumerate(snapshot["acceptance_by_confidence"]))
    if method == "ngram":  # its rows were priced by their matches, whose tenths learnt the same
        learnt = snapshot["match_acceptance_by_frequency"]  # by position: first, second, later
        assert len(learnt) == 3 and any(abs(r - (b + 0.5) / 10) > 1e-3 for b, r in enumerate(learnt[0]))
    # the steps that were one cell of the grid taught it (issue 37): real steps, whole
    cells = snapshot["live_cells"]
    assert cells and all(int(bs) in stats and n >= 1 for bs, row in cells.items() for _, n in row.values())


def test_a_windowed_drafter_is_lossless_when_it_skips_what_it_missed(target_dir, draft_dir, plain):
    """A 3-token window (and 4 sink tokens) is shorter than most prompts; at 3 or more requests K is
    0, so requests build gaps the drafter later skips when the batch thins."""
    spec = {
        "method": "draft_model",
        "model": str(draft_dir),
        "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 256, 0]],
        "hysteresis_steps": 1,
        "draft_context_window": 3,
    }
    engine = spec_engine(target_dir, spec)
    shifts = []
    catchup = engine.proposer._catchup

    def spy(request):
        ids, shift = catchup(request)
        shifts.append(shift)
        return ids, shift

    engine.proposer._catchup = spy
    assert run_staggered(engine, PROMPTS, arrive_every=2) == plain
    assert engine.stats()["spec"]["num_draft_tokens"] > 0
    assert len(set(shifts)) >= 3  # skipped at least twice: new prompts, and gaps after K=0


def test_a_windowed_drafter_drafts_from_the_first_tokens_and_the_window(target_dir):
    """The target as its own drafter, window 6: every draft is the model's greedy continuation of
    what the drafter read (its first 4 tokens, then from the window's start on), through a first
    skip over the prompt and a second over output generated while K was 0, each token seeing the
    first 4 and the 6 before it (a reference engine with the same sliding window)."""
    from dynaspec.kpolicy.policy import FixedK
    from dynaspec.models.attention import SINK_TOKENS

    window = 6
    spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 2}
    engine = spec_engine(target_dir, spec | {"draft_context_window": window, "draft_quantization": "auto"})
    proposer = engine.proposer
    steps = []  # (context, tokens the drafter had read, drafts)
    propose = proposer.propose

    def spy(plan, sampling):
        if not plan.k:
            return propose(plan, sampling)
        r = plan.decodes[0]
        done = proposer.num_computed.get(r.request_id, 0)
        drafts = propose(plan, sampling)
        drafted = drafts.token_ids[0, : drafts.draft_lens[0]].tolist()
        steps.append((r.token_at(0, r.num_tokens), done, drafted))
        return drafts

    proposer.propose = spy
    prompt = "Hello, world! How are you today? I am fine, thank you. And you?"
    request = engine.add_request(prompt, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    for step in range(60):
        if not engine.has_unfinished():
            break
        engine.set_k_policy(FixedK(0 if 4 <= step < 16 else 2))  # a gap of 12 steps without drafting
        engine.step()
    assert not engine.has_unfinished() and len(request.output_token_ids) == 48

    reference = make_engine(target_dir)
    reference.runner.window = window
    read: list[int] = []  # positions of the context the drafter holds, in its cache's order
    skips = 0
    for context, done, drafts in steps:
        n = len(context)
        read = [p for p in read if p < done]  # and the drafts it was fed and the target accepted:
        read += range(read[-1] + 1 if read else 0, done)
        if n - window > max(done, SINK_TOKENS):
            skips += 1
            read += list(range(done, SINK_TOKENS)) + list(range(n - window, n))
        else:
            read += list(range(done, n))
        params = SamplingParams(max_tokens=len(drafts), temperature=0.0, ignore_eos=True)
        expected = reference.add_request([context[p] for p in read], params)
        while reference.has_unfinished():
            reference.step()
        assert drafts and drafts == expected.output_token_ids
    assert skips == 2


def _spy_drafts(engine, check):
    """Wrap the proposer so ``check(plan, drafts)`` sees every step's drafts."""
    propose = engine.proposer.propose

    def spy(plan, sampling):
        drafts = propose(plan, sampling)
        check(plan, drafts)
        return drafts

    engine.proposer.propose = spy


def test_a_cut_head_also_drafts_the_context_s_own_ids(tiny_dir):
    """A tied model drafting for itself with its head cut to half the vocabulary: a target token
    beyond the cut can be drafted only if the request's context holds it. Scoring those ids keeps
    more drafts than the bare cut, every draft beyond the cut was in its request's context, and
    greedy output equals plain decoding either way."""
    tied = tiny_dir(arch="qwen2", seed=3, num_layers=2, tie=True)
    cut = 192
    spec = {"method": "draft_model", "model": str(tied), "num_speculative_tokens": 3, "draft_vocab_size": cut}
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain_out = run_alone(tied, PROMPTS, params)
    rates = {}
    for widen in (True, False):
        engine = spec_engine(tied, spec)
        if not widen:
            engine.proposer.head_rows = None  # the bare cut
        beyond = []  # per draft beyond the cut: whether its request's context held it

        def check(plan, drafts, beyond=beyond):
            for i, r in enumerate(plan.decodes):
                context = set(r.token_at(0, r.num_tokens))
                row = drafts.token_ids[i, : drafts.draft_lens[i]].tolist()
                beyond.extend(t in context for t in row if t >= cut)

        _spy_drafts(engine, check)
        assert run_staggered(engine, PROMPTS, params) == plain_out
        rates[widen] = engine.stats()["spec"]["acceptance_rate"]
        assert (beyond and all(beyond)) if widen else not beyond
    assert rates[True] > rates[False]


def test_a_widened_cut_head_draws_sampled_drafts_on_its_ids(tiny_dir):
    """Sampled: every draft lies on the cut or the request's context ids, some beyond the cut, and
    the output is plain sampled decoding's (drafts never change it: test_rejection.py)."""
    tied = tiny_dir(arch="qwen2", seed=3, num_layers=2, tie=True)
    cut = 192
    spec = {"method": "draft_model", "model": str(tied), "num_speculative_tokens": 2, "draft_vocab_size": cut}
    engine = spec_engine(tied, spec)
    beyond = []

    def check(plan, drafts):
        for i, r in enumerate(plan.decodes):
            context = set(r.token_at(0, r.num_tokens))
            for t in drafts.token_ids[i, : drafts.draft_lens[i]].tolist():
                assert t < cut or t in context
                beyond.append(t >= cut)

    _spy_drafts(engine, check)
    params = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True, seed=0)
    assert run_staggered(engine, PROMPTS[:3], params) == run_alone(tied, PROMPTS[:3], params)
    assert beyond and any(beyond)
