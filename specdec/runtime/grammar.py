"""Grammar state for one request (structured outputs), on llguidance.

A `GrammarSpec` (JSON object, JSON schema, regex, choice or Lark grammar) is compiled once per
(tokenizer, spec) by `compile_grammar`; each request then owns a `GrammarState` that says which
tokens may come next, for the committed context and for every draft prefix at once (`allowed`),
and moves forward (`advance`) and back (`rollback`) with the committed tokens. `apply_mask` and
`mask_probs` are the pure numpy halves: they apply a mask to logits rows (p) and probability rows (q).

Why llguidance: it needs neither torch nor transformers (xgrammar imports both), and it fills the
masks for a request's K draft rows in one call. Figures in docs/STRUCTURED.md.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import llguidance
import llguidance.numpy
import numpy as np
from tokenizers import Tokenizer

from specdec.models.errors import GenerationError

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")  # "grammar": a Lark grammar
MAX_SPEC_BYTES = 64 * 1024  # a request's schema/grammar text; bigger is abuse, not a format
# JSON objects/arrays nested in a schema's text: each nested property costs 2 ("properties" and the
# property's schema), so 32 allows 15 levels of objects in objects; OpenAI's structured outputs allow 10.
MAX_SCHEMA_DEPTH = 32
COMPILE_CACHE_SIZE = 64  # compiled grammars kept per process (a server sees the same schemas again)
TOKENIZER_CACHE_SIZE = 4  # adapters kept: one per loaded artifact
# Compact JSON with json.dumps' separators: flexible whitespace lets a small model emit blanks
# without end, and ", " / ": " is the spelling models saw most. A schema's "x-guidance" overrides it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Text whose bytes the engine must read back from the tokenizer's ids; a mismatch means llguidance
# mistook the tokenizer's byte encoding, and every mask would be wrong.
_PROBE = 'Hello, wörld! {"a": [1, -2.5e-3, true, null]}\n\t☃ 東京 "x\\y"'


class GrammarError(GenerationError):
    """The grammar is malformed, unsupported or too large, or a token broke it (a bug upstream)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. `payload` by kind:

    json_object: "" (any JSON object); json_schema: the schema as JSON text; regex: the pattern;
    choice: a JSON list of strings (the output is one of them); grammar: a Lark grammar.
    Hashable, so compiled grammars are cached by it; build it with `GrammarSpec.of`.
    """

    kind: str
    payload: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.payload, str):
            raise GrammarError(f"a {self.kind} grammar's payload must be text, got {type(self.payload).__name__}")

    @classmethod
    def of(cls, kind: str, value: str | dict | list | None = None) -> "GrammarSpec":
        """Return the spec of `kind`, serializing a dict (schema) or list (choices) to JSON text."""
        if isinstance(value, (dict, list)):
            value = json.dumps(value, ensure_ascii=False)  # key order kept: it is the output's order
        return cls(kind, "" if value is None else value)


@dataclass(frozen=True, eq=False)
class GrammarTokenizer:
    """An artifact's tokenizer as llguidance reads it. Hashed by identity (a cache key)."""

    ll: llguidance.LLTokenizer
    vocab_size: int  # ids the tokenizer has: the width of the engine's masks before padding
    eos_token_ids: tuple[int, ...]  # allowed once the grammar is satisfied; they end the grammar


_tokenizers: OrderedDict[int, tuple[Tokenizer, tuple[int, ...], GrammarTokenizer]] = OrderedDict()


