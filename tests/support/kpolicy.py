"""K-policy test doubles: step records to feed a policy (as the engine does once per step), and a
policy that drafts a ragged K."""

from dynaspec.engine.types import SchedulePlan, StepRecord, StepResult, StepTiming


def step_record(draft_lens, num_accepted, timing=None, asked=None) -> StepRecord:
    """A step whose decode i was asked for ``asked[i]`` draft tokens (default: ``draft_lens[i]``),
    verified ``draft_lens[i]`` and accepted ``num_accepted[i]``."""
    result = StepResult(token_ids=[[0] * (a + 1) for a in num_accepted], draft_lens=list(draft_lens))
    plan = SchedulePlan(decodes=[], k_caps=list(draft_lens if asked is None else asked), prefills=[])
    if timing is None:
        timing = StepTiming(verify_tokens=len(draft_lens) + sum(draft_lens), prefill_tokens=0, target_ms=0.0)
    return StepRecord(plan, result, timing)


class RaggedK:
    """A K policy drafting a different K for each request and step, with a confidence stop."""

    def __init__(self, min_confidence: float) -> None:
        self.min_confidence = min_confidence
        self.steps = 0
        self.draft_lens: list[list[int]] = []
        self.k_caps: list[list[int]] = []
        self.confidence: list[list[list[float]] | None] = []

    def choose(self, candidates):
        self.steps += 1
        drafts = [(self.steps + i) % 6 if c.decoding else 0 for i, c in enumerate(candidates)]
        return max(drafts, default=0), drafts

    def min_draft_confidence(self):
        return self.min_confidence

    def observe(self, record):
        self.draft_lens.append(list(record.result.draft_lens))
        self.k_caps.append(list(record.plan.k_caps))
        self.confidence.append(record.draft_confidence)

    def snapshot(self):
        return {"policy": "ragged"}
