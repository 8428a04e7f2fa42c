"""The `specdec` command line. Maps flags onto config dataclasses; turns SpecdecError into one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specdec.console import elapsed_progress, one_line_errors, unwinds_on_sigterm
from specdec.models.manifest import FLOAT_DTYPES, TRACE_DEVICES, WEIGHT_DTYPES
from specdec.cli.options import (json_option, max_new_tokens_option, parse_draft_tokens, provider_option,
                                 threads_option)
from specdec.runtime.config import (AUTO_K_CAP, AUTO_K_CAP_PREDICTION, DRAFTER_CHOICES, MAX_DRAFT_TOKENS,
                                    GenerationConfig)

DEFAULTS = GenerationConfig()  # flag defaults are the library's


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specdec")
def main() -> None:
    """specdec: export draft+target models to ONNX and run exact speculative decoding on onnxruntime."""


@main.command()
@click.option("--target", required=True, metavar="SRC",
              help="Target model: Hugging Face hub id, local model folder, or .gguf file.")
@click.option("--draft", required=True, metavar="SRC|none",
              help="Draft model (same kinds as --target; must share its tokenizer); 'quantized:int4' or "
                   "'quantized:int8' for a weight-quantized copy of the target; or 'none' for a target-only "
                   "artifact (the runtime then drafts by prompt lookup).")
@click.option("--output", "-o", required=True, type=click.Path(path_type=Path),
              help="Artifact folder to create. Written atomically: nothing is left there on failure.")
@click.option("--dtype", type=click.Choice(FLOAT_DTYPES), default="fp32", show_default=True,
              help="Float dtype of the exported graphs (weights, KV cache, logits). fp16 with --device cpu: "
                   "exported in fp32, then converted, for a GPU box (CUDA's fused attention takes fp16).")
@click.option("--weights", type=click.Choice(WEIGHT_DTYPES), default=None,
              help="Weight precision: fp32/fp16 as --dtype; int8 or int4 quantize the MatMul weights "
                   "(onnxruntime MatMulNBits) after an fp32 export, validated by greedy agreement with PyTorch.")
@click.option("--device", type=click.Choice(TRACE_DEVICES), default="cpu", show_default=True,
              help="Device PyTorch traces and validates the model on.")
@click.option("--opset", type=int, default=None, help="ONNX opset (default: optimum's choice for the architecture).")
@click.option("--trust-remote-code", is_flag=True, help="Allow model code from the source (hub models only).")
@click.option("--force", is_flag=True, help="Replace an existing output folder.")
@click.option("--atol", type=float, default=None,
              help="Max |logit difference| ONNX vs PyTorch in validation (default 1e-2 fp32, 1e-1 fp16).")
@click.option("--min-agreement", type=click.FloatRange(0.0, 1.0), default=None,
              help="Share of greedy validation tokens that must match PyTorch (default 1.0 for fp32/fp16, "
                   "0.75 int8, 0.6 int4).")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit) of hub sources.")
@click.option("--optimize/--no-optimize", default=True, show_default=True,
              help="Run the optimization stage: onnxruntime's transformer fusions and the attention rewrites, "
                   "where they were measured to help the family.")
@click.option("--shared-kv/--no-shared-kv", default=True, show_default=True,
              help="Families whose attention allows it (all but gpt2, phi3, gemma2, gemma3; the manifest's "
                   "kv_buffer says): rewrite attention over one preallocated KV buffer per tensor "
                   "(GroupQueryAttention; rollback is free). onnxruntime's CUDA GroupQueryAttention takes "
                   "fp16/bf16 only: for an fp32 artifact meant for a CUDA box, use --no-shared-kv.")
@click.option("--exact-steps", is_flag=True,
              help="Run the target's attention on two query rows at least (a throwaway copy of the last), so a "
                   "1-token step scores its token bit-identically to a verify call and greedy speculative output "
                   "equals target-only output to the bit. int4 targets always get it. Float targets without it "
                   "differ by up to ~4e-5 in logits between the two paths (fp32 SmolLM2); with it a 1-token step "
                   "costs 1-12% more on a 2-core CPU, more at long pasts (docs/DESIGN.md).")
@click.option("--greedy-head", is_flag=True,
              help="fp32 targets: also write an 8-bit copy of the LM head that greedy calls on the CPU read "
                   "instead of the fp32 one, with an error bound per token; the few tokens whose bound reaches "
                   "the best are recomputed in fp32, so the argmax is the fp32 head's. A greedy SmolLM2 step reads "
                   "~28 MB of head instead of 113 (docs/DESIGN.md); sampling keeps the fp32 head. Adds ~140 MB.")
@click.option("--long-call-attention/--no-long-call-attention", default=True, show_default=True,
              help="fp32 targets with a shared KV buffer: wrap each attention in an If that sends calls over 64 "
                   "tokens (prefills) to onnxruntime's causal kernel, shorter ones to its flash kernel. On an "
                   "Intel Xeon (AVX-512) it took 9-13% off a 285-token prefill; on an AMD EPYC (AVX2) the prefill "
                   "is level and every step pays ~0.5 ms for the Ifs (decode ~3.7% slower): off there "
                   "(docs/FAIR_ANCHORS.md, 'The long-call kernel depends on the CPU').")
@click.option("--batch-rows", type=click.IntRange(min=0), default=8, show_default=True,
              help="fp32 targets with a shared KV buffer: also write a graph that takes this many sequences of any "
                   "token counts in one call, so `specdec serve --max-batch` of the same number verifies several "
                   "requests' drafts in one target call (its weights shared through one data file). 0: none "
                   "(each speculating request is verified in a call of its own).")
@one_line_errors
@unwinds_on_sigterm
def export(target, draft, output, dtype, weights, device, opset, trust_remote_code, force, atol, min_agreement,
           revision, optimize, shared_kv, exact_steps, greedy_head, long_call_attention, batch_rows) -> None:
    """Export a draft and a target model into one validated artifact folder.

    \b
    Families (config model_type): gemma2, gemma3_text, gpt2, gpt_neox, granite, llama, mistral, olmo2,
    phi, phi3, qwen2, qwen3, smollm3. Draft and target may be of different families when they share
    a tokenizer.
    """
    from specdec.exporter.pipeline import ExportConfig, run_export

    progress = elapsed_progress()
    config = ExportConfig(
        target=target,
        draft=None if draft.lower() == "none" else draft,
        output=output,
        dtype=dtype,
        weights=weights,
        device=device,
        opset=opset,
        trust_remote_code=trust_remote_code,
        force=force,
        atol=atol,
        min_agreement=min_agreement,
        revision=revision,
        optimize=optimize,
        shared_kv=shared_kv,
        exact_steps=exact_steps,
        greedy_head=greedy_head,
        long_call_attention=long_call_attention,
        batch_rows=batch_rows,
        command=" ".join(["specdec"] + sys.argv[1:]),
    )
    run_export(config, progress)


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@json_option("Print the manifest as JSON.")
@click.option("--no-verify", is_flag=True, help="Skip checking every file's sha256.")
@one_line_errors
def inspect(artifact, as_json, no_verify) -> None:
    """Print an artifact's manifest: models, KV layout, tokenizer, validation, provenance."""
    from specdec.models.manifest import load_manifest

    manifest = load_manifest(artifact, check_files=not no_verify)
    if as_json:
        click.echo(json.dumps(manifest.to_dict(), indent=2))
        return
    click.echo(f"specdec artifact {artifact} (manifest v{manifest.version}, checksums "
               f"{'not checked' if no_verify else 'OK'})")
    for graph in manifest.graphs():
        report = manifest.validation.get(graph.role, {})
        click.echo(
            f"  {graph.role:6s} {graph.family} ({graph.model_type}) from {graph.source}\n"
            f"         {graph.num_layers} layers, {graph.num_kv_heads} KV heads x {graph.head_dim}, "
            f"KV {graph.kv_dtype}, weights {graph.weights_dtype}, vocab {graph.vocab_size}, "
            f"max positions {graph.max_positions}\n"
            f"         graph {graph.graph_file}; position ids: {graph.position_ids_name or 'none'}\n"
            f"         KV cache: " + ("one shared preallocated buffer per tensor, written in place (rollback: a "
                                    "shorter length)" if graph.kv_buffer == "shared" else
                                    f"past + new per step (rollback: {graph.kv_slice_file})")
        )
        applied = graph.optimization.get("applied")
        if applied:
            fused = ", ".join(f"{op} x{n}" for op, n in graph.optimization.get("fused_operators", {}).items())
            click.echo(f"         optimized: {'; '.join(applied)}" + (f" ({fused})" if fused else ""))
        else:
            click.echo(f"         plain optimum graph: {graph.optimization.get('note') or 'exported before the optimization stage'}")
        if "half_precision" in graph.optimization:
            click.echo("         fp16: exported in fp32 on the CPU, then converted (onnxruntime float16 converter)")
        if "quantization" in graph.optimization:
            click.echo(f"         quantized: {graph.optimization['quantization'].get('method', graph.weights_dtype)}")
        if "max_logit_diff_prefill" in report:
            click.echo(
                f"         validation: max |logit diff| {max(report['max_logit_diff_prefill'], report['max_logit_diff_step']):.2e} "
                f"(atol {report['atol']:g}), greedy agreement {report['greedy_agreement']:.0%}"
            )
        elif "agreement" in report:  # a quantized graph is judged by teacher-forced greedy agreement
            click.echo(f"         validation: teacher-forced greedy agreement {report['agreement']:.1%} over "
                       f"{report['tokens']} tokens (floor {report['min_agreement']:.0%})")
        if graph.greedy_head:
            check = report.get("greedy_head", {})
            click.echo("         greedy calls (CPU): an 8-bit LM head, the fp32 argmax kept by a bound"
                       + (f" ({check['candidates_median']:.0f} tokens recomputed in fp32 at the median, "
                          f"{check['candidates_max']} at most, over {check['positions']} validation positions)"
                          if check else ""))
        if graph.long_call_name:
            from specdec.runtime.session import LONG_CALL_ROWS

            click.echo(f"         attention: calls over {LONG_CALL_ROWS} tokens (prefills) take onnxruntime's causal "
                       "kernel, shorter ones its flash kernel" + (f" (validated: {report['max_logit_diff_long_call']:.2e})"
                                                                 if report.get("max_logit_diff_long_call") is not None else ""))
        if graph.attention_pad_rows:
            click.echo("         steps vs verify calls: bit-identical (attention over 2+ query rows)")
        elif "step_vs_call_max_diff" in report:
            click.echo(f"         steps vs verify calls: logits up to {report['step_vs_call_max_diff']:.1e} apart "
                       "(export with --exact-steps for bit-identical)")
    if manifest.draft is None:
        click.echo("  draft  none (the runtime drafts by prompt lookup)")
    if manifest.feature_draft is not None:
        click.echo(f"  draft head ({manifest.feature_draft.kind}): {manifest.feature_draft.graph_file}, "
                   f"{manifest.feature_draft.vocab_subset} ids (`specdec distill`)")
    if manifest.phrase_table is not None:
        built = manifest.phrase_table.built
        held = built.get("heldout", {})
        click.echo(f"  phrase table: {manifest.phrase_table.table_file}, {built.get('confident_contexts', '?')} confident "
                   f"contexts from {built.get('answers', '?')} answers ({built.get('tokens', '?')} tokens)"
                   + (f"; held-out: proposes at {held['proposes']:.1%} of positions, first token right "
                      f"{held['first_right']:.1%}" if held else ""))
    tok = manifest.tokenizer
    click.echo(f"  tokenizer: vocab {tok.vocab_size}, eos {tok.eos_token_ids}, bos {tok.bos_token_id}, "
               f"chat template {'yes' if tok.chat_template else 'no'}")
    if manifest.runtime_defaults.to_dict():
        click.echo(f"  runtime defaults: {manifest.runtime_defaults.to_dict()}")
    prov = manifest.provenance
    versions = ", ".join(f"{k} {v}" for k, v in prov.library_versions.items())
    click.echo(f"  exported {prov.export_date} by specdec {prov.exporter_version} ({versions})")


