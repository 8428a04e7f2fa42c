"""`specdec phrases`: count the target's own usual continuations into the artifact (specdec/runtime/phrases.py).

The target (PyTorch, the export extra) answers shipped prompts greedily until the budget runs
out; the answers are counted into a phrase table, checked on answers to held-out prompts
(topics no counted prompt has), and written into the artifact: the table file first, then
the manifest (the commit point), so a failed or interrupted run leaves the artifact as it was.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from specdec.models.errors import ExportError
from specdec.models.manifest import MANIFEST_FILENAME, Manifest, PhraseTableSpec, load_manifest, sha256_of_file
from specdec.runtime.phrases import PhraseTable, PhraseTableConfig
from specdec.runtime.prompts import load_prompts

Progress = Callable[[str], None]
HELDOUT_PROMPTS = 16  # answered after the counted ones, to say how often the table is right on new topics


@dataclass(frozen=True)
class PhrasesConfig:
    """One `specdec phrases` run."""

    artifact: Path
    minutes: float = 10.0  # the whole run: loading, answering, counting, the held-out check
    seed: int = 0  # the order of the shipped prompts
    prompts: int | None = None  # prompts to answer; None: as many as the budget allows
    prompts_file: Path | None = None  # JSON lines with a "prompt" each, answered instead of the shipped prompts
    max_new_tokens: int = 160  # longest answer per prompt
    batch_size: int = 64  # prompts answered at once
    threads: int | None = None  # PyTorch's CPU threads; None: its default
    table: PhraseTableConfig = field(default_factory=PhraseTableConfig)


def heldout_hits(table: PhraseTable, answers: list[list[int]]) -> dict[str, float]:
    """Return how the table fares on answers it was not counted from.

    proposes: share of positions (after an answer's first token) where it proposes anything;
    first_right: share of those proposals whose first token is the one the target wrote;
    tokens_right_per_proposal: mean length of the right prefix of a proposal of up to 4 tokens.
    """
    proposals = right = prefix = positions = 0
    for answer in answers:
        for end in range(1, len(answer)):
            positions += 1
            proposal = table.propose(answer[:end], 4)
            if not proposal:
                continue
            proposals += 1
            run = 0
            while run < len(proposal) and end + run < len(answer) and proposal[run] == answer[end + run]:
                run += 1
            right += run > 0
            prefix += run
    return {"positions": positions, "proposes": proposals / max(positions, 1),
            "first_right": right / max(proposals, 1), "tokens_right_per_proposal": prefix / max(proposals, 1)}


def check_config(config: PhrasesConfig) -> Manifest:
    """Return the artifact's manifest; raise ExportError for a run that cannot work, before any slow step."""
    if not config.minutes > 0:
        raise ExportError(f"--minutes must be > 0, got {config.minutes}")
    if config.prompts is not None and config.prompts < 1:
        raise ExportError(f"--prompts must be >= 1, got {config.prompts}")
    if config.table.max_n < 1 or config.table.min_count < 1 or not 0.0 <= config.table.min_share <= 1.0:
        raise ExportError(f"need max_n >= 1, min_count >= 1 and 0 <= min_share <= 1, got {config.table}")
    manifest = load_manifest(config.artifact)
    if config.prompts_file is not None:
        load_prompts(config.prompts_file)  # a bad file is refused before the slow steps
    return manifest


def _prompts(config: PhrasesConfig) -> tuple[list[str], str]:
    """Return the prompts to answer, in order, and how the manifest names them."""
    from specdec.exporter.distill.prompts import training_prompts

    if config.prompts_file is not None:
        prompts = [case.prompt for case in load_prompts(config.prompts_file)]
        return prompts[: config.prompts or len(prompts)], f"{Path(config.prompts_file).name}, greedy answers"
    return (training_prompts(config.prompts or 1_000_000, config.seed),
            "specdec.exporter.distill.prompts.training_prompts (templates x topics), greedy answers")


def build_phrases(config: PhrasesConfig, progress: Progress = print) -> Manifest:
    """Count the target's answers into a phrase table and write it into the artifact; return the new manifest.

    Raises ExportError (or another SpecdecError) on bad input; the artifact is unchanged unless the run completes.
    """
    manifest = check_config(config)  # before the slow imports: bad input is refused at once
    import torch

    from specdec.exporter.distill.data import generate_answers, generator_dtype, use_grouped_attention
    from specdec.exporter.distill.prompts import heldout_prompts
    from specdec.exporter.sources import load_source

    start = time.monotonic()
    artifact = Path(config.artifact)
    if config.threads:
        torch.set_num_threads(config.threads)
    with tempfile.TemporaryDirectory(prefix="specdec-phrases-") as scratch:
        progress(f"target: loading {manifest.target.source} into PyTorch")
        loaded = load_source(manifest.target.source, Path(scratch) / "target", False, manifest.target.revision)
        # As `specdec distill` makes its data: bf16 where the CPU has it natively, grouped-query decode steps.
        dtype = generator_dtype("auto", "cpu")
        model, tokenizer = loaded.model.to(dtype).eval(), loaded.tokenizer
        use_grouped_attention(model)
        eos = list(manifest.tokenizer.eos_token_ids)
        # The held-out check gets a share of the budget, after the counted answers.
        deadline = start + 0.85 * config.minutes * 60
        prompts, source = _prompts(config)
        with torch.inference_mode():
            counted = generate_answers(
                model, tokenizer, prompts, eos, config.max_new_tokens, 0.0, config.batch_size, config.seed,
                deadline=None if config.prompts else deadline,
                progress=lambda n, tokens: progress(f"answers: {n} prompts, {tokens} tokens, "
                                                    f"{time.monotonic() - start:.0f} s"))
            if not counted:
                raise ExportError(f"--minutes {config.minutes:g} left no time to answer a single batch of prompts")
            heldout = generate_answers(model, tokenizer, heldout_prompts(HELDOUT_PROMPTS, config.seed), eos,
                                       config.max_new_tokens, 0.0, HELDOUT_PROMPTS, config.seed)
    answers = [answer for _, answer in counted]
    table = PhraseTable.count(answers, config.table)
    check = heldout_hits(table, [answer for _, answer in heldout])
    tokens = sum(len(a) for a in answers)
    progress(f"table: {len(table.followers)} contexts from {len(answers)} answers ({tokens} tokens), "
             f"{table.confident_contexts()} with a confident follower; held-out answers: proposes at "
             f"{check['proposes']:.1%} of positions, first token right {check['first_right']:.1%}")
    built = {"answers": len(answers), "tokens": tokens, "minutes": round((time.monotonic() - start) / 60, 2),
             "seed": config.seed, "max_new_tokens": config.max_new_tokens,
             "prompts": source, "generator_dtype": str(dtype).removeprefix("torch."),
             "max_n": config.table.max_n, "min_count": config.table.min_count, "min_share": config.table.min_share,
             "contexts": len(table.followers), "confident_contexts": table.confident_contexts(),
             "heldout": check, "target_graph_sha256": manifest.target.sha256[manifest.target.graph_file]}
    return _write(artifact, manifest, table, built, progress)


def _write(artifact: Path, manifest: Manifest, table: PhraseTable, built: dict, progress: Progress) -> Manifest:
    """Write the table file, then the manifest naming it (the commit point); drop the table it replaces."""
    temporary = artifact / ".phrases.npz.tmp"
    try:
        table.save(temporary)
        digest = sha256_of_file(temporary)  # names the file and goes into the manifest: read once
        name = f"phrases-{digest[:12]}.npz"
        os.replace(temporary, artifact / name)
    finally:
        temporary.unlink(missing_ok=True)
    old_file = manifest.phrase_table.table_file if manifest.phrase_table else None
    updated = replace(manifest, phrase_table=PhraseTableSpec(files=[name], sha256={name: digest}, built=built))
    staged = artifact / (MANIFEST_FILENAME + ".tmp")
    try:
        staged.write_text(json.dumps(updated.to_dict(), indent=2) + "\n", encoding="utf-8")
        os.replace(staged, artifact / MANIFEST_FILENAME)
    except BaseException:
        staged.unlink(missing_ok=True)
        if old_file != name:
            (artifact / name).unlink(missing_ok=True)  # the old manifest does not name it
        raise
    if old_file is not None and old_file != name:
        (artifact / old_file).unlink(missing_ok=True)
    progress(f"wrote the phrase table into {artifact} ({name}); `specdec generate --drafter ngram` uses it")
    return updated
