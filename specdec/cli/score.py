"""`specdec score`: how likely a text is under the target, token by token (what the server's `echo` with
`logprobs` returns): a perplexity, or a continuation's log-probability after a context, with no server."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from specdec.cli.options import json_option, provider_option, threads_option
from specdec.console import one_line_errors


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("text")
@click.option("--context", default=None, metavar="TEXT",
              help="Score TEXT as the continuation of this context: the context is read, and only TEXT's tokens are "
                   "listed and summed (the context is tokenized with TEXT after it and split where it ends, as "
                   "lm-evaluation-harness does).")
@click.option("--top", type=click.IntRange(0, 20), default=0, show_default=True,
              help="Also list each token's N most likely alternatives (0..20).")
@provider_option("onnxruntime execution provider; auto uses CUDA when onnxruntime-gpu can load it.")
@threads_option("onnxruntime intra-op threads (default: all cores).")
@json_option("Print one JSON object: tokens, ids, logprobs (and alternatives), their sum, count and perplexity.")
@one_line_errors
def score(artifact, text, context, top, provider, threads, as_json) -> None:
    """Print the log-probability of each token of TEXT under the target in ARTIFACT (its model's own log softmax,
    temperature 1), their sum and the perplexity. Without --context the first token has no row before it and is
    not scored."""
    from specdec.runtime.engine import Engine

    engine = Engine.load(artifact, provider=provider, threads=threads)
    codec = engine.codec
    head = codec.encode(context) if context is not None else []
    ids = codec.encode(context + text) if context is not None else codec.encode(text)
    if ids[:len(head)] != head:
        raise click.BadParameter("the context's tokens change when TEXT follows it; end the context before a space "
                                 "and start TEXT with it", param_hint="--context")
    scored = engine.prompt_logprobs(ids, top)
    first = max(len(head), 1)  # the first scored token: TEXT's first, or the text's second
    rows = range(first - 1, len(scored))
    tokens = [codec.decode([ids[row + 1]]) for row in rows]
    logprobs = [float(scored.chosen[row]) for row in rows]
    alternatives = [[[codec.decode([int(t)]), float(v)] for t, v in zip(scored.top_ids[row], scored.top_values[row])]
                    for row in rows]
    total = sum(logprobs)
    perplexity = math.exp(-total / len(logprobs)) if logprobs else None
    if as_json:
        click.echo(json.dumps({"tokens": tokens, "token_ids": ids[first:], "logprobs": logprobs,
                               **({"top": alternatives} if top else {}), "sum": total, "count": len(logprobs),
                               "perplexity": perplexity, "provider": engine.provider}))
        return
    for token, logprob, alternative in zip(tokens, logprobs, alternatives):
        others = "  " + "  ".join(f"{t!r} {v:.3f}" for t, v in alternative) if alternative else ""
        click.echo(f"{logprob:9.4f}  {token!r}{others}")
    shown = f"{perplexity:.3f}" if perplexity is not None else "n/a (no token scored)"
    click.echo(f"--- {len(logprobs)} tokens, sum {total:.4f}, perplexity {shown}; provider {engine.provider}", err=True)
