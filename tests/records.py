"""Step records for feeding K policies in unit tests, as the engine does once per step."""

from dynaspec.engine.types import SchedulePlan, StepRecord, StepResult, StepTiming


def step_record(draft_lens, num_accepted, timing=None, asked=None) -> StepRecord:
    """A step whose decode i was asked for ``asked[i]`` draft tokens (default: ``draft_lens[i]``),
    verified ``draft_lens[i]`` and accepted ``num_accepted[i]``."""
    result = StepResult(token_ids=[[0] * (a + 1) for a in num_accepted], draft_lens=list(draft_lens))
    plan = SchedulePlan(decodes=[], k_caps=list(draft_lens if asked is None else asked), prefills=[])
    if timing is None:
        timing = StepTiming(verify_tokens=len(draft_lens) + sum(draft_lens), prefill_tokens=0, target_ms=0.0)
    return StepRecord(plan, result, timing)
