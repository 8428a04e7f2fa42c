"""Mutation check: plant each known speculative-decoding bug in a scratch copy and prove the tests catch it.

`python tools/mutation_check.py` (or `make mutants`) copies the package sources and tests to a
scratch folder laid out as `specdec/<package>` (on PYTHONPATH, ahead of the editable install),
runs the selected tests once unmutated (they must pass), then for each mutant writes one text
patch into the copy, runs that mutant's tests with `-x`, and restores the file. A mutant is
killed when its tests fail; the check exits 1 if any mutant survived or could not be applied.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("specdec",)  # import path = file path: specdec.runtime.loop is specdec/runtime/loop.py
EXACTNESS = "tests/runtime/test_exactness.py"
ACCEPTANCE = "tests/runtime/test_acceptance.py"
SAMPLED_MODEL = EXACTNESS + "::test_sampled_speculative_matches_target_distribution[model-settings0-2]"
SAMPLED_MODEL_TOP_P = EXACTNESS + "::test_sampled_speculative_matches_target_distribution[model-settings1-3]"
SAMPLED_NGRAM = EXACTNESS + "::test_sampled_speculative_matches_target_distribution[ngram-settings2-2]"
GREEDY_MODEL = EXACTNESS + "::test_greedy_speculative_equals_target_only[model-llama]"
GREEDY_MODEL_CONCAT = EXACTNESS + "::test_greedy_speculative_equals_target_only[model-gpt2]"  # a sliced KV cache
DRAFTS_CONTINUE = EXACTNESS + "::test_model_drafts_are_the_draft_models_own_greedy_continuation"
DRAFT_CATCH_UP = EXACTNESS + "::test_draft_cache_catches_up_on_exactly_what_it_has_not_seen"
SELF_DRAFT = EXACTNESS + "::test_draft_equal_to_target_accepts_everything"
MAX_NEW_TOKENS = EXACTNESS + "::test_max_new_tokens_is_exact"
EOS_IN_BLOCK = EXACTNESS + "::test_eos_inside_an_accepted_block_ends_the_counts_there"
ATTENTION_PAD = "tests/exporter/test_attention_rows.py"
GREEDY_HEAD = "tests/runtime/test_greedy_head.py"
BINDING = "tests/runtime/test_session_binding.py"
DISTILL = "tests/distill/test_distill.py"
EAGLE = "tests/distill/test_eagle_runtime.py"
PHRASES = "tests/runtime/test_phrases.py"
CALL_COSTS = "tests/runtime/test_call_costs.py"
DRAFT_LENGTH = "tests/runtime/test_draft_length.py"
STRUCTURED = "tests/runtime/test_structured.py"
GREEDY_GRAMMAR = (STRUCTURED + "::test_greedy_constrained_text_is_the_same_with_every_drafter_and_validates"
                  "[The quick brown fox]")
SAMPLED_GRAMMAR = STRUCTURED + "::test_sampled_constrained_speculation_has_the_masked_target_distribution[model-spec0]"
PREDICTION = "tests/runtime/test_prediction.py"
LOGPROBS = "tests/runtime/test_logprobs.py"
PREFIX_STRESS = "tests/runtime/test_prefix_cache_stress.py"


@dataclass(frozen=True)
class Mutant:
    """One known bug as a text patch: `old` must occur exactly once in `path`."""

    name: str  # the bug, in words
    path: str  # source file, relative to the repository root
    old: str
    new: str
    tests: tuple[str, ...]  # pytest selectors that must fail on it (run in this order, -x)


# Rows of one shape by design: a data table, one planted bug per entry, nothing shared to factor out.
MUTANTS: tuple[Mutant, ...] = (
    Mutant("residual p - p", "specdec/runtime/acceptance.py",
           "residual = np.maximum(p - q, 0.0)", "residual = np.maximum(p - p, 0.0)", (ACCEPTANCE,)),
    Mutant("residual from the unprocessed q (draft's raw softmax rows)", "specdec/runtime/drafters.py",
           "                rows.append(q)",
           "                rows.append(process_logits(logits[None, :], SamplingConfig(temperature=1.0))[0])",
           (SAMPLED_MODEL, SAMPLED_MODEL_TOP_P)),
    Mutant("only q(x) kept instead of the q row", "specdec/runtime/acceptance.py",
           "            q = draft_probs[i]",
           "            q = np.where(np.arange(p.size) == token, draft_probs[i], 0.0)", (ACCEPTANCE,)),
    Mutant("temperature/top-k/top-p on p but not on q (draft sampled raw)", "specdec/runtime/drafters.py",
           "                token = sample_token(q, self.rng)",
           "                token = sample_token(process_logits(logits[None, :], SamplingConfig(temperature=1.0))[0],"
           " self.rng)",
           (SAMPLED_MODEL, SAMPLED_MODEL_TOP_P)),
    Mutant("top-k/top-p on q but not on p (verify keeps temperature only)", "specdec/runtime/loop.py",
           "    target_probs = process_logits(logits, sampling, seen, proposal.mask)",
           "    target_probs = process_logits(logits, SamplingConfig(temperature=sampling.temperature), seen,"
           " proposal.mask)",
           (SAMPLED_NGRAM, SAMPLED_MODEL)),
    Mutant("bonus token from the residual", "specdec/runtime/acceptance.py",
           "    return Verdict(k, sample_token(target_probs[k], rng), is_bonus=k > 0)",
           "    last_q = ((np.eye(target_probs.shape[1])[draft_tokens[-1]] if draft_probs is None else draft_probs[-1])\n"
           "              if k else np.zeros(target_probs.shape[1]))\n"
           "    return Verdict(k, sample_token(residual_distribution(target_probs[k], last_q), rng), is_bonus=k > 0)",
           (ACCEPTANCE,)),
    Mutant("one-hot draft accepted with probability p(x)/2", "specdec/runtime/acceptance.py",
           "q_token = 1.0 if draft_probs is None", "q_token = 2.0 if draft_probs is None", (ACCEPTANCE,)),
    Mutant("one-hot draft accepted with probability min(1, 2 p(x))", "specdec/runtime/acceptance.py",
           "q_token = 1.0 if draft_probs is None", "q_token = 0.5 if draft_probs is None", (ACCEPTANCE,)),
    Mutant("batched call: every row reads the first row's logits", "specdec/runtime/batch_calls.py",
           "logits[r.slot - first][None, :]", "logits[0][None, :]",
           ("tests/runtime/test_batch.py::test_greedy_under_load_equals_each_prompts_own_target_only_output",)),
    Mutant("a shadow draft counted as all accepted", "specdec/runtime/batch_request.py",
           "self.record.observe(len(shadow.tokens), shadow.matched)",
           "self.record.observe(len(shadow.tokens), len(shadow.tokens))",
           ("tests/runtime/test_batch.py::test_lookup_drafts_the_plan_leaves_unverified_still_teach_each_requests_record",)),
    Mutant("target KV rollback keeps one position too many", "specdec/runtime/loop.py",
           "cache.rollback(len(state.context) + verdict.num_accepted)",
           "cache.rollback(min(len(state.context) + verdict.num_accepted + 1, cache.length))", (GREEDY_MODEL,)),
    Mutant("target KV rollback drops one position too many", "specdec/runtime/loop.py",
           "cache.rollback(len(state.context) + verdict.num_accepted)",
           "cache.rollback(len(state.context) + verdict.num_accepted - 1)", (GREEDY_MODEL,)),
    Mutant("concat KV crop keeps one position too many", "specdec/runtime/kv_cache.py",
           'binding.bind_cpu_input("keep", np.array([keep], dtype=np.int64))',
           'binding.bind_cpu_input("keep", np.array([keep + 1], dtype=np.int64))', (GREEDY_MODEL_CONCAT,)),
    Mutant("concat KV crop drops one position too many", "specdec/runtime/kv_cache.py",
           'binding.bind_cpu_input("keep", np.array([keep], dtype=np.int64))',
           'binding.bind_cpu_input("keep", np.array([keep - 1], dtype=np.int64))', (GREEDY_MODEL_CONCAT,)),
    Mutant("draft KV rollback keeps one position too many", "specdec/runtime/drafters.py",
           "        self.cache.rollback(valid)", "        self.cache.rollback(min(valid + 1, len(cached)))",
           (DRAFTS_CONTINUE, GREEDY_MODEL)),
    Mutant("draft KV rollback drops one position too many", "specdec/runtime/drafters.py",
           "        self.cache.rollback(valid)", "        self.cache.rollback(max(valid - 1, 0))", (DRAFT_CATCH_UP,)),
    Mutant("overshooting max_new_tokens (K not capped by what is left)", "specdec/runtime/loop.py",
           "request.max_new_tokens - state.generated - 1,", "request.max_new_tokens - state.generated,",
           (MAX_NEW_TOKENS,)),
    Mutant("overshooting max_new_tokens (stops one token late)", "specdec/runtime/loop.py",
           "elif generated >= request.max_new_tokens:", "elif generated > request.max_new_tokens:",
           (MAX_NEW_TOKENS,)),
    Mutant("acceptance rate counting bonus tokens (in accepted)", "specdec/runtime/stats.py",
           "self.accepted += iteration.num_accepted", "self.accepted += iteration.num_accepted + int(iteration.is_bonus)",
           (SELF_DRAFT,)),
    Mutant("acceptance rate counting bonus tokens (in the rate)", "specdec/runtime/stats.py",
           "return ratio(self.accepted, self.drafted)", "return ratio(self.accepted + self.bonus_tokens, self.drafted)",
           (SELF_DRAFT,)),
    Mutant("accepted count past EOS", "specdec/runtime/loop.py",
           "committed=iteration.committed[: index + 1], num_accepted=index + 1,",
           "committed=iteration.committed[: index + 1], num_accepted=iteration.num_accepted,",
           (EOS_IN_BLOCK,)),
    Mutant("reused IO binding keeps the KV buffers a grown cache replaced", "specdec/runtime/session.py",
           "        if self._bound_kv is tensors:", "        if self._bound_kv is not None:",
           (BINDING + "::test_reused_binding_follows_growth_rollback_and_reuse",)),
    Mutant("min_rows padding: the throwaway row's logits returned", "specdec/runtime/row_plan.py",
           "kept = np.arange(out_rows - pad - rows, out_rows - pad)",
           "kept = np.arange(out_rows - rows, out_rows)",
           (BINDING + "::test_min_rows_pads_one_token_calls_and_changes_no_logit",)),
    Mutant("hidden prefill: the LM head's rows read as if it started at the first kept row", "specdec/runtime/row_plan.py",
           "logits_at=_first(kept - head_start)", "logits_at=_first(kept)",
           (GREEDY_HEAD + "::test_a_hidden_prefill_runs_the_lm_head_on_the_kept_rows_only",)),
    Mutant("tapped graph: the LM head's row start left at the first kept row", "specdec/runtime/session.py",
           "binding.bind_cpu_input(spec.head_row_start_name, np.array([plan.head_start], np.int64))",
           "binding.bind_cpu_input(spec.head_row_start_name, np.array([0], np.int64))",
           (DISTILL + "::test_a_hidden_call_computes_only_the_logits_rows_asked_for",)),
    Mutant("attention pad: its position not reserved in the KV buffer", "specdec/runtime/session.py",
           "cache.reserve(plan.total_length + self.spec.attention_pad_rows)", "cache.reserve(plan.total_length)",
           (ATTENTION_PAD + "::test_padded_steps_equal_verify_rows_to_the_bit",)),
    Mutant("greedy head: the bound leaves out the hidden state's int8 error", "specdec/runtime/greedy_head.py",
           "return ((BOUND_MARGIN * (h_error + KERNEL_SLACK * h_norm)).astype(np.float32),",
           "return ((BOUND_MARGIN * (KERNEL_SLACK * h_norm)).astype(np.float32),",
           (GREEDY_HEAD + "::test_bound_covers_int8_activations_and_weights_and_keeps_the_argmax",)),
    Mutant("greedy head: near-top prefilter one bound too narrow", "specdec/runtime/greedy_head.py",
           "near = np.flatnonzero(approx_row >= approx_row.max() - 2 * widest)",
           "near = np.flatnonzero(approx_row >= approx_row.max() - widest)",
           (GREEDY_HEAD + "::test_near_top_candidates_are_argmax_candidates",)),
    Mutant("eagle draft: q rows returned unprocessed (temperature/top-k/top-p on the draw, not on q)", "specdec/runtime/eagle.py",
           "                rows.append(q)",
           "                rows.append(process_logits(self.head.full_logits(logits[None]), SamplingConfig(1.0))[0])",
           (EAGLE + "::test_sampled_q_is_zero_outside_the_subset_and_processed_like_p",
            EAGLE + "::test_sampled_with_the_eagle_drafter_has_the_target_distribution")),
    Mutant("eagle draft: the subset's index proposed instead of its token id", "specdec/runtime/eagle.py",
           "token = int(self.head.subset[int(np.argmax(logits))])", "token = int(np.argmax(logits))",
           (EAGLE + "::test_greedy_drafts_are_the_subsets_token_ids",)),
    Mutant("eagle draft: drafted pairs left in its KV cache after the verify", "specdec/runtime/eagle.py",
           "        self.key = self.key[:, :, : self.length]\n", "",
           (EAGLE + "::test_pairs_positions_and_rollback",)),
    Mutant("phrase table: a stop mark passed over for a shorter context", "specdec/runtime/phrases.py",
           "            if token is not None:\n                return token",
           "            if token is not None and token != STOP:\n                return token",
           (PHRASES,)),
    Mutant("phrase table: followers kept without the share threshold", "specdec/runtime/phrases.py",
           "times >= config.min_count and times >= config.min_share * sum(counts.values())",
           "times >= config.min_count", (PHRASES,)),
    Mutant("n-gram drafter: the phrase table proposes over a 2+-token match in the context", "specdec/runtime/drafters.py",
           "if self.phrases is None or self.index.match_length() >= 2:",
           "if self.phrases is None:",
           (PHRASES + "::test_drafter_copies_from_the_context_first_and_falls_back_on_the_table",)),
    Mutant("distill training: a run that slows late keeps its last step (the deadline cuts its cosine)",
           "specdec/exporter/distill/train.py", "and (replanned < state.planned_steps or early)):", "and early):",
           (DISTILL + "::test_a_deadline_run_replans_as_the_machine_speeds_up_or_slows_down",)),
    Mutant("distill data: sampled answers drawn without the temperature", "specdec/exporter/distill/data.py",
           "cdf = torch.softmax(scores.float() / self.temperature, dim=-1).cumsum(-1)",
           "cdf = torch.softmax(scores.float(), dim=-1).cumsum(-1)",
           (DISTILL + "::test_the_data_sampler_draws_from_the_tempered_distribution",)),
    Mutant("distill data: kept greedy choices one step late", "specdec/exporter/distill/data.py",
           "greedy = torch.cat([prompt_choices, chosen[row, : keep + 1]])",
           "greedy = torch.cat([prompt_choices, chosen[row, 1: keep + 2]])",
           (DISTILL + "::test_features_kept_from_decoding_equal_a_teacher_forced_pass",)),
    Mutant("auto: a call length timed slow once stays dear (its times never go stale)", "specdec/runtime/call_costs.py",
           "return last is not None and calls - last < self.fresh_calls", "return last is not None",
           (CALL_COSTS + "::test_a_length_not_called_for_a_while_is_timed_afresh",
            DRAFT_LENGTH + "::test_a_call_length_timed_slow_once_is_timed_again")),
    Mutant("auto: the cost table lifted to its running maximum instead of pooled", "specdec/runtime/call_costs.py",
           "            blocks[-1] = _pool(blocks[-1], last)",
           "            blocks[-1] = [_mean(blocks[-1]), float(\"inf\"), blocks[-1][2], last[3]]",
           (CALL_COSTS + "::test_one_slow_length_does_not_make_every_longer_call_dear",)),
    Mutant("auto: the loop's own timings ignored when it makes no 1-token calls", "specdec/runtime/call_costs.py",
           "if one_token is None and trusted:", "if False:",
           (CALL_COSTS + "::test_a_drafter_that_always_drafts_still_times_its_calls",)),
    Mutant("grammar mask applied to p only: the draft model samples q without it", "specdec/runtime/drafters.py",
           "            mask = grammar_row(self.grammar, tokens)\n", "            mask = None\n",
           (SAMPLED_GRAMMAR,)),
    Mutant("grammar matcher not rolled back after a rejection (advanced over every draft)", "specdec/runtime/loop.py",
           "_timed(state.grammar.advance, iteration.committed)",
           "_timed(state.grammar.advance, drafts + iteration.committed[iteration.num_accepted:])",
           (GREEDY_GRAMMAR,)),
    Mutant("grammar-forced drafts verified without the mask (the target can reject them)", "specdec/runtime/loop.py",
           "None if proposal.probs is None else proposal.probs[:n], mask)",
           "None if proposal.probs is None else proposal.probs[:n], None if states[i].forced else mask)",
           (GREEDY_GRAMMAR,)),
    Mutant("prediction drafts accepted without the target's test", "specdec/runtime/loop.py",
           "    verdict = _verify(state.context, proposal, logits, request.sampling, state.rng)  # 3. accept\n",
           "    verdict = _verify(state.context, proposal, logits, request.sampling, state.rng)  # 3. accept\n"
           "    if situation == \"prediction\":\n"
           "        verdict = Verdict(len(drafts), next_token(logits[len(drafts)], request.sampling, state.rng,\n"
           "                                                 state.context + drafts), bool(drafts))\n",
           (PREDICTION + "::test_greedy_output_is_the_same_with_any_prediction_and_counts_follow_openai",)),
    Mutant("logprobs of an accepted draft read from q instead of p", "specdec/runtime/loop.py",
           "    logprobs = _logprobs(request, logits, committed, state.context, drafts, proposal.mask)\n",
           "    logprobs = _logprobs(request, logits, committed, state.context, drafts, proposal.mask)\n"
           "    if logprobs is not None and verdict.num_accepted:\n"
           "        q = proposal.probs if proposal.probs is not None else np.eye(logits.shape[1])[drafts]\n"
           "        k = verdict.num_accepted\n"
           "        logprobs.chosen[:k] = np.log(q[np.arange(k), drafts[:k]])\n",
           (LOGPROBS + "::test_logprobs_agree_with_and_without_drafts[tiny_self_draft_artifact-model-settings0]",)),
    Mutant("prefix cache lends a position a query computed as its lone or block-tail last row", "specdec/runtime/slots.py",
           "cache.exact = cache.length - (0 if last_row(rows) == AMONG else 1)", "cache.exact = cache.length",
           (PREFIX_STRESS + "::test_a_prompt_reusing_a_prefix_up_to_a_query_of_32m_plus_1_rows_gets_the_fresh_logprobs"
            "[97-97-200-96]",)),
    Mutant("an ITL-bound step cuts a prompt where its query's last row rounds otherwise", "specdec/runtime/batch_chunks.py",
           "        return last_row(end - start) == AMONG and (",
           "        return True or last_row(end - start) == AMONG and (",
           (PREFIX_STRESS + "::test_every_granule_cut_of_an_itl_bound_step_computes_each_position_as_a_fresh_prefill"
            "_does",)),
    Mutant("idle re-prefill lends the whole kept reply after its first piece", "specdec/runtime/slots.py",
           "            cache.exact = end\n", "            cache.exact = len(kept)\n",
           (PREFIX_STRESS + "::test_an_idle_engine_reprefills_a_reply_of_1_token_steps_so_the_next_turn_reuses_it[3]",)),
    Mutant("idle re-prefill ends a piece in a lone row", "specdec/runtime/batch_chunks.py",
           "    start = exact if kept - exact >= 2 else kept - 2\n", "    start = exact\n",
           (PREFIX_STRESS + "::test_reprefill_pieces_cover_what_is_not_exact_in_queries_whose_every_row_is_among_others",)),
    Mutant("echo's prompt logprobs read each token from its own row instead of the row before", "specdec/runtime/prompt_logprobs.py",
           "parts.append(token_logprobs(logits, scored[start:start + len(fed)],",
           "parts.append(token_logprobs(logits, prompt_ids[start:start + len(fed)],",
           (LOGPROBS + "::test_prompt_logprobs_are_the_generations_own_at_the_same_positions_in_chunks_of_any_size",)),
)


class MutationError(Exception):
    """A mutant's patch does not apply to the current source."""


