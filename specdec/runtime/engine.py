"""The library API a service embeds: load an artifact once, generate from many threads."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from specdec.models.errors import ArtifactError, GenerationError
from specdec.models.manifest import Manifest, load_manifest
from specdec.runtime.calibration import calibrate
from specdec.runtime.config import AUTO_K_CAP, DEFAULT_DRAFT_TOKENS, GenerationConfig, check_token_ids
from specdec.runtime.call_costs import TargetCallCosts
from specdec.runtime.combined import CombinedDrafter
from specdec.runtime.draft_length import AdaptiveDraftLength, FixedDraftLength
from specdec.runtime.drafters import Drafter, ModelDrafter, NgramDrafter
from specdec.runtime.eagle import EagleDrafter, EagleHead
from specdec.runtime.grammar import CompiledGrammar, GrammarSpec, compile_grammar, grammar_tokenizer
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.logprobs import MAX_TOP_LOGPROBS, TokenLogprobs
from specdec.runtime.loop import MAX_DRAFT_ROOM, DecodeRequest, DecodeState, Iteration, decode
from specdec.runtime.phrases import PhraseTable
from specdec.runtime.prediction import PredictionDrafter
from specdec.runtime.prompt_logprobs import prompt_logprobs
from specdec.runtime.sampling import SamplingConfig
from specdec.runtime.providers import shared_pool, shared_pool_threads
from specdec.runtime.session import ModelSession
from specdec.runtime.stats import GenerationStats
from specdec.runtime.text import StopStringFilter, TextCodec, tokens_released
from specdec.runtime.timeline import FirstTokenTimeline


@dataclass
class GenerationResult:
    """What a generation produced."""

    text: str
    token_ids: list[int]  # generated ids (EOS included when it ended the generation)
    prompt_ids: list[int]
    finish_reason: str  # "eos", "length", "stop" (a stop string), "max_positions", or "cancelled"
    stats: GenerationStats


class GenerationStream:
    """Iterates over text pieces as tokens are committed; `result` is set once it is exhausted."""

    def __init__(self, make_pieces: Callable[["GenerationStream"], Iterator[str]],
                 on_cancel: Callable[[], None] | None = None, timeline: FirstTokenTimeline | None = None):
        self.result: GenerationResult | None = None
        # Generated tokens whose text the pieces so far carry (set before each piece; a stop string's held-back
        # text counts as carried): a streamed token's logprobs go out with the piece that holds it.
        self.tokens_in_text = 0
        self.timeline = timeline  # a batch engine's: where the wait for the first token went (None: single stream)
        self._cancelled = threading.Event()
        self._on_cancel = on_cancel
        # The generator fills in `result` of the stream it belongs to when it finishes.
        self._pieces = make_pieces(self)

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    @property
    def cancelled(self) -> bool:
        """Return whether cancel() was called."""
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop the request after the iteration it is on, from any thread (a request still waiting for a batch
        engine's slot is dropped before its prefill); the stream then ends with finish_reason "cancelled"."""
        self._cancelled.set()
        if self._on_cancel is not None:
            self._on_cancel()