def grammar_tokenizer(tokenizer: Tokenizer, eos_token_ids: Sequence[int]) -> GrammarTokenizer:
    """Return the llguidance adapter of an artifact's `tokenizers.Tokenizer` (about 0.2 s for 49k
    tokens), cached per tokenizer object. `eos_token_ids` come from the manifest
    (TokenizerSpec.eos_token_ids): the grammar allows them where it may stop."""
    eos = tuple(int(t) for t in eos_token_ids)
    if not eos:
        raise GrammarError("a grammar needs the artifact's EOS token ids to know where output may stop")
    entry = _tokenizers.get(id(tokenizer))
    if entry is not None and entry[0] is tokenizer and entry[1] == eos:
        _tokenizers.move_to_end(id(tokenizer))
        return entry[2]
    data = json.loads(tokenizer.to_str())
    decoder = data.get("decoder") or {}
    if decoder.get("type") == "Sequence":
        # GGUF-converted byte-level BPEs (SmolLM2's) wrap ByteLevel in a Sequence with ByteFallback,
        # which llguidance 1.9 reads as a sentencepiece vocabulary; the ByteLevel step alone decodes alike.
        byte_level = [d for d in decoder.get("decoders", []) if d.get("type") == "ByteLevel"]
        if byte_level:
            data["decoder"] = byte_level[0]
    ll = llguidance.LLTokenizer(json.dumps(data), eos_token=list(eos))
    probe = tokenizer.encode(_PROBE, add_special_tokens=False).ids
    if tokenizer.decode(probe) == _PROBE and ll.decode_bytes(probe) != _PROBE.encode():
        raise GrammarError(f"llguidance misreads this tokenizer's bytes (decoder {decoder.get('type')!r}); "
                           "structured outputs cannot be used with it")
    adapter = GrammarTokenizer(ll=ll, vocab_size=ll.vocab_size, eos_token_ids=eos)
    _tokenizers[id(tokenizer)] = (tokenizer, eos, adapter)  # the tokenizer is kept so its id is not reused
    while len(_tokenizers) > TOKENIZER_CACHE_SIZE:
        _tokenizers.popitem(last=False)
    return adapter


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A grammar compiled for one tokenizer; `start` gives each request its own state."""

    spec: GrammarSpec
    tokenizer: GrammarTokenizer
    matcher: llguidance.LLMatcher  # at the start, never advanced: each state is a deep copy of it

    def start(self, vocab_size: int) -> "GrammarState":
        """Return a fresh state whose masks are `vocab_size` wide (the model's logits)."""
        return GrammarState(self, vocab_size)


def compile_grammar(spec: GrammarSpec, tokenizer: GrammarTokenizer) -> CompiledGrammar:
    """Return `spec` compiled for `tokenizer`, from an LRU cache of COMPILE_CACHE_SIZE entries.

    Raises GrammarError, one line naming the problem, for a payload over MAX_SPEC_BYTES, a schema
    nested deeper than MAX_SCHEMA_DEPTH, malformed JSON, or what llguidance refuses (unknown type,
    unsupported keyword, bad regex, bad Lark).
    """
    return _compile_cached(spec, tokenizer)


@functools.lru_cache(maxsize=COMPILE_CACHE_SIZE)
def _compile_cached(spec: GrammarSpec, tokenizer: GrammarTokenizer) -> CompiledGrammar:
    size = len(spec.payload.encode())
    if size > MAX_SPEC_BYTES:
        raise GrammarError(f"the {spec.kind} is {size} bytes, over the limit of {MAX_SPEC_BYTES}")
    grammar = _llguidance_grammar(spec)
    matcher = llguidance.LLMatcher(tokenizer.ll, grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(f"invalid {spec.kind}: {_one_line(matcher.get_error())}")
    # The first mask builds the lexer's lazy states; pay it here, once, not in each request.
    llguidance.numpy.fill_next_token_bitmask(matcher, llguidance.numpy.allocate_token_bitmask(1, tokenizer.vocab_size))
    if matcher.is_error():
        raise GrammarError(f"invalid {spec.kind}: {_one_line(matcher.get_error())}")
    return CompiledGrammar(spec=spec, tokenizer=tokenizer, matcher=matcher)


def _llguidance_grammar(spec: GrammarSpec) -> str:
    """Return llguidance's grammar text for `spec`, after the depth and shape checks."""
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.payload)
    if spec.kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(spec.payload)
    value = _parse_json(spec)
    if spec.kind == "choice":
        if not value or not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise GrammarError("choice must be a non-empty JSON list of non-empty strings")
        return llguidance.grammar_from("choice", value)
    if not isinstance(value, dict):
        raise GrammarError(f"json_schema must be a JSON object, got {type(value).__name__}")
    depth = _depth(value)
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"json_schema nests objects and arrays {depth} deep, over the limit of {MAX_SCHEMA_DEPTH}")
    return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)


def _parse_json(spec: GrammarSpec):
    try:
        return json.loads(spec.payload)
    except RecursionError:
        raise GrammarError(f"{spec.kind} nests objects and arrays deeper than the limit of {MAX_SCHEMA_DEPTH}") from None
    except ValueError as err:
        raise GrammarError(f"{spec.kind} is not valid JSON: {err}") from None