def apply(source: str, mutant: Mutant) -> str:
    """Return `source` with the mutant's `old` text replaced; raise MutationError unless it occurs exactly once."""
    count = source.count(mutant.old)
    if count != 1:
        raise MutationError(f"{mutant.name}: {mutant.path} holds the patched text {count} times, not once "
                            f"(update tools/mutation_check.py after a refactor): {mutant.old!r}")
    return source.replace(mutant.old, mutant.new)


def check_patches(root: Path = ROOT) -> list[str]:
    """Return one problem line per mutant whose patch no longer applies, or does not compile (empty: all apply)."""
    problems = []
    for mutant in MUTANTS:
        try:
            mutated = apply((root / mutant.path).read_text(), mutant)
            compile(mutated, mutant.path, "exec")
        except (MutationError, SyntaxError) as err:
            problems.append(str(err))
        for selector in mutant.tests:
            if not (root / selector.split("::")[0]).is_file():
                problems.append(f"{mutant.name}: no test file {selector.split('::')[0]}")
    return problems


def extract_commit(root: Path, ref: str, dest: Path) -> Path:
    """Return `dest` holding the sources and tests of commit `ref` (git archive), for a check of what is committed."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", ref, *PACKAGES, "tests",
                              "pyproject.toml"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def make_scratch(root: Path, scratch: Path) -> None:
    """Copy the package sources of `root` to scratch/specdec and its tests to scratch/tests."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "out")
    for name in PACKAGES:
        shutil.copytree(root / name, scratch / name, ignore=ignore)
    shutil.copytree(root / "tests", scratch / "tests", ignore=ignore)
    shutil.copy2(root / "pyproject.toml", scratch / "pyproject.toml")  # pytest's markers and options