class Engine:
    """A loaded artifact. Sessions are shared; each request makes its own caches, drafter and RNG."""

    def __init__(self, artifact_dir: Path, manifest: Manifest, provider: str, threads: int | None,
                 shared_threads: bool = False):
        self.artifact_dir = artifact_dir
        self.manifest = manifest
        self.codec = TextCodec(artifact_dir, manifest.tokenizer)
        vocab = manifest.tokenizer.vocab_size
        # A draft model (or head) and the target take turns: on one process-wide pool when asked
        # for, else the draft's threads must not busy-wait on the cores the target needs next
        # (docs/DESIGN.md, "Threads").
        # The same for the target's two graphs under the batch engine (plain steps, ragged-rows steps).
        if shared_threads and (manifest.draft or manifest.feature_draft or manifest.target.ragged_file):
            shared_pool(threads)
        self.shared_pool = shared_pool_threads()  # its size, if this process's sessions share one pool
        self.target = ModelSession(artifact_dir, manifest.target, provider, threads, vocab_limit=vocab)
        self.draft = (ModelSession(artifact_dir, manifest.draft, provider, threads, vocab_limit=vocab, spin=False)
                      if manifest.draft else None)
        if self.draft is not None and self.draft.vocab_limit != self.target.vocab_limit:
            # Padding rows differ: both sides sample from the vocabulary they share.
            shared = min(self.draft.vocab_limit, self.target.vocab_limit)
            self.draft.vocab_limit = self.target.vocab_limit = shared
        # `specdec distill`'s trained head; a head trained for another target is refused here, in one line.
        self.eagle = (EagleHead(artifact_dir, manifest.feature_draft, manifest.target, self.target.vocab_limit,
                                provider, threads) if manifest.feature_draft else None)
        if self.eagle is not None:
            self.target.feature_width = self.eagle.feature_width  # the batch engine binds the ragged graph's rows
        self.phrases = _load_phrases(artifact_dir, manifest, vocab)  # None: the artifact has no phrase table
        self.eos_token_ids = set(manifest.tokenizer.eos_token_ids)
        # One cost curve per engine, learned across requests: it is a fact of this machine and
        # model, and a single 128-token request is too short to time every call length.
        defaults = manifest.runtime_defaults
        self.target_call_costs = TargetCallCosts(
            prior=dict(enumerate(defaults.target_call_costs, start=1)),
            prior_verify_cost=defaults.verify_cost,
        )
        self.calibration_seconds = 0.0  # spent timing target calls for `auto` (once per engine)
        # Where t(n) came from: "tune" (the artifact), "cache" (an earlier process on this
        # machine), "timed" (this engine), None (not needed yet).
        self.call_costs_source: str | None = "tune" if self.target_call_costs.prior else None
        self.call_costs_cache_file: Path | None = None  # where a timed table was kept (None: not kept)
        self._threads = threads
        self._calibration_lock = threading.Lock()

    @classmethod
    def load(cls, artifact_dir: str | Path, provider: str = "auto", threads: int | None = None,
             check_files: bool = True, shared_threads: bool = False) -> "Engine":
        """Return an Engine for an artifact folder.

        provider: "auto" (CUDA when usable, else CPU), "cuda" or "cpu". check_files
        verifies every file's sha256 first. shared_threads: run a draft model or head and the
        target on onnxruntime's process-wide thread pool (faster drafting on few cores), which
        then serves every onnxruntime session of the process and makes onnxruntime refuse
        sessions that ask for their own pool: only for a process whose onnxruntime use is this
        engine's. Raises ArtifactError/ManifestError/GenerationError.
        """
        if threads is not None and threads < 1:
            raise GenerationError(f"threads must be >= 1 (None: all cores), got {threads}")
        folder = Path(artifact_dir)
        return cls(folder, load_manifest(folder, check_files=check_files), provider, threads, shared_threads)

    @property
    def provider(self) -> str:
        """Return the execution provider the target really runs on."""
        return self.target.provider

    @property
    def max_positions(self) -> int:
        """Return the longest sequence both models accept."""
        return min(s.spec.max_positions for s in (self.target, self.draft) if s is not None)

    @property
    def vocab_size(self) -> int:
        """Return how many token ids every model's embedding takes."""
        return min(s.spec.vocab_size for s in (self.target, self.draft) if s is not None)

    def prompt_ids(self, prompt: str, chat: bool = False) -> list[int]:
        """Return the token ids for a prompt, through the chat template when `chat`."""
        if chat:
            return self.codec.encode(self.codec.chat_prompt([{"role": "user", "content": prompt}]),
                                     add_special_tokens=False)
        return self.codec.encode(prompt)

    def generate(self, prompt: str | list[int], config: GenerationConfig = GenerationConfig(),
                 on_iteration: Callable[[Iteration], None] | None = None) -> GenerationResult:
        """Return the completion of `prompt` (text, or token ids) under `config`."""
        stream = self.stream(prompt, config, on_iteration)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def prompt_logprobs(self, prompt: str | list[int], top: int = 0) -> TokenLogprobs:
        """Return the log-probabilities of the prompt's tokens after its first (and `top` alternatives each), as the
        target reads them: one target pass over the prompt, no generation (specdec/runtime/prompt_logprobs.py)."""
        ids = self._fitting_ids(prompt)
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise GenerationError(f"top must be in 0..{MAX_TOP_LOGPROBS}, got {top}")
        return prompt_logprobs(self.target, ids, top)

    def stream(self, prompt: str | list[int], config: GenerationConfig = GenerationConfig(),
               on_iteration: Callable[[Iteration], None] | None = None,
               on_start: Callable[[], None] | None = None) -> GenerationStream:
        """Return a GenerationStream yielding text pieces as they are committed.

        The config is checked here, before anything runs, so bad settings raise at once. `on_start` is
        called when the request starts: here at once (a batch engine calls it when a slot takes the request).
        """
        ids = self.checked_prompt(prompt, config)
        if on_start is not None:
            on_start()
        return GenerationStream(lambda stream: self._pieces(ids, config, on_iteration, stream))

    def checked_prompt(self, prompt: str | list[int], config: GenerationConfig) -> list[int]:
        """Return the prompt's token ids after checking `config` and the prompt; raise GenerationError for bad ones."""
        config.validate()
        self.drafter_kind(config.drafter)  # an impossible drafter fails here, before anything runs
        predicted = () if isinstance(config.prediction, str) else config.prediction or ()
        for name, ids in (("stop_token_ids", config.stop_token_ids), ("logit_bias", [t for t, _ in config.logit_bias]),
                          ("prediction", predicted)):
            if any(token >= self.vocab_size for token in ids):
                raise GenerationError(f"{name}: token ids must be below the vocabulary size {self.vocab_size}")
        if config.grammar is not None:
            self.grammar(config.grammar)  # a malformed or unsupported grammar fails here, in one line
        return self._fitting_ids(prompt, config.chat)

    def _fitting_ids(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """Return the prompt's token ids (checked against the vocabulary, or encoded); raise GenerationError where
        they do not fit the model's positions."""
        ids = check_token_ids(prompt, self.vocab_size) if isinstance(prompt, list) else self.prompt_ids(prompt, chat)
        if len(ids) > self.max_positions:
            raise GenerationError(f"prompt of {len(ids)} tokens is too long for the model's {self.max_positions} "
                                  "positions")
        return ids

    def grammar(self, spec: GrammarSpec) -> CompiledGrammar:
        """Return `spec` compiled for this artifact's tokenizer (cached); raise GrammarError for a bad one."""
        eos = sorted(self.manifest.tokenizer.eos_token_ids)
        return compile_grammar(spec, grammar_tokenizer(self.codec.tokenizer, eos))

    def drafter_kind(self, requested: str) -> str:
        """Return the drafter `requested` ("auto", "model", "ngram" or "none") resolves to on this artifact.

        "auto" is what `specdec tune` stored, else the draft model if there is one, else n-gram.
        Raises GenerationError when "model" is asked of an artifact without a draft model.
        """
        if requested in ("model", "ngram+model") and self.draft is None:
            raise GenerationError("this artifact has no draft model; use drafter 'ngram' or 'none'")
        if requested in ("eagle", "ngram+eagle") and self.eagle is None:
            raise GenerationError("this artifact has no trained draft head; build one with `specdec distill`")
        if requested != "auto":
            return requested
        return self.manifest.runtime_defaults.drafter or ("model" if self.draft is not None else "ngram")

    def _drafter(self, config: GenerationConfig, rng: np.random.Generator, prompt_length: int, adaptive: bool,
                 sampling: SamplingConfig | None = None) -> Drafter | None:
        sampling = sampling or config.sampling_after(prompt_length)
        kind = self.drafter_kind(config.drafter)
        if config.prediction and kind != "none":
            # The prediction drafts where it has tokens to offer; prompt lookup (and phrases) where it has none.
            predicted = (self.codec.encode(config.prediction, add_special_tokens=False)
                         if isinstance(config.prediction, str) else list(config.prediction))
            return PredictionDrafter(predicted, self._lookup(config, adaptive))
        if kind == "none":
            return None
        if kind in ("eagle", "ngram+eagle") and self.eagle is not None:
            eagle = EagleDrafter(self.eagle, sampling, rng)
            if kind == "eagle":
                return eagle
            return CombinedDrafter(NgramDrafter(config.ngram_min_for(adaptive), config.ngram_max), eagle)
        if kind in ("model", "ngram+model") and self.draft is not None:
            model = ModelDrafter(self.draft, sampling, rng,
                                 capacity=prompt_length + config.max_new_tokens + MAX_DRAFT_ROOM)
            if kind == "model":
                return model
            return CombinedDrafter(NgramDrafter(config.ngram_min_for(adaptive), config.ngram_max), model)
        return self._lookup(config, adaptive)

    def _lookup(self, config: GenerationConfig, adaptive: bool) -> NgramDrafter:
        """Return a request's prompt-lookup drafter, with the artifact's phrase table where it has one and the
        request allows it."""
        return NgramDrafter(config.ngram_min_for(adaptive), config.ngram_max,
                            phrases=self.phrases if config.phrases else None)

    def _draft_length(self, config: GenerationConfig) -> tuple[FixedDraftLength | AdaptiveDraftLength, str]:
        k = config.num_draft_tokens
        if k is None:
            k = self.manifest.runtime_defaults.num_draft_tokens or DEFAULT_DRAFT_TOKENS
        if k == "auto":
            # A combined drafter serves situations at different costs (specdec/runtime/combined.py): one c each.
            combined = self.drafter_kind(config.drafter).startswith("ngram+")
            return AdaptiveDraftLength(max_k=config.auto_k_cap, call_costs=self.target_call_costs,
                                       cost_per_situation=combined), "auto"
        return FixedDraftLength(int(k)), str(k)

    def _timing_free(self, policy: AdaptiveDraftLength,
                     drafter: Drafter) -> tuple[FixedDraftLength | AdaptiveDraftLength, str]:
        """Return `policy` made to choose K from the request's own tokens only (GenerationConfig.reproducible):
        prompt lookup's over the calibrated call costs, frozen; a drafting model's (whose c is a timing) the
        artifact's fixed K."""
        if drafter.draft_model is None and drafter.draft_head is None:
            costs = self.target_call_costs
            policy.call_costs = TargetCallCosts(prior=dict(costs.prior), prior_verify_cost=costs.prior_verify_cost)
            policy.learns_timings = False
            return policy, "auto"
        k = self.manifest.runtime_defaults.num_draft_tokens
        k = k if isinstance(k, int) else DEFAULT_DRAFT_TOKENS
        return FixedDraftLength(k), str(k)

    def time_call_costs(self, max_draft_tokens: int = AUTO_K_CAP) -> str | None:
        """Get `-k auto`'s t(n) table ready now, so that no request waits for it: timed (seconds, once per
        machine), read from this machine's cache, or the artifact's own (`specdec tune`).

        Returns call_costs_source: "tune", "cache" or "timed".
        """
        # A chat prompt where the artifact has a template: what requests look like; else a plain one.
        self._calibrate_call_costs(self.prompt_ids("Hello", chat=self.codec.has_chat_template), max_draft_tokens + 1)
        return self.call_costs_source

    def _calibrate_call_costs(self, context: list[int], max_tokens: int) -> None:
        """Time target calls over 1..max_tokens tokens once per engine (or read them from the disk cache),
        when the artifact has no tuned t(n): `auto` guesses unseen lengths poorly (docs/DESIGN.md)."""
        with self._calibration_lock:
            if self.target_call_costs.prior:
                return
            calibration = calibrate(self.target, context, max_tokens, self._threads)
            self.target_call_costs.prior = calibration.call_costs
            self.calibration_seconds = calibration.seconds
            self.call_costs_source = calibration.source
            self.call_costs_cache_file = calibration.cache_file

    def open_request(self, ids: list[int], config: GenerationConfig) -> "OpenRequest":
        """Return a request's own decoding state (RNG, drafter, draft-length policy) and its stats, ready to run.

        Used by the thread-per-request path (`stream`) and the batch engine alike.
        """
        rng = np.random.default_rng(config.seed)
        policy, k_label = self._draft_length(config)
        sampling = config.sampling_after(len(ids))  # the draft processes its q rows exactly as the target its p
        drafter = self._drafter(config, rng, len(ids), isinstance(policy, AdaptiveDraftLength), sampling)
        if drafter is not None and isinstance(policy, AdaptiveDraftLength):
            self._calibrate_call_costs(ids, config.auto_k_cap + 1)  # before the request's clock starts
            if config.k_follows_tokens:
                policy, k_label = self._timing_free(policy, drafter)
        stats = GenerationStats(drafter=drafter.name if drafter else "none",
                                num_draft_tokens=k_label if drafter else "0", prompt_tokens=len(ids))
        request = DecodeRequest(ids, config.max_new_tokens, sampling,
                                frozenset(self.eos_token_ids) | frozenset(config.stop_token_ids),
                                self.max_positions, logprobs=config.logprobs)
        grammar = self.grammar(config.grammar).start(self.target.vocab_limit) if config.grammar else None
        for side in (drafter.draft_model, drafter.draft_head) if drafter is not None else ():
            if side is not None:
                side.grammar = grammar  # a sampling draft draws under the mask the target's rows get
        return OpenRequest(DecodeState(request, rng, drafter, policy if drafter else None, grammar=grammar), config,
                           stats)

    def _pieces(self, ids: list[int], config: GenerationConfig,
                on_iteration: Callable[[Iteration], None] | None, stream: GenerationStream) -> Iterator[str]:
        opened = self.open_request(ids, config)
        cache = self.target.new_cache(capacity=opened.state.request.cache_capacity)
        state = opened.state
        iterations = decode(self.target, cache, state.request, state.rng, state.drafter, state.policy, state.grammar)
        return self.text_pieces(opened, iterations, cache, on_iteration, stream)

    def text_pieces(self, opened: "OpenRequest", iterations: Iterator[Iteration], counters: KVCache,
                    on_iteration: Callable[[Iteration], None] | None, stream: GenerationStream) -> Iterator[str]:
        """Yield the text of `iterations` as it is committed (stop strings applied); set `stream.result` at the end.

        `counters` carries the request's onnxruntime time (run_seconds, rollback_seconds): its target
        cache, or what the batch engine copied off its slot. Closing this generator closes `iterations`
        (the loop stops at the iteration it was on).
        """
        stats, config, drafter = opened.stats, opened.config, opened.state.drafter
        decoder = self.codec.decode_stream()
        stop_filter = StopStringFilter(config.stop_strings)
        generated: list[int] = []
        # where each token's text ends in the stop filter's text (None: half a character so far): a piece released
        # while a stop string's first characters are held back holds only the tokens before them
        text_ends: list[int | None] = []
        finish = None
        start = time.perf_counter()
        try:
            for iteration in iterations:
                stats.add(iteration)
                if on_iteration:
                    on_iteration(iteration)
                for token in iteration.committed:
                    generated.append(token)
                    text = decoder.push(token)
                    piece = stop_filter.feed(text)
                    text_ends.append(len(stop_filter.text) if text else None)
                    if piece:
                        stream.tokens_in_text = tokens_released(text_ends, stop_filter.released,
                                                                stream.tokens_in_text)
                        yield piece
                    if stop_filter.stopped:
                        break
                if stop_filter.stopped:
                    finish = "stop"
                    break
                finish = iteration.finished
                if stream.cancelled and not finish:
                    break
            finish = finish or ("cancelled" if stream.cancelled else "length")  # "length": a shutdown's cut
        finally:
            iterations.close()
            stats.add_session_counters(counters, drafter.stats if drafter else None)
        tail = stop_filter.flush()
        if tail:
            stream.tokens_in_text = len(generated)
            yield tail
        stats.total_seconds = time.perf_counter() - start
        stats.new_tokens = len(generated)
        stream.result = GenerationResult(stop_filter.final_text, generated, opened.state.request.prompt_ids, finish,
                                         stats)


@dataclass
class OpenRequest:
    """A request ready to decode: its loop state, its config, and the stats its iterations add to."""

    state: DecodeState
    config: GenerationConfig
    stats: GenerationStats


def _load_phrases(artifact_dir: Path, manifest: Manifest, vocab_size: int) -> PhraseTable | None:
    """Return the artifact's phrase table (None: it has none); raise ArtifactError for an unreadable one."""
    if manifest.phrase_table is None:
        return None
    path = Path(artifact_dir) / manifest.phrase_table.table_file
    try:
        return PhraseTable.load(path, vocab_size)
    except ValueError as err:
        raise ArtifactError(f"phrase table '{manifest.phrase_table.table_file}' cannot be read: {err}; "
                            "rebuild it with `specdec phrases`") from None
