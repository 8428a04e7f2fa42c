"""Log-probabilities of a prompt's own tokens: what OpenAI's completions return with `echo` and `logprobs`, and
what evaluation harnesses (lm-evaluation-harness's loglikelihood tasks) sum to score a continuation.

Token i (i >= 1) is read from the target's row at position i - 1, as the model's own log softmax: temperature 1,
no bias, penalty or mask (vLLM's prompt logprobs are raw too). The first token has no row. The prompt is fed in
chunks of PROMPT_CHUNK rows, so its logits are never all held at once.
"""

from __future__ import annotations

import numpy as np

from specdec.runtime.logprobs import TokenLogprobs, token_logprobs
from specdec.runtime.sampling import SamplingConfig
from specdec.runtime.session import ModelSession

PROMPT_CHUNK = 128  # rows of logits held at once (~25 MB at SmolLM2's 49k-token vocabulary)


def prompt_logprobs(target: ModelSession, prompt_ids: list[int], top: int,
                    chunk: int = PROMPT_CHUNK) -> TokenLogprobs:
    """Return the TokenLogprobs of prompt tokens 1..n-1 (n - 1 entries), each with its `top` alternatives."""
    scored = prompt_ids[1:]
    parts = []
    cache = target.new_cache(capacity=len(prompt_ids))
    try:
        for start in range(0, len(scored), chunk):
            fed = prompt_ids[start:start + min(chunk, len(scored) - start)]  # the last token predicts nothing here
            logits = target.forward(cache, fed)
            parts.append(token_logprobs(logits, scored[start:start + len(fed)], SamplingConfig(), None, top))
    finally:
        cache.release()
    if not parts:
        empty = np.zeros((0, top))
        return TokenLogprobs(np.zeros(0), empty.astype(np.int64), empty)
    return TokenLogprobs(np.concatenate([p.chosen for p in parts]), np.concatenate([p.top_ids for p in parts]),
                         np.concatenate([p.top_values for p in parts]))
