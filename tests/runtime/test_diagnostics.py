"""first_mismatch finds where two outputs part and reports the reference's top-2 logit gap there."""

import numpy as np

from specdec.runtime.diagnostics import first_mismatch, top2_logit_gap
from specdec.runtime.engine import Engine


def test_first_mismatch_reports_the_position_and_the_logit_gap(tiny_artifacts):
    engine = Engine.load(tiny_artifacts["llama"], provider="cpu")
    prompt, ids = engine.prompt_ids("hi"), [5, 6, 7, 8]
    assert first_mismatch(engine, prompt, ids, list(ids)) is None
    mismatch = first_mismatch(engine, prompt, ids, [5, 6, 9, 8])
    assert mismatch["position"] == 2
    logits = engine.target.forward(engine.target.new_cache(len(prompt) + 2), prompt + ids[:2])[-1]
    top = np.sort(logits)
    assert mismatch["top2_logit_gap"] == top2_logit_gap(engine, prompt + ids[:2]) == float(top[-1] - top[-2]) > 0
