"""Speculation counters: drafts, acceptance per position, and which K ran at which batch size."""

from __future__ import annotations

from dataclasses import dataclass, field

from dynaspec.engine.types import StepRecord


@dataclass(slots=True)
class SpecStats:
    num_drafts: int = 0  # drafts verified: request-steps with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [max K seen] accepted at position i+1
    drafted_per_pos: list[int] = field(default_factory=list)  # [max K seen] drafted at position i+1
    asked_per_pos: list[int] = field(default_factory=list)  # [max K seen] asked for at position i+1
    steps_by_batch_size: dict[int, dict[int, int]] = field(default_factory=dict)  # bs -> K -> steps

    def observe(self, record: StepRecord) -> None:
        """One step: the K chosen at its decode batch size; each decode's draft tokens and accepted ones."""
        plan, result = record.plan, record.result
        if plan.num_decodes:
            per_k = self.steps_by_batch_size.setdefault(plan.num_decodes, {})
            per_k[plan.chosen_k] = per_k.get(plan.chosen_k, 0) + 1
        for n, accepted, asked in zip(result.draft_lens, result.num_accepted, plan.k_caps):
            asked = max(n, asked)
            _pad(self.asked_per_pos, asked)
            for i in range(asked):
                self.asked_per_pos[i] += 1
            if n == 0:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += n
            self.num_accepted_tokens += accepted
            _pad(self.drafted_per_pos, n)
            _pad(self.accepted_per_pos, n)
            for i in range(n):
                self.drafted_per_pos[i] += 1
                self.accepted_per_pos[i] += i < accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per drafting request-step (1 + accepted drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Unconditional α_i: accepted at position i over drafts that reached position i."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    @property
    def acceptance_rate_per_asked_pos(self) -> list[float]:
        """Accepted at position i over steps that asked for position i: the proposer's yield, lower
        than α_i where it proposes less than asked (an n-gram without a match, a confidence stop)."""
        accepted = self.accepted_per_pos + [0] * (len(self.asked_per_pos) - len(self.accepted_per_pos))
        return [a / d if d else 0.0 for a, d in zip(accepted, self.asked_per_pos)]

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_length": round(self.acceptance_length, 4),
            "acceptance_rate_per_pos": [round(a, 4) for a in self.acceptance_rate_per_pos],
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate_per_asked_pos": [round(a, 4) for a in self.acceptance_rate_per_asked_pos],
            "steps_by_batch_size": {
                str(bs): {str(k): n for k, n in sorted(ks.items())}
                for bs, ks in sorted(self.steps_by_batch_size.items())
            },
        }


def _pad(counts: list[int], n: int) -> None:
    """Grow a per-position count list with zeros to at least ``n`` positions."""
    counts += [0] * (n - len(counts))