def scratch_env(scratch: Path, artifact_cache: Path) -> dict[str, str]:
    """Return the environment that makes `specdec.*` resolve to the scratch copy."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(scratch) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a restored file of the same size and second must not hit a stale .pyc
    env["SPECDEC_TEST_ARTIFACT_CACHE"] = str(artifact_cache)  # export the tiny artifacts once, not per mutant
    return env


def imported_from(scratch: Path, env: dict[str, str], module: str) -> Path:
    """Return the file `module` is imported from under `env` (to prove the tests see the scratch copy)."""
    out = subprocess.run([sys.executable, "-c", f"import {module} as m; print(m.__file__)"], cwd=scratch, env=env,
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


@dataclass
class Outcome:
    """What one pytest run on one mutant (or the baseline) gave."""

    name: str
    status: str  # "killed", "survived", "broken" (no test ran or pytest errored), "timeout", "passed" (baseline)
    seconds: float
    failed: list[str]  # the failing test ids


def run_tests(scratch: Path, env: dict[str, str], selectors: tuple[str, ...], timeout: float) -> tuple[int | None, str]:
    """Return (pytest exit code, its output tail); code None on timeout."""
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-rf", "-p", "no:cacheprovider", *selectors]
    try:
        done = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, ""
    return done.returncode, done.stdout + done.stderr


def _failed(output: str) -> list[str]:
    return re.findall(r"^FAILED (\S+)", output, flags=re.MULTILINE)


def run_mutant(scratch: Path, env: dict[str, str], mutant: Mutant, timeout: float) -> Outcome:
    """Return the outcome of `mutant`'s tests with the mutant applied; the file is restored afterwards."""
    path = scratch / mutant.path
    original = path.read_text()
    path.write_text(apply(original, mutant))
    start = time.perf_counter()
    try:
        code, output = run_tests(scratch, env, mutant.tests, timeout)
    finally:
        path.write_text(original)
    seconds = time.perf_counter() - start
    if code is None:
        return Outcome(mutant.name, "timeout", seconds, [])
    failed = _failed(output)
    # pytest exit 1: tests ran and some failed; 0: all passed; anything else (usage, collection
    # error, no tests) means the mutant was not judged by its tests.
    status = {0: "survived", 1: "killed" if failed else "broken"}.get(code, "broken")
    return Outcome(mutant.name, status, seconds, failed)