def config_option(field: str, kind, help: str):
    """Return generate's option for GenerationConfig's `field`: --FIELD with dashes, the library's default (shown)."""
    return click.option(f"--{field.replace('_', '-')}", type=kind, default=getattr(DEFAULTS, field), show_default=True,
                        help=help)


def _logit_bias_callback(ctx, param, values: tuple[str, ...]) -> tuple[tuple[int, float], ...]:
    pairs = []
    for value in values:
        token, _, bias = value.partition("=")
        try:
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise click.BadParameter(f"'{value}' is not ID=BIAS (e.g. 42=-100)") from None
    return tuple(pairs)


def _json_schema(path: Path | None):
    """Return the GrammarSpec of a JSON-schema file (None: no file); a file that is not JSON is a usage error."""
    if path is None:
        return None
    from specdec.runtime.grammar import GrammarSpec

    try:
        return GrammarSpec.of("json_schema", json.loads(path.read_text(encoding="utf-8")))
    except ValueError as err:
        raise click.BadParameter(f"'{path}' is not JSON: {err}") from None


def _logprob_entries(engine, iteration) -> list[dict]:
    """Return one {token, id, logprob, top} entry per committed token of an iteration that carries logprobs."""
    lp, decode = iteration.logprobs, lambda token: engine.codec.decode([int(token)])
    return [{"token": decode(token), "id": token, "logprob": float(lp.chosen[row]),
             "top": [[decode(t), float(v)] for t, v in zip(lp.top_ids[row], lp.top_values[row])]}
            for row, token in enumerate(iteration.committed[:len(lp)])]


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("prompt")
@config_option("max_new_tokens", int, "Stop after this many new tokens.")
@config_option("temperature", float, "0 is greedy; > 0 samples.")
@config_option("top_k", int, "Keep the k most likely tokens (0: off).")
@config_option("top_p", float, "Nucleus sampling mass in (0, 1] (1: off).")
@config_option("min_p", float, "Drop tokens less likely than this fraction of the most likely one (0: off).")
@config_option("repetition_penalty", float, "> 1 makes tokens already in the prompt or output less likely (1: off).")
@config_option("presence_penalty", float, "OpenAI's: subtract this (-2..2) from every token the output already has.")
@config_option("frequency_penalty", float, "OpenAI's: subtract this (-2..2) per time a token is in the output already.")
@click.option("--logit-bias", "logit_bias", multiple=True, metavar="ID=BIAS", callback=_logit_bias_callback,
              help="Add BIAS (-100..100) to token ID's logit (repeatable).")
