"""Checking that a draft can propose tokens the target understands: same vocabulary."""

from __future__ import annotations

from typing import Any

from specdec.models.errors import ExportError


def _id_to_token(tokenizer: Any) -> dict[int, str]:
    return {index: token for token, index in tokenizer.get_vocab().items()}


def check_tokenizers_compatible(target_tokenizer: Any, draft_tokenizer: Any) -> int:
    """Return the shared vocabulary size, or raise ExportError naming the first differing token.

    Both tokenizers must map every id to the same token string. Differences in the models'
    embedding sizes (padding rows) are allowed; the caller records them so the runtime masks
    ids beyond the shared vocabulary.
    """
    target_vocab = _id_to_token(target_tokenizer)
    draft_vocab = _id_to_token(draft_tokenizer)
    for index in sorted(set(target_vocab) | set(draft_vocab)):
        target_token = target_vocab.get(index)
        draft_token = draft_vocab.get(index)
        if target_token != draft_token:
            raise ExportError(
                f"draft and target tokenizers differ at id {index}: target has "
                f"{target_token!r}, draft has {draft_token!r}; the draft must share the target's tokenizer"
            )
    return len(target_vocab)
