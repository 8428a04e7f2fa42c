"""`specdec distill`: train a draft head for an artifact's target and write it into the artifact."""

from __future__ import annotations

import os
from pathlib import Path

import click

from specdec.cli.options import (json_option, max_new_tokens_option, minutes_option, prompt_count_option,
                                 seed_option, threads_option)
from specdec.console import echo_record, elapsed_progress, one_line_errors, unwinds_on_sigterm


@click.command()
@click.argument("artifact", type=click.Path(file_okay=False, path_type=Path))
@minutes_option(60.0, "Budget for the whole run: making data (the target answering prompts), training, export and "
                      "the runtime check at the end.")
@seed_option("Seeds the prompt order, sampled answers, initialisation and batch order; with --prompts and --steps as "
             "recorded in the manifest, a run is repeated exactly (its learning-rate curve too, unless the recorded "
             "run re-planned it: training.plan_history).")
@click.option("--resume", is_flag=True,
              help="Keep the data and checkpoint of the last run on this artifact (in .NAME.distill/ beside it) "
                   "and train on for --minutes (from step 0 when that run stopped after making its data).")
@prompt_count_option("Training prompts the target answers (default: as many as the data share of --minutes allows).")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Training steps in all (default: as many as --minutes allows).")
@click.option("--data-share", type=click.FloatRange(0.05, 0.95), default=0.45, show_default=True,
              help="Share of --minutes spent making data when --prompts is not given.")
@click.option("--sampled-share", type=click.FloatRange(0.0, 1.0), default=0.5, show_default=True,
              help="Share of the answers sampled at temperature 0.7 (the rest greedy).")
@click.option("--self-written-share", type=click.FloatRange(0.0, 1.0), default=0.5, show_default=True,
              help="Share of the training prompts the target writes itself (sampled user turns, filtered against the "
                   "bench's prompts and the held-out topics); the rest come from the shipped templates.")
@max_new_tokens_option(192, "Longest answer the target writes per prompt.", lowest=8)
@click.option("--vocab-subset", type=click.IntRange(min=2), default=8192, show_default=True,
              help="Ids the draft can propose: the target's most frequent output tokens (FR-Spec); q = 0 elsewhere.")
@click.option("--feature-layers", default="", show_default="none",
              help="Comma-separated target decoder layers (0-based) whose normed inputs the head reads beside the last "
                   "feature, as EAGLE-3 fuses low and middle layers (e.g. 2,15 on a 30-layer target). They are added "
                   "to the target graph's hidden-state output; a change re-taps the graph and needs fresh data.")
@click.option("--generate-dtype", type=click.Choice(["auto", "bfloat16", "float32"]), default="auto",
              show_default=True,
              help="Dtype of the target copy that decodes the training answers and reads their features (auto: bfloat16 "
                   "on CUDA or a CPU with native bf16, else float32). Held-out features are read by the fp32 target.")
@click.option("--head-weights", type=click.Choice(["int8", "fp32"]), default="int8", show_default=True,
              help="MatMul weights of the exported head: int8 (onnxruntime MatMulNBits, a third of the bytes per "
                   "draft call) or fp32. Either way q is what the head outputs, so decoding stays exact.")
@click.option("--train-dtype", type=click.Choice(["auto", "bfloat16", "float32"]), default="auto", show_default=True,
              help="Compute dtype of training (autocast; the weights stay fp32). auto: bfloat16 on CUDA or a CPU with "
                   "native bf16, where it trains 3-4x more positions per second, else float32.")
@click.option("--generate-batch", type=click.IntRange(min=1), default=128, show_default=True,
              help="Prompts the target answers at once while making data.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where PyTorch makes data and trains (auto: CUDA when PyTorch sees a GPU).")
@threads_option("CPU threads for PyTorch and onnxruntime (default: all cores).")
@json_option("Print the training record (the manifest's entry) as JSON.")
@one_line_errors
@unwinds_on_sigterm
def distill(artifact: Path, minutes: float, seed: int, resume: bool, prompts: int | None, steps: int | None,
            data_share: float, sampled_share: float, self_written_share: float, max_new_tokens: int,
            vocab_subset: int, feature_layers: str, generate_dtype: str, train_dtype: str, head_weights: str,
            generate_batch: int, device: str, threads: int | None, as_json: bool) -> None:
    """Train an EAGLE-style draft head for ARTIFACT's target on the target's own answers, and write it in.

    The target graph gets a hidden-state output (the LM head's input), validated against
    PyTorch; the head (one decoder layer over [target feature; next token's embedding], a
    vocabulary subset) is trained in PyTorch, exported to ONNX, checked with the runtime on
    held-out prompts, and written into the artifact atomically. `specdec generate ARTIFACT
    --drafter eagle` (the artifact's new default drafter) then uses it. Needs the export extra.
    """
    # OpenMP threads spinning at barriers collapse PyTorch on a shared CPU (docs/DISTILL.md, "Why these defaults");
    # libgomp reads this when torch is first imported.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from specdec.exporter.distill.pipeline import DistillConfig, run_distill

    try:
        layers = tuple(int(part) for part in feature_layers.split(",") if part.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated layer numbers, got {feature_layers!r}",
                                 param_hint="--feature-layers") from None
    config = DistillConfig(artifact=artifact, minutes=minutes, seed=seed, resume=resume, prompts=prompts, steps=steps,
                           data_share=data_share, sampled_share=sampled_share,
                           self_written_share=self_written_share, max_new_tokens=max_new_tokens,
                           subset_size=vocab_subset, feature_layers=layers, head_weights=head_weights,
                           generate_dtype=generate_dtype,
                           generate_batch=generate_batch, device=device, threads=threads,
                           settings={"compute_dtype": train_dtype})
    manifest = run_distill(config, progress=elapsed_progress())
    echo_record(artifact, manifest.feature_draft.training, as_json, _summary)


def _summary(artifact: Path, record: dict) -> str:
    """Return the line saying what the run trained and wrote into `artifact`."""
    accept = record["heldout_acceptance"]
    runtime = record.get("runtime_heldout") or {}
    return (f"draft head written into {artifact}: {record['steps']} steps on {record['data']['answer_tokens']} "
            f"answer tokens in {record['wall_minutes']} min; held-out greedy agreement (teacher-forced) "
            f"first {accept['first']:.3f}, second {accept['second']:.3f}"
            + (f"; runtime alpha {runtime['alpha']:.3f} at K={runtime['num_draft_tokens']}" if runtime else ""))