@click.option("--logprobs", type=click.IntRange(0, 20), default=None, metavar="N",
              help="Report each generated token's log-probability and its N most likely alternatives (0..20), read "
                   "from the target; shown per token with --verbose, and in --json output.")
@click.option("--prediction", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              callback=lambda ctx, param, path: path.read_text(encoding="utf-8") if path else None, metavar="FILE",
              help="A file holding the text the answer is expected to be (an edit's original): drafts are copied "
                   "from it, and verified like any draft, so the output is the same with or without it.")
@click.option("--json-schema", "grammar", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              callback=lambda ctx, param, path: _json_schema(path), metavar="FILE",
              help="Constrain the answer to JSON valid under the JSON schema in FILE (structured outputs; drafts are "
                   "masked like the target's rows, and the keys and braces the schema forces are drafted for free).")
@click.option("--stop-token-id", "stop_token_ids", type=click.IntRange(min=0), multiple=True, metavar="ID",
              help="End the answer after this token, as after EOS (repeatable).")
@config_option("seed", int, "Random seed: same seed and K, same output.")
@click.option("--reproducible", is_flag=True,
              help="Same seed, same output under '-k auto' too: K then follows the answer's own tokens (prompt "
                   "lookup's over the calibrated call costs, frozen; a draft model's is the artifact's fixed K), "
                   "not live call times.")