def _depth(value) -> int:
    """Return how many objects/arrays nest in a parsed JSON value (a scalar is 0)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in children)
    return deepest


def _first_line(message: str) -> str:
    return (message.strip().splitlines() or ["unknown error"])[0]


def _one_line(message: str) -> str:
    """Return a compile error on one line (llguidance's regex errors span three)."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())[:300] or "unknown error"


@functools.lru_cache(maxsize=1)
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()  # its threads are shared by every request's mask fill


class GrammarState:
    """One request's position in its grammar. Tokens are the committed output only (no prompt).

    EOS is not given to the engine: advancing over an EOS where the grammar may stop ends the state
    (`done`), and rolling it back reopens it.
    """

    def __init__(self, compiled: CompiledGrammar, vocab_size: int):
        if vocab_size < 1:
            raise GrammarError(f"vocab_size must be positive, got {vocab_size}")
        self.compiled = compiled
        self.vocab_size = vocab_size  # mask width: the model's logits, padding rows included
        self._matcher = compiled.matcher.deep_copy()
        self._eos = frozenset(compiled.tokenizer.eos_token_ids)
        self._ended = False  # an EOS was advanced over
        self._consumed = 0  # tokens advanced and not rolled back (the EOS included): what rollback may undo

    @property
    def consumed(self) -> int:
        """Return the number of tokens advanced over and not rolled back."""
        return self._consumed

    @property
    def done(self) -> bool:
        """Return True when nothing but EOS may come (or an EOS was advanced over)."""
        return self._ended or self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """Return True when the output so far is complete: generation may stop here."""
        return self._ended or self._matcher.is_accepting()

    def allowed(self, drafts: Sequence[int]) -> tuple[int, np.ndarray]:
        """Return (n, mask): n, the number of leading `drafts` the grammar accepts from here, and
        mask [n + 1, vocab_size] bool, row j the tokens allowed after drafts[:j] (padding ids past
        the tokenizer are False). Verification reads row j for the target's row j. The state is
        left as it was. One engine call fills all rows."""
        return allowed_many([self], [drafts])[0]

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume committed `tokens`. Raises GrammarError, the state unchanged, if the grammar
        refuses one (a bug upstream: committed tokens were sampled under the mask)."""
        tokens = [int(t) for t in tokens]
        end = next((i for i, t in enumerate(tokens) if t in self._eos), len(tokens))
        if self._ended and tokens:
            raise GrammarError(f"token {tokens[0]} advanced after EOS")
        if end < len(tokens) - 1:
            raise GrammarError(f"token {tokens[end + 1]} advanced after EOS {tokens[end]}")
        head = tokens[:end]
        ok = self._matcher.validate_tokens(head)
        if ok < len(head):
            raise GrammarError(f"the grammar refuses token {head[ok]} at position {ok} of {head}")
        self._check(self._matcher.consume_tokens(head))
        if end < len(tokens):
            if not self._matcher.is_accepting():
                self._check(self._matcher.rollback(len(head)))
                raise GrammarError(f"EOS {tokens[end]} advanced before the grammar is complete")
            self._ended = True
        self._consumed += len(tokens)

    def rollback(self, n: int) -> None:
        """Undo the last `n` advanced tokens (0 <= n <= consumed)."""
        if not 0 <= n <= self._consumed:
            raise GrammarError(f"cannot roll back {n} tokens: {self._consumed} were advanced")
        self._consumed -= n
        if n and self._ended:
            self._ended, n = False, n - 1
        if n:
            self._check(self._matcher.rollback(n))

    def forced(self, max_tokens: int) -> list[int]:
        """Return up to `max_tokens` tokens the grammar forces next (possibly none): good drafts,
        though the target's mask may allow other spellings of the same bytes."""
        if self._ended or max_tokens <= 0:
            return []
        return list(self._matcher.compute_ff_tokens()[:max_tokens])

    def _unpack(self, bits: np.ndarray) -> np.ndarray:
        return _unpack_rows(bits, self.compiled.tokenizer.vocab_size, self.vocab_size)

    def _eos_rows(self, rows: int) -> np.ndarray:
        mask = np.zeros((rows, self.vocab_size), dtype=bool)
        mask[:, [t for t in self._eos if t < self.vocab_size]] = True
        return mask

    def _check(self, ok: bool) -> None:
        if not ok or self._matcher.is_error():
            raise GrammarError(f"grammar engine error: {_first_line(self._matcher.get_error())}")


def allowed_many(states: Sequence[GrammarState], drafts: Sequence[Sequence[int]]) -> list[tuple[int, np.ndarray]]:
    """Return `state.allowed(d)` for each (state, d) pair, all masks filled in one engine call
    (the batch engine's verify step: one call for every request's rows)."""
    if len(states) != len(drafts):
        raise ValueError(f"{len(states)} states but {len(drafts)} draft lists")
    cuts, jobs, plain, offset = [], [], [], 0
    for state, ds in zip(states, drafts):
        ds = [int(t) for t in ds]
        # drafts past an EOS are never verified; the engine does not see EOS (see GrammarState)
        cut = len(ds) if state._ended else next((i for i, t in enumerate(ds) if t in state._eos), len(ds))
        cuts.append((ds, cut, offset))
        if not state._ended:
            (jobs if cut else plain).append((state._matcher, offset, ds[:cut]) if cut else (state._matcher, offset))
        offset += cut + 1
    words = (max(s.compiled.tokenizer.vocab_size for s in states) + 31) // 32 if states else 1
    bits = np.zeros((offset, words), dtype=np.int32)
    if jobs:
        llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(_executor(), jobs, bits)
    if plain:  # the draft-token fill refuses an empty draft list
        llguidance.numpy.fill_next_token_bitmask_par(_executor(), plain, bits)
    results = []
    for state, (ds, cut, start) in zip(states, cuts):
        if state._ended:
            results.append((0, state._eos_rows(1)))
            continue
        n = state._matcher.validate_tokens(ds[:cut])
        state._check(True)
        mask = state._unpack(bits[start:start + n + 1])
        if n == cut < len(ds) and ds[cut] < state.vocab_size and mask[-1, ds[cut]]:
            mask, n = np.concatenate([mask, state._eos_rows(1)]), n + 1  # the EOS draft is accepted
        results.append((n, mask))
    return results


def _unpack_rows(bits: np.ndarray, width: int, vocab_size: int) -> np.ndarray:
    """Return bool [rows, vocab_size] from llguidance's int32 bitmask rows (bit k of word w = token 32w+k)."""
    # allowed ids past the logits cannot be sampled anyway; padding ids past the tokenizer stay False
    keep = min(width, vocab_size)
    unpacked = np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), axis=1, count=keep, bitorder="little")
    if keep == vocab_size:
        return unpacked.view(bool)  # 0/1 bytes are valid bools: no copy
    mask = np.zeros((bits.shape[0], vocab_size), dtype=bool)
    mask[:, :keep] = unpacked.view(bool)
    return mask


