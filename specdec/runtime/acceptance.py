"""Pure functions for the verification step of speculative sampling (Leviathan et al. 2023, Alg. 1).

Terms, used the same way in the stats:
- accepted: draft tokens kept because they passed the test `u < p(x) / q(x)`;
- recovered (correction): the token sampled from norm(max(0, p - q)) at the first rejection;
- bonus: the token sampled from the target's (K+1)-th row when all K drafts are accepted.
Accepted counts only the first kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.runtime.sampling import sample_token


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying K drafted tokens."""

    num_accepted: int  # drafts kept, 0..K
    next_token: int  # the recovered token (after a rejection) or the bonus token (all accepted)
    is_bonus: bool  # True when K >= 1 drafts were all accepted and next_token came from row K

    def committed(self, draft_tokens: list[int]) -> list[int]:
        """Return the tokens this verdict commits: the accepted drafts, then next_token."""
        return list(draft_tokens[: self.num_accepted]) + [self.next_token]


def residual_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Return norm(max(0, p - q)) for rows p, q [vocab]; falls back to p where p == q.

    p == q everywhere means every draft is accepted, so the fallback is only reached
    through rounding; p is then the right distribution.
    """
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if total <= 0.0:
        return p
    return residual / total


def rejection_sample(
    draft_tokens: list[int],  # [K]
    target_probs: np.ndarray,  # [K + 1, vocab]: p for each draft position, then the bonus row
    draft_probs: np.ndarray | None,  # [K, vocab] full q rows; None: a deterministic drafter (q one-hot)
    rng: np.random.Generator,
) -> Verdict:
    """Return the verdict of speculative sampling on K drafts.

    Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); on the first rejection sample
    from norm(max(0, p_i - q_i)); if all K pass, sample the bonus token from p_{K+1}. The
    committed tokens are distributed exactly as the target's own samples.
    """
    k = len(draft_tokens)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must have K+1={k + 1} rows, got {target_probs.shape[0]}")
    if draft_probs is not None and draft_probs.shape != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs must be [{k}, {target_probs.shape[1]}], got {draft_probs.shape}")
    for i, token in enumerate(draft_tokens):
        p = target_probs[i]
        q_token = 1.0 if draft_probs is None else draft_probs[i, token]
        # u < p/q written without the division: q may be tiny.
        if rng.random() * q_token < p[token]:
            continue
        if draft_probs is None:
            q = np.zeros_like(p)
            q[token] = 1.0  # residual of a one-hot q: p with the drafted token removed
        else:
            q = draft_probs[i]
        return Verdict(i, sample_token(residual_distribution(p, q), rng), is_bonus=False)
    return Verdict(k, sample_token(target_probs[k], rng), is_bonus=k > 0)


def greedy_verify(draft_tokens: list[int], target_argmax: np.ndarray) -> Verdict:
    """Return the verdict under greedy decoding: keep drafts while they equal the target's argmax.

    target_argmax: [K + 1] argmax of each target row. The first mismatch is replaced by the
    target's argmax (its correction); if all match, row K gives the bonus token.
    """
    k = len(draft_tokens)
    for i, token in enumerate(draft_tokens):
        if int(target_argmax[i]) != int(token):
            return Verdict(i, int(target_argmax[i]), is_bonus=False)
    return Verdict(k, int(target_argmax[k]), is_bonus=k > 0)