@click.option("--num-draft-tokens", "-k", default=None, metavar="K|auto",
              help="Tokens drafted per target call, or 'auto' to choose each iteration "
                   "(default: the artifact's tuned K, else 4).")
@config_option("drafter", click.Choice(DRAFTER_CHOICES),
               "auto: what `specdec tune` stored, else the artifact's draft model if it has one, else prompt lookup "
               "(n-gram). ngram+model: prompt lookup where the context repeats an n-gram, the draft model elsewhere.")
@click.option("--no-draft", is_flag=True, help="Plain target-only decoding (same as --drafter none).")
@click.option("--max-draft-tokens-auto", type=int, default=None,
              help=f"Cap on K under '-k auto' (1..{MAX_DRAFT_TOKENS}; auto times target calls up to cap + 1 tokens "
                   f"once). Default: {AUTO_K_CAP}, or {AUTO_K_CAP_PREDICTION} with --prediction, whose copy runs are "
                   f"longer.")
@click.option("--ngram-min", type=int, default=None,
              help="n-gram drafter: shortest context suffix to look up (1 also drafts after single-token matches; "
                   "default: 1 under '-k auto', which learns whether they pay, else 2).")
@config_option("ngram_max", int, "n-gram drafter: longest context suffix to look up (longer matches are tried first).")
@click.option("--phrases/--no-phrases", default=DEFAULTS.phrases, show_default=True,
              help="n-gram drafter: where the context has no match of 2+ tokens, propose the target's usual "
                   "continuation from the artifact's phrase table (built by `specdec phrases`; no effect without one).")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template as a user message.")
