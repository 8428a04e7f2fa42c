"""The combined drafter (prompt lookup where a copy is likely, the draft model elsewhere) and its per-situation c."""

import pytest

from specdec.runtime.combined import CombinedDrafter, serves_by_lookup
from specdec.runtime.draft_length import AdaptiveDraftLength
from specdec.runtime.drafters import DrafterStats, NgramDrafter, Proposal
from specdec.runtime.engine import Engine
from specdec.runtime.loop import Iteration
from specdec.runtime.ngram import AMBIGUOUS, NO_MATCH, ONE_TOKEN_MATCH, REPEATED, SEEN_ONCE

from tests.runtime.helpers import greedy

# The tiny random models repeat themselves now and then on these (lookup's side), else the model drafts.
PROMPTS = ["The quick brown fox", "one, two, three, one, two, three, one, two,", "a a a a a a a a", "Hello world!"]


def test_which_side_serves_each_situation():
    assert serves_by_lookup(SEEN_ONCE) and serves_by_lookup(REPEATED)
    assert not serves_by_lookup(NO_MATCH) and not serves_by_lookup(AMBIGUOUS)
    assert not serves_by_lookup(SEEN_ONCE + ONE_TOKEN_MATCH) and not serves_by_lookup(REPEATED + ONE_TOKEN_MATCH)


class RecordingModel:
    """A fake model side: proposes 7s and records the calls it gets."""

    name = "model"
    reads_hidden = False
    stats = DrafterStats(calls=3)

    def __init__(self):
        self.calls = []

    def begin(self, prompt_ids, target_hidden=None):
        self.calls.append(("begin", len(prompt_ids)))

    def propose(self, context, k):
        self.calls.append(("propose", k))
        return Proposal([7] * k, None)

    def accept(self, context, target_hidden=None):
        self.calls.append(("accept", len(context)))


def test_routes_proposals_by_situation():
    model = RecordingModel()
    drafter = CombinedDrafter(NgramDrafter(min_n=2, max_n=4), model)
    assert drafter.name == "ngram+model" and drafter.stats.calls == 3
    prompt = [1, 2, 3, 4, 5]
    drafter.begin(prompt)
    assert model.calls == [("begin", 5)]
    assert drafter.situation(prompt) == f"model: {NO_MATCH}"
    assert drafter.propose(prompt, 3).tokens == [7, 7, 7]  # nothing recurs: the model drafts
    context = prompt + [1, 2]  # "1 2" was seen once, followed by 3: lookup copies 3 4 5
    assert drafter.situation(context) == f"ngram: {SEEN_ONCE}"
    assert drafter.propose(context, 3).tokens == [3, 4, 5]
    assert model.calls[-1] == ("propose", 3)  # the model was not asked
    drafter.accept(context + [3])
    assert model.calls[-1] == ("accept", 8)  # but it rolls back beside the target


def drafted(k, accepted, situation, draft_seconds, target_seconds=0.01, step=None):
    return Iteration(list(range(k)), accepted, list(range(accepted)) + [99], is_bonus=accepted == k, finished=None,
                     situation=situation, rejected=accepted < k, draft_seconds=draft_seconds,
                     target_seconds=target_seconds, draft_step_seconds=step)


def test_cost_per_situation():
    policy = AdaptiveDraftLength(max_k=8, cost_per_situation=True)
    # The first drafted iteration carries the draft's prefill: not a per-token cost.
    policy.observe(drafted(4, 4, "model: no match", draft_seconds=1.0, step=0.003))
    assert policy.estimate("model: no match").cost_ratio is None
    for _ in range(30):
        policy.observe(drafted(4, 2, "model: no match", draft_seconds=4 * 0.003, step=0.003))
        policy.observe(drafted(8, 8, "ngram: repeated", draft_seconds=8 * 1e-5, step=0.003))
    assert policy.situation_cost("model: no match") == pytest.approx(0.3, rel=0.05)
    assert policy.situation_cost("ngram: repeated") == pytest.approx(0.001, rel=0.05)
    assert policy.cost_ratio == pytest.approx(0.3, rel=0.05)  # the shared c, for situations not seen yet
    assert policy.situation_cost("ngram: seen once") == policy.cost_ratio
    # Same alpha, different c: drafting is free after a repeated n-gram, so K is longer there.
    policy.estimate("model: no match").alpha = policy.estimate("ngram: repeated").alpha = 0.8
    assert policy.best("ngram: repeated")[0] > policy.best("model: no match")[0]
    shared = AdaptiveDraftLength(max_k=8)  # the default: one c for all, as before
    shared.observe(drafted(4, 4, "a", draft_seconds=1.0, step=0.003))
    shared.observe(drafted(4, 4, "b", draft_seconds=1e-5, step=0.003))
    assert shared.situation_cost("a") == shared.situation_cost("b") == shared.cost_ratio > 0


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("k", [3, "auto"])
def test_combined_greedy_equals_target_only(tiny_close_artifacts, family, k):
    engine = Engine.load(tiny_close_artifacts[family], provider="cpu")
    sides = set()
    for prompt in PROMPTS:
        plain = greedy(engine, prompt, drafter="none", max_new_tokens=64)
        combined = greedy(engine, prompt, drafter="ngram+model", num_draft_tokens=k, max_new_tokens=64)
        assert combined.token_ids == plain.token_ids, prompt
        assert combined.stats.drafter == "ngram+model"
        sides |= {label.split(":")[0] for label in combined.stats.by_situation}
        drafted_total = sum(c["drafted"] for c in combined.stats.by_situation.values())
        assert drafted_total == combined.stats.drafted
    assert sides == {"ngram", "model"}  # both sides drafted somewhere


def test_combined_needs_a_draft_model(tiny_target_only_artifact):
    from specdec.models.errors import GenerationError

    engine = Engine.load(tiny_target_only_artifact, provider="cpu")
    with pytest.raises(GenerationError, match="no draft model"):
        greedy(engine, "hello", drafter="ngram+model")