def apply_mask(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Return a copy of logits [rows, vocab] with the tokens `mask` [rows, vocab] (bool) disallows
    set to -inf. Apply it before temperature/top-k/top-p, alike on target and draft rows."""
    _check_shapes("logits", logits, mask)
    return np.where(mask, logits, np.array(-np.inf, dtype=logits.dtype))


def mask_probs(probs: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Return probs [rows, vocab] restricted to `mask` [rows, vocab] and renormalized per row.

    A row that puts no mass on an allowed token (a draft's top-k cut them all) becomes uniform over
    the allowed tokens: any q is exact as long as the draft is sampled from the q returned here.
    """
    _check_shapes("probs", probs, mask)
    kept = np.where(mask, probs, 0).astype(probs.dtype, copy=False)
    total = kept.sum(axis=1, keepdims=True)
    empty = total[:, 0] <= 0
    if empty.any():
        kept[empty] = mask[empty]
        total[empty] = mask[empty].sum(axis=1, keepdims=True)
    return kept / total


def _check_shapes(name: str, values: np.ndarray, mask: np.ndarray) -> None:
    if values.ndim != 2 or mask.shape != values.shape:
        raise ValueError(f"{name} [rows, vocab] and mask must have one 2-D shape, got {values.shape} and {mask.shape}")
    if mask.dtype != bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    if not mask.any(axis=1).all():
        raise GrammarError(f"mask row {int(np.argmin(mask.any(axis=1)))} allows no token")
