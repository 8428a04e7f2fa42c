"""Per-generation statistics, and the speedup theory predicts from them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from specdec.runtime.theory import CallCost, expected_speedup_over_lengths, paper_call_cost

if TYPE_CHECKING:
    from specdec.runtime.drafters import DrafterStats
    from specdec.runtime.kv_cache import KVCache
    from specdec.runtime.loop import Iteration


def ratio(numerator: float, denominator: float, empty: float | None = 0.0) -> float | None:
    """Return numerator / denominator, or `empty` when the denominator is 0 (nothing counted or timed yet)."""
    return numerator / denominator if denominator else empty


def situation_alpha(counts: dict[str, int]) -> float | None:
    """Return accepted / acceptance tests of one GenerationStats.by_situation entry (None: no test)."""
    return ratio(counts["accepted"], counts["acceptance_tests"], empty=None)


@dataclass
class GenerationStats:
    """Counters and timers of one generation. Times are wall seconds.

    `accepted` counts draft tokens that passed the acceptance test, never bonus or
    recovered tokens. `acceptance_tests` counts tests run (each accepted draft, plus the one
    rejected draft if any), so alpha = accepted / acceptance_tests estimates the per-token
    acceptance probability of the paper; acceptance_rate = accepted / drafted is the share
    of drafted tokens kept.
    """

    drafter: str = "none"
    num_draft_tokens: str = "0"  # "4", or "auto"
    prompt_tokens: int = 0
    new_tokens: int = 0
    iterations: int = 0  # target calls after the prefill
    target_calls: int = 0  # including the prefill
    draft_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_tests: int = 0
    bonus_tokens: int = 0
    draft_lengths: dict[int, int] = field(default_factory=dict)  # K actually drafted -> iterations
    # drafter's situation label (Drafter.situation) -> {"iterations", "drafted", "accepted",
    # "acceptance_tests"}: how each kind of proposal fared, which is what `auto` learns from
    by_situation: dict[str, dict[str, int]] = field(default_factory=dict)
    # every decode-phase target call as (past positions, tokens, seconds): how verification
    # cost grows with the tokens per call, measured in place; the past length is kept because
    # a call's time also grows with it, and comparisons across prompts must not mix the two
    call_log: list[tuple[int, int, float]] = field(default_factory=list)
    prefill_seconds: float = 0.0
    target_seconds: float = 0.0  # decode-phase target calls (verification), excluding the prefill
    draft_seconds: float = 0.0
    mask_seconds: float = 0.0  # building grammar masks and moving the matcher (structured outputs)
    rollback_seconds: float = 0.0
    session_run_seconds: float = 0.0  # inside onnxruntime's run, both models, prefill included
    total_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Return accepted / drafted (0 when nothing was drafted)."""
        return ratio(self.accepted, self.drafted)

    @property
    def alpha(self) -> float:
        """Return accepted / acceptance tests: the per-token acceptance probability estimate."""
        return ratio(self.accepted, self.acceptance_tests)

    @property
    def tokens_per_target_call(self) -> float:
        """Return decode-phase tokens per target call (the prefill's token excluded)."""
        return ratio(self.new_tokens - 1, self.iterations)

    @property
    def tokens_per_second(self) -> float:
        """Return new tokens over the whole generation time, prefill included."""
        return ratio(self.new_tokens, self.total_seconds)

    @property
    def decode_tokens_per_second(self) -> float:
        """Return tokens after the first over the time after the prefill."""
        decode = self.total_seconds - self.prefill_seconds
        return (self.new_tokens - 1) / decode if decode > 0 else 0.0

    @property
    def other_seconds(self) -> float:
        """Return time in neither model call: sampling, acceptance, bookkeeping."""
        return max(self.total_seconds - self.prefill_seconds - self.target_seconds - self.draft_seconds, 0.0)

    @property
    def overhead_share(self) -> float:
        """Return the share of the generation time spent outside onnxruntime's session.run."""
        if not self.total_seconds:
            return 0.0
        return max(self.total_seconds - self.session_run_seconds, 0.0) / self.total_seconds

    @property
    def cost_ratio(self) -> float:
        """Return c: mean draft call time over mean target (decode) call time."""
        if not (self.draft_calls and self.iterations and self.target_seconds):
            return 0.0
        return (self.draft_seconds / self.draft_calls) / (self.target_seconds / self.iterations)

    @property
    def mean_draft_length(self) -> float:
        """Return drafted tokens per iteration."""
        return ratio(self.drafted, self.iterations)

    def expected_speedup(self, call_cost: CallCost = paper_call_cost) -> float:
        """Return Theorem 3.8's speedup for the measured alpha and c over the K each iteration drafted.

        call_cost(n): a target call over n tokens in 1-token calls (default: the paper's 1).
        """
        return expected_speedup_over_lengths(self.alpha, self.draft_lengths, self.cost_ratio, call_cost)

    @property
    def theoretical_speedup(self) -> float:
        """Return expected_speedup() with the paper's cost model (1.0 with no drafting)."""
        return self.expected_speedup()

    def prediction_tokens(self, label: str = "prediction") -> tuple[int, int]:
        """Return (accepted, rejected) drafts copied from a predicted output (situation `label`, or `label`
        with a qualifier: "prediction, 1-token match"): OpenAI's accepted_prediction_tokens and
        rejected_prediction_tokens."""
        counted = [counts for situation, counts in self.by_situation.items()
                   if situation == label or situation.startswith(label + ", ")]
        accepted = sum(counts["accepted"] for counts in counted)
        return accepted, sum(counts["drafted"] for counts in counted) - accepted

    def as_dict(self) -> dict[str, Any]:
        """Return counters and derived figures as one JSON-ready dict."""
        data = asdict(self)
        del data["call_log"]  # one entry per call: too much for a summary
        for name in ("acceptance_rate", "alpha", "tokens_per_target_call", "tokens_per_second",
                     "decode_tokens_per_second", "other_seconds", "overhead_share", "cost_ratio",
                     "mean_draft_length", "theoretical_speedup"):
            data[name] = getattr(self, name)
        return data

    def add(self, iteration: "Iteration") -> None:
        """Count one iteration of the decoding loop (the prefill included)."""
        self.target_calls += 1
        if iteration.prefill:
            self.prefill_seconds = iteration.target_seconds
            return
        drafted = len(iteration.drafted)
        self.iterations += 1
        self.target_seconds += iteration.target_seconds
        self.draft_seconds += iteration.draft_seconds
        self.call_log.append((iteration.past_length, drafted + 1, iteration.target_seconds))
        self.drafted += drafted
        self.draft_lengths[drafted] = self.draft_lengths.get(drafted, 0) + 1
        self.accepted += iteration.num_accepted
        self.acceptance_tests += iteration.acceptance_tests
        self.mask_seconds += iteration.mask_seconds
        self.bonus_tokens += int(iteration.is_bonus)
        if iteration.situation is not None:
            counts = self.by_situation.setdefault(
                iteration.situation, {"iterations": 0, "drafted": 0, "accepted": 0, "acceptance_tests": 0})
            counts["iterations"] += 1
            counts["drafted"] += drafted
            counts["accepted"] += iteration.num_accepted
            counts["acceptance_tests"] += iteration.acceptance_tests

    def add_session_counters(self, target_cache: "KVCache", drafter: "DrafterStats | None") -> None:
        """Take the request's onnxruntime time and call counts from its target cache and drafter."""
        self.session_run_seconds = target_cache.run_seconds + (drafter.session_seconds if drafter else 0.0)
        self.rollback_seconds = target_cache.rollback_seconds
        self.draft_calls = drafter.calls if drafter else 0

    def summary(self) -> str:
        """Return a few human-readable lines."""
        lines = [
            f"{self.new_tokens} tokens in {self.total_seconds:.2f}s ({self.tokens_per_second:.1f} tok/s, "
            f"decode {self.decode_tokens_per_second:.1f} tok/s); prompt {self.prompt_tokens} tokens, "
            f"prefill {self.prefill_seconds * 1e3:.0f} ms",
            f"drafter {self.drafter} K={self.num_draft_tokens}: target calls {self.target_calls}, "
            f"draft calls {self.draft_calls}, drafted {self.drafted}, accepted {self.accepted} "
            f"(rate {self.acceptance_rate:.2f}, alpha {self.alpha:.2f}), bonus {self.bonus_tokens}, "
            f"{self.tokens_per_target_call:.2f} tokens/target call",
            f"time: target {self.target_seconds:.2f}s, draft {self.draft_seconds:.2f}s, "
            f"other {self.other_seconds:.2f}s (outside session.run: {self.overhead_share:.1%}); "
            f"c={self.cost_ratio:.3f}, theoretical speedup {self.theoretical_speedup:.2f}x",
        ]
        if len(self.by_situation) > 1:
            parts = []
            for label, counts in sorted(self.by_situation.items(), key=lambda item: -item[1]["iterations"]):
                alpha = situation_alpha(counts)
                parts.append(f"{label} {counts['iterations']}" + (f" (alpha {alpha:.2f})" if alpha is not None else ""))
            lines.append("iterations by drafting situation: " + ", ".join(parts))
        return "\n".join(lines)