def format_table(outcomes: list[Outcome]) -> str:
    """Return the outcomes as a Markdown table."""
    lines = ["| mutant | result | seconds | first failing test |", "|---|---|---:|---|"]
    for o in outcomes:
        lines.append(f"| {o.name} | {o.status} | {o.seconds:.0f} | {o.failed[0] if o.failed else ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the check; return 0 when every mutant is killed, 1 otherwise, 2 when the baseline fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="Run only mutants whose name contains TEXT (repeatable).")
    parser.add_argument("--list", action="store_true", help="List the mutants and their tests, run nothing.")
    parser.add_argument("--no-baseline", action="store_true",
                        help="Skip the unmutated run (only when the tests are known to pass on this tree).")
    parser.add_argument("--artifact-cache", type=Path, default=None,
                        help="Folder to keep the tiny test artifacts in across runs (default: a temporary one).")
    parser.add_argument("--ref", default=None, metavar="COMMIT",
                        help="Check this commit's sources and tests (git archive) instead of the working tree.")
    parser.add_argument("--keep", action="store_true", help="Keep the scratch folder and print its path.")
    parser.add_argument("--timeout", type=float, default=300.0, help="Seconds per pytest run before it counts as "
                        "a timeout (default: 300).")
    parser.add_argument("--json", action="store_true", help="Print the outcomes as one JSON object.")
    args = parser.parse_args(argv)

    mutants = [m for m in MUTANTS if not args.only or any(text in m.name for text in args.only)]
    if args.list:
        for m in mutants:
            print(f"{m.name}\n    {m.path}: {m.old!r} -> {m.new!r}\n    tests: {' '.join(m.tests)}")
        return 0
    if not mutants:
        print("error: no mutant matches --only", file=sys.stderr)
        return 1

    scratch = Path(tempfile.mkdtemp(prefix="specdec-mutants-"))
    artifact_cache = args.artifact_cache or scratch / "artifacts"
    artifact_cache.mkdir(parents=True, exist_ok=True)
    try:
        try:
            source = extract_commit(ROOT, args.ref, scratch / "commit") if args.ref else ROOT
        except subprocess.CalledProcessError as err:
            print(f"error: cannot read commit {args.ref!r}: {err.stderr.decode().strip()}", file=sys.stderr)
            return 1
        problems = check_patches(source)
        if problems:
            for problem in problems:
                print(f"error: {problem}", file=sys.stderr)
            return 1
        make_scratch(source, scratch)
        env = scratch_env(scratch, artifact_cache)
        seen = imported_from(scratch, env, "specdec.runtime.acceptance")
        if scratch not in seen.parents:
            print(f"error: the tests would import {seen}, not the scratch copy in {scratch}", file=sys.stderr)
            return 2
        outcomes = []
        if not args.no_baseline:
            whole = {s for m in mutants for s in m.tests if "::" not in s}  # a file run whole covers its nodes
            selectors = tuple(dict.fromkeys(s for m in mutants for s in m.tests if s.split("::")[0] not in whole
                                            or "::" not in s))
            print(f"baseline: {len(selectors)} test selections, unmutated ...", file=sys.stderr, flush=True)
            start = time.perf_counter()
            code, output = run_tests(scratch, env, selectors, args.timeout * 3)
            if code != 0:
                print(output[-4000:] if output else "timeout", file=sys.stderr)
                print("error: the tests fail without any mutant: fix them first", file=sys.stderr)
                return 2
            print(f"baseline passed in {time.perf_counter() - start:.0f}s", file=sys.stderr, flush=True)
        for i, mutant in enumerate(mutants, start=1):
            print(f"[{i}/{len(mutants)}] {mutant.name} ...", file=sys.stderr, flush=True)
            outcome = run_mutant(scratch, env, mutant, args.timeout)
            print(f"    {outcome.status} in {outcome.seconds:.0f}s {' '.join(outcome.failed[:1])}", file=sys.stderr,
                  flush=True)
            outcomes.append(outcome)
    finally:
        if args.keep:
            print(f"scratch kept in {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    killed = sum(o.status == "killed" for o in outcomes)
    if args.json:
        print(json.dumps({"killed": killed, "total": len(outcomes), "mutants": [asdict(o) for o in outcomes]},
                         indent=2))
    else:
        print(format_table(outcomes))
        print(f"\n{killed} of {len(outcomes)} mutants killed")
    return 0 if killed == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
