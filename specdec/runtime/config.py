"""One request's settings, as a dataclass the CLI and the server map their flags onto."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, replace

from specdec.models.errors import GenerationError
from specdec.models.manifest import DRAFTER_KINDS
from specdec.runtime.grammar import GrammarSpec
from specdec.runtime.logprobs import MAX_TOP_LOGPROBS
from specdec.runtime.sampling import SamplingConfig

DRAFTER_CHOICES = ("auto",) + DRAFTER_KINDS  # auto: the artifact's tuned drafter, else its draft model, else n-gram
PROVIDER_CHOICES = ("auto", "cuda", "cpu")  # auto: CUDA when onnxruntime-gpu can load it, else the CPU
DEFAULT_DRAFT_TOKENS = 4  # when neither the caller nor the artifact (`specdec tune`) says
MAX_DRAFT_TOKENS = 32  # the largest K a request may ask for (loop.MAX_DRAFT_ROOM leaves room for it)
MAX_CACHE_SALT = 256  # characters of a request's cache_salt
NGRAM_MIN_FIXED_K, NGRAM_MIN_AUTO = 2, 1  # GenerationConfig.ngram_min says why
# K caps under "auto" when the request sets none (GenerationConfig.max_draft_tokens_auto says why).
AUTO_K_CAP, AUTO_K_CAP_PREDICTION = 16, MAX_DRAFT_TOKENS


@dataclass(frozen=True)
class GenerationConfig:
    """One request's settings; every field but cache_salt (the batch engine's prefix cache, which one `specdec
    generate` has none of) has the CLI flag of the same name."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off; else drop tokens less likely than min_p x the most likely one
    repetition_penalty: float = 1.0  # 1: off; > 1: tokens already in prompt or output become less likely
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit)
    presence_penalty: float = 0.0  # OpenAI's, in [-2, 2]: subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]: subtracted per occurrence in the output so far
    # Report each generated token's log-probability and this many most likely alternatives (0..20; None: off),
    # read from the target's rows (specdec/runtime/logprobs.py).
    logprobs: int | None = None
    # The text (or token ids) the answer is expected to be (OpenAI's Predicted Outputs: a file to edit): drafted
    # from, and verified like any draft, so the output does not depend on it (specdec/runtime/prediction.py).
    prediction: str | tuple[int, ...] | None = None
    # What the output must match (structured outputs: a JSON schema, JSON, a regex, a choice, a Lark grammar),
    # enforced by a mask on every row, the target's and the draft's alike (specdec/runtime/grammar.py).
    grammar: GrammarSpec | None = None
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the generation like EOS (kept in the output)
    # Seeds this request's numpy Generator: same seed and K, same output. Under
    # num_draft_tokens="auto" K follows measured timings, so sampled output can vary, unless `reproducible`.
    seed: int = 0
    # Same seed, same sampled output at any load and timing (a seed the client chose): each step's K then
    # depends on the request's own tokens only. Under "auto", prompt lookup's K follows the calibrated call
    # costs, not live timings, and a drafting model's is the artifact's fixed K; the batch plan keeps it.
    reproducible: bool = False
    num_draft_tokens: int | str | None = None  # K, "auto", or None: the artifact's default
    drafter: str = "auto"  # auto: the draft model if the artifact has one, else n-gram
    # Cap on K under "auto"; None: 16 (copy runs in grounded prompts outlast 8 drafts), 32 with a prediction,
    # whose copy runs outlast 16 (docs/DESIGN.md, "Defaults").
    max_draft_tokens_auto: int | None = None
    # n-gram drafter: shortest suffix to match; None: 2 under a fixed K (1-token matches mostly
    # miss), 1 under "auto", which learns whether they pay (docs/DESIGN.md, "Defaults").
    ngram_min: int | None = None
    ngram_max: int = 4  # n-gram drafter: longest suffix to match
    # n-gram drafter: where the context has no 2+-token match, propose the target's usual continuation
    # from the artifact's phrase table (`specdec phrases`), if it has one.
    phrases: bool = True
    stop_strings: tuple[str, ...] = ()
    chat: bool = False  # wrap the prompt in the artifact's chat template
    # The batch engine's prefix cache reuses KV only between requests of the same salt (vLLM's `cache_salt`:
    # tenants that must not time each other's prompts; None: the shared pool). The output never depends on it.
    cache_salt: str | None = None

    @property
    def sampling(self) -> SamplingConfig:
        """Return the sampling part of the config."""
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty,
                              tuple(self.logit_bias), self.presence_penalty, self.frequency_penalty,
                              needs_logits=self.logprobs is not None or self.grammar is not None)

    @property
    def k_follows_tokens(self) -> bool:
        """Return whether each step's K must depend on the request's own tokens only: `reproducible` and sampled
        (a greedy answer is the same whatever K)."""
        return self.reproducible and self.temperature > 0

    def sampling_after(self, prompt_length: int) -> SamplingConfig:
        """Return the sampling part for a prompt of `prompt_length` tokens: the output starts after it (what the
        presence and frequency penalties count)."""
        return replace(self.sampling, output_start=prompt_length)

    def validate(self) -> None:
        """Raise GenerationError for a wrong-typed or out-of-range setting."""
        integers = ("max_new_tokens", "seed", "ngram_max") + tuple(
            name for name in ("ngram_min", "max_draft_tokens_auto") if getattr(self, name) is not None)
        for name in integers:  # a str or float here would fail later with a TypeError, or be truncated
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise GenerationError(f"{name} must be an integer, got {value!r}")
        if self.seed < 0:
            raise GenerationError(f"seed must be >= 0, got {self.seed}")
        for name in ("chat", "phrases", "reproducible"):
            if not isinstance(getattr(self, name), bool):
                raise GenerationError(f"{name} must be True or False, got {getattr(self, name)!r}")
        # A bare string would be read as one stop string per character.
        if not isinstance(self.stop_strings, (tuple, list)) or not all(
                isinstance(s, str) and s for s in self.stop_strings):
            raise GenerationError(f"stop_strings must be a tuple of non-empty strings, got {self.stop_strings!r}")
        if not isinstance(self.stop_token_ids, (tuple, list)) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise GenerationError(f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids!r}")
        if not isinstance(self.logit_bias, (tuple, list)) or not all(
                isinstance(pair, (tuple, list)) and len(pair) == 2 for pair in self.logit_bias):
            raise GenerationError(f"logit_bias must be (token id, bias) pairs, got {self.logit_bias!r}")
        self.sampling.validate()
        if self.logprobs is not None and (not isinstance(self.logprobs, numbers.Integral) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise GenerationError(f"logprobs must be None or an integer in 0..{MAX_TOP_LOGPROBS} (the alternatives "
                                  f"reported per token), got {self.logprobs!r}")
        if self.prediction is not None and not isinstance(self.prediction, str) and not (
                isinstance(self.prediction, (tuple, list)) and all(
                    isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in self.prediction)):
            raise GenerationError(f"prediction must be a string or token ids, got {type(self.prediction).__name__}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise GenerationError(f"grammar must be a GrammarSpec (GrammarSpec.of('json_schema', schema)), "
                                  f"got {type(self.grammar).__name__}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not 1 <= len(self.cache_salt)
                                            <= MAX_CACHE_SALT):
            raise GenerationError(f"cache_salt must be None or a string of 1 to {MAX_CACHE_SALT} characters")
        if self.max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        k = self.num_draft_tokens
        if k is not None and k != "auto" and (not isinstance(k, int) or isinstance(k, bool)
                                              or not 1 <= k <= MAX_DRAFT_TOKENS):
            raise GenerationError(f"num_draft_tokens must be an integer in 1..{MAX_DRAFT_TOKENS} or 'auto', got {k!r}")
        if self.max_draft_tokens_auto is not None and not 1 <= self.max_draft_tokens_auto <= MAX_DRAFT_TOKENS:
            raise GenerationError(f"max_draft_tokens_auto must be in 1..{MAX_DRAFT_TOKENS}, "
                                  f"got {self.max_draft_tokens_auto}")
        if self.drafter not in DRAFTER_CHOICES:
            raise GenerationError(f"drafter must be one of {', '.join(DRAFTER_CHOICES)}, got '{self.drafter}'")
        if self.ngram_max < 1 or (self.ngram_min is not None and not 1 <= self.ngram_min <= self.ngram_max):
            raise GenerationError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")

    @property
    def auto_k_cap(self) -> int:
        """Return the cap on K under "auto": max_draft_tokens_auto, else AUTO_K_CAP (AUTO_K_CAP_PREDICTION with a
        prediction)."""
        if self.max_draft_tokens_auto is not None:
            return self.max_draft_tokens_auto
        return AUTO_K_CAP_PREDICTION if self.prediction else AUTO_K_CAP

    def ngram_min_for(self, adaptive: bool) -> int:
        """Return the n-gram drafter's shortest suffix: ngram_min if set, else 1 under "auto" (adaptive) and 2
        under a fixed K, at most ngram_max."""
        if self.ngram_min is not None:
            return self.ngram_min
        return min(NGRAM_MIN_AUTO if adaptive else NGRAM_MIN_FIXED_K, self.ngram_max)


def check_token_ids(ids: list, vocab_size: int) -> list[int]:
    """Return `ids` as ints; raise GenerationError unless each is an integer in [0, vocab_size).

    onnxruntime reads an id past the embedding as an error deep in a Gather, and a negative one
    as a row counted from the end, silently.
    """
    for index, token in enumerate(ids):
        if not isinstance(token, numbers.Integral) or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise GenerationError(f"prompt token {index} is {token!r}: ids must be integers in 0..{vocab_size - 1}")
    return [int(token) for token in ids]