@click.option("--stop", "stop_strings", multiple=True, metavar="TEXT", help="Stop when this text appears (repeatable).")
@provider_option("onnxruntime execution provider; auto uses CUDA when onnxruntime-gpu can load it.")
@threads_option("onnxruntime intra-op threads (default: all cores).")
@click.option("--shared-threads/--no-shared-threads", default=False, show_default=True,
              help="With a draft model or head: run it and the target on one onnxruntime thread pool, which "
                   "keeps spinning for whichever runs next (faster drafting on few cores; the pool then serves "
                   "every onnxruntime session of the process).")
@click.option("--verbose", "-v", is_flag=True, help="Show each iteration's drafted and accepted tokens.")
@json_option("Print one JSON object (text, ids, finish reason, stats).")
@one_line_errors
def generate(artifact, prompt, num_draft_tokens, drafter, no_draft, provider, threads, shared_threads, verbose, as_json,
             **settings) -> None:
    """Generate a completion of PROMPT with the artifact in ARTIFACT, streaming the text."""
    from specdec.runtime.engine import Engine

    # Every other option is the GenerationConfig field of its name (click passes repeated options as tuples).
    config = GenerationConfig(**settings, num_draft_tokens=parse_draft_tokens(num_draft_tokens),
                              drafter="none" if no_draft else drafter)
    config.validate()
    engine = Engine.load(artifact, provider=provider, threads=threads, shared_threads=shared_threads)

    def show_iteration(iteration) -> None:
        decode = lambda ids: repr(engine.codec.decode(ids))  # noqa: E731
        situation = f"{iteration.situation}: " if iteration.situation else ""
        click.echo(
            f"\n  [{situation}drafted {len(iteration.drafted)} {decode(iteration.drafted)}, accepted "
            f"{iteration.num_accepted}, +{len(iteration.committed)} {decode(iteration.committed)}"
            f"{' (bonus)' if iteration.is_bonus else ''}]",
            err=True,
        )

    logprobs: list[dict] = []

    def on_iteration(iteration) -> None:
        if iteration.logprobs is not None:
            logprobs.extend(_logprob_entries(engine, iteration))
        if verbose:
            show_iteration(iteration)

    stream = engine.stream(prompt, config, on_iteration=on_iteration)
    if as_json:
        for _ in stream:
            pass
    else:
        for piece in stream:
            click.echo(piece, nl=False)
            sys.stdout.flush()
        click.echo()
    result = stream.result
    if as_json:
        click.echo(json.dumps({
            "text": result.text,
            "token_ids": result.token_ids,
            "prompt_tokens": len(result.prompt_ids),
            "finish_reason": result.finish_reason,
            "provider": engine.provider,
            "stats": result.stats.as_dict(),
            **({"logprobs": logprobs[:len(result.token_ids)]} if config.logprobs is not None else {}),
            **({"prediction_tokens": dict(zip(("accepted", "rejected"), result.stats.prediction_tokens()))}
               if config.prediction else {}),
        }))
    else:
        click.echo(f"--- finish: {result.finish_reason}; provider {engine.provider}\n{result.stats.summary()}", err=True)
        if engine.target.device == "cpu" and engine.manifest.target.kv_dtype == "float16":
            # Measured on SmolLM2: 41-46 tok/s in fp16 against ~56 in fp32 on the same CPU.
            click.echo("note: an fp16 artifact runs on the CPU through casts to fp32, slower than an fp32 export; "
                       "fp16 is for CUDA", err=True)
        if engine.call_costs_source == "timed":  # why this first `-k auto` run took longer than its stats say
            kept = (f"kept in {engine.call_costs_cache_file} for later runs" if engine.call_costs_cache_file
                    else "not cached: SPECDEC_NO_CACHE is set or the cache folder is not writable")
            click.echo(f"auto: timed target calls once, {engine.calibration_seconds:.2f}s before generating ({kept})",
                       err=True)


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path), default=None,
              help="JSON-lines prompt set ({\"prompt\": ..., \"chat\": true}); default: two built-in prompts.")
@click.option("--drafter", type=click.Choice([c for c in DRAFTER_CHOICES if c != "none"]), default="auto",
              show_default=True,
              help="Drafter to tune; auto: the draft model if the artifact has one, else n-gram.")
@click.option("--max-k", type=click.IntRange(1, MAX_DRAFT_TOKENS), default=AUTO_K_CAP,
              show_default=True,
              help="Largest K to measure; also auto's cap while it is measured.")
@max_new_tokens_option(64, "Tokens generated per prompt and run.", lowest=2, highest=4096)
@click.option("--repeats", type=click.IntRange(1, 20), default=1, show_default=True,
              help="Runs per prompt and K; the measured speedup pools decode tokens/s over all of them.")
@click.option("--no-measure", is_flag=True, help="Only time the calls and estimate alpha; skip the K sweep.")
@click.option("--plot", type=click.Path(path_type=Path), default=Path("tune.png"), show_default=True,
              help="Where to write the PNG of expected vs measured speedup.")
@click.option("--no-plot", is_flag=True, help="Write no PNG.")
@click.option("--no-save", is_flag=True, help="Do not store the recommended K in the artifact.")
@provider_option("onnxruntime execution provider.")
@threads_option("onnxruntime intra-op threads (default: all cores).")
@json_option("Print the report as JSON.")
@one_line_errors
def tune(artifact, prompts_file, drafter, max_k, max_new_tokens, repeats, no_measure, plot, no_plot, no_save, provider,
         threads, as_json) -> None:
    """Measure c and alpha, compare expected and measured speedup for K = 1..max-k and auto, store the best;
    where the target has two attention kernels, time a prefill through each and say whether the long-call
    one is worth its Ifs on this machine."""
    from specdec.benchmarks.tune import format_table, save_tuned_defaults, tune as run_tune
    from specdec.runtime.engine import Engine
    from specdec.runtime.prompts import DEFAULT_PROMPTS, load_prompts

    engine = Engine.load(artifact, provider=provider, threads=threads)
    prompts = load_prompts(prompts_file) if prompts_file else list(DEFAULT_PROMPTS)
    report = run_tune(engine, prompts, engine.drafter_kind(drafter), max_k=max_k, max_new_tokens=max_new_tokens,
                      measure=not no_measure, repeats=repeats, progress=elapsed_progress())
    if not no_plot:
        from specdec.cli.plots import plot_tune

        plot_tune(report, plot)
    if not no_save:
        save_tuned_defaults(artifact, report)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
        return
    click.echo(format_table(report))
    click.echo(f"\nrecommended K = {report.recommended_k}"
               + ("" if no_save else f" (stored in {artifact}/specdec.json)")
               + ("" if no_plot else f"; plot: {plot}"))


from specdec.cli.bench import bench  # noqa: E402  (registered last: it only adds a command)

main.add_command(bench)
from specdec.cli.serve import serve  # noqa: E402

main.add_command(serve)
from specdec.cli.distill import distill  # noqa: E402

main.add_command(distill)
from specdec.cli.phrases import phrases  # noqa: E402

main.add_command(phrases)
from specdec.cli.score import score  # noqa: E402

main.add_command(score)

if __name__ == "__main__":
    main()
