"""`python -m specdec.benchmarks.mask_cost --tokenizer PATH`: what a grammar's token masks cost, llguidance beside xgrammar.

On one tokenizer.json (SmolLM2's 49,152 tokens for the figures in docs/STRUCTURED.md): compile
time of an extraction JSON schema (7 properties, a nested object, an array, an enum) and of
json_object; then along a valid ~200-token instance of the schema, per token: one mask fill,
the masks of K=8 draft rows in one call, consuming a token and rolling back 8. For llguidance
also specdec's own `GrammarState.allowed` (the K+1 rows unpacked to bool, as the loop gets them).
xgrammar is measured only where it imports (it needs torch and transformers). Each figure is the
median over `--runs` runs (default 3) of that run's statistic; the box may be shared, so read
medians, not maxima. Prints a Markdown table and the CPU, or JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "is_member": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 12},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "notes": {"type": "string"},
    },
    "required": ["name", "age", "is_member", "address", "tags", "role", "notes"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "Dr. Amelia Rosalind Fairweather-Okonkwo",
    "age": 47,
    "is_member": True,
    "address": {"street": "1427 Willow Creek Boulevard, Apartment 5B", "city": "San Francisco", "zip": "94110"},
    "tags": ["cardiology", "clinical research", "mentor", "conference speaker", "peer reviewer", "grant committee",
             "hospital board", "telemedicine pilot"],
    "role": "editor",
    "notes": ("Joined the regional cardiology network in 2011 and led the telemedicine pilot across four rural "
              "clinics; prefers to be contacted by email on weekdays, and asked that her conference travel for "
              "the spring term be booked through the department office rather than the central travel desk. Her "
              "badge expires in March, and the renewal form must be countersigned by the chief of medicine."),
}
K = 8  # draft rows per verify call


def cpu_model() -> str:
    """Return the CPU's model name from /proc/cpuinfo ("unknown" elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _us(seconds: list[float]) -> dict:
    return {"median_us": statistics.median(seconds) * 1e6, "max_us": max(seconds) * 1e6}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_llguidance(tokenizer, eos: list[int]) -> dict:
    """Return one run's llguidance figures (seconds or µs per key)."""
    import llguidance.numpy as lln

    from specdec.runtime import grammar

    grammar._tokenizers.clear()
    start = time.perf_counter()
    adapter = grammar.grammar_tokenizer(tokenizer, eos)
    adapter_s = time.perf_counter() - start
    compile_ms = {}
    for name, spec in (("json_schema", grammar.GrammarSpec.of("json_schema", SCHEMA)),
                       ("json_object", grammar.GrammarSpec("json_object"))):
        grammar._compile_cached.cache_clear()  # uncached: a schema seen for the first time
        compile_ms[name] = _timed(lambda: grammar.compile_grammar(spec, adapter)) * 1e3
    compiled = grammar.compile_grammar(grammar.GrammarSpec.of("json_schema", SCHEMA), adapter)
    ids = tokenizer.encode(json.dumps(INSTANCE), add_special_tokens=False).ids
    matcher = compiled.matcher.deep_copy()
    one = lln.allocate_token_bitmask(1, adapter.vocab_size)
    rows = lln.allocate_token_bitmask(K + 1, adapter.vocab_size)
    executor = grammar._executor()
    state = compiled.start(adapter.vocab_size)
    fill, fill_k, allowed_k, consume, rollback = [], [], [], [], []
    for i, token in enumerate(ids):
        fill.append(_timed(lambda: lln.fill_next_token_bitmask(matcher, one)))
        drafts = ids[i:i + K]
        if len(drafts) == K:
            fill_k.append(_timed(lambda: lln.fill_next_token_bitmask_par_with_draft_tokens(
                executor, [(matcher, 0, drafts)], rows)))
            allowed_k.append(_timed(lambda: state.allowed(drafts)))
            if matcher.consume_tokens(drafts):  # 8 ahead, then back: the loop's rejected tail
                rollback.append(_timed(lambda: matcher.rollback(K)))
        consume.append(_timed(lambda: matcher.consume_token(token)))
        state.advance([token])
        if matcher.is_error():
            raise RuntimeError(f"llguidance refused the instance at token {i}: {matcher.get_error()[:200]}")
    return {"tokens": len(ids), "tokenizer_s": adapter_s, "compile_json_schema_ms": compile_ms["json_schema"],
            "compile_json_object_ms": compile_ms["json_object"], "fill_1": _us(fill), f"fill_{K}_drafts": _us(fill_k),
            f"specdec_allowed_{K}": _us(allowed_k), "consume_1": _us(consume), f"rollback_{K}": _us(rollback)}


def measure_xgrammar(tokenizer_path: str, tokenizer, eos: list[int]) -> dict:
    """Return one run's xgrammar figures, or {"error": why} where it cannot be imported."""
    try:
        import torch
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except Exception as err:  # xgrammar imports torch and transformers at import time
        return {"error": f"{type(err).__name__}: {err}"}
    from tokenizers import Tokenizer

    data = json.loads(tokenizer.to_str())
    decoder = data.get("decoder") or {}
    if decoder.get("type") == "Sequence":  # the same ByteLevel unwrapping specdec gives llguidance
        data["decoder"] = next((d for d in decoder["decoders"] if d["type"] == "ByteLevel"), decoder)
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)))
    vocab = tokenizer.get_vocab_size()
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
    info_s = time.perf_counter() - start
    compile_ms = {}
    for name, build in (("json_schema", lambda c: c.compile_json_schema(
            SCHEMA, any_whitespace=False, separators=(", ", ": "))), ("json_object", lambda c: c.compile_builtin_json_grammar())):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        compile_ms[name] = _timed(lambda: build(compiler)) * 1e3
    compiled = xgr.GrammarCompiler(info).compile_json_schema(SCHEMA, any_whitespace=False, separators=(", ", ": "))
    matcher = xgr.GrammarMatcher(compiled)
    ids = tokenizer.encode(json.dumps(INSTANCE), add_special_tokens=False).ids
    one = xgr.allocate_token_bitmask(1, vocab)
    rows = xgr.allocate_token_bitmask(K + 1, vocab)
    chain_next = torch.tensor(list(range(1, K + 1)) + [-1], dtype=torch.int64)
    chain_sibling = torch.full((K + 1,), -1, dtype=torch.int64)
    fill, fill_k, consume, rollback = [], [], [], []
    for i, token in enumerate(ids):
        fill.append(_timed(lambda: matcher.fill_next_token_bitmask(one)))
        drafts = ids[i:i + K]
        if len(drafts) == K:
            nodes = torch.tensor([ids[i - 1] if i else 0] + drafts, dtype=torch.int64)  # node 0: the last committed
            fill_k.append(_timed(lambda: matcher.traverse_draft_tree(chain_next, chain_sibling, nodes, rows)))
            if all(matcher.accept_token(t) for t in drafts):
                rollback.append(_timed(lambda: matcher.rollback(K)))
        consume.append(_timed(lambda: matcher.accept_token(token)))
    if not matcher.is_completed():
        raise RuntimeError("xgrammar did not accept the instance")
    return {"tokens": len(ids), "tokenizer_s": info_s, "compile_json_schema_ms": compile_ms["json_schema"],
            "compile_json_object_ms": compile_ms["json_object"], "fill_1": _us(fill), f"fill_{K}_drafts": _us(fill_k),
            "consume_1": _us(consume), f"rollback_{K}": _us(rollback)}


def median_of_runs(runs: list[dict]) -> dict:
    """Return each figure's median over runs (nested dicts too)."""
    first = runs[0]
    if "error" in first:
        return first
    return {key: median_of_runs([r[key] for r in runs]) if isinstance(value, dict)
            else statistics.median(r[key] for r in runs) for key, value in first.items()}


def markdown(result: dict) -> str:
    """Return the figures as a Markdown table, one column per engine."""
    engines = [name for name in ("llguidance", "xgrammar") if name in result]
    lines = [f"CPU: {result['cpu']} ({result['cores']} cores, load {result['load']}); tokenizer "
             f"{result['vocab']} tokens; a {result['llguidance']['tokens']:.0f}-token instance; {result['runs']} runs, medians", "",
             "| figure | " + " | ".join(engines) + " |", "|---|" + "---|" * len(engines)]

    def cell(engine: str, key: str, sub: str | None) -> str:
        data = result[engine]
        if "error" in data:
            return "not importable"
        if key not in data:
            return "-"
        value = data[key][sub] if sub else data[key]
        return f"{value:.3g}" if value < 100 else f"{value:.0f}"

    rows = [("tokenizer adapter (s)", "tokenizer_s", None), ("compile JSON schema (ms)", "compile_json_schema_ms", None),
            ("compile json_object (ms)", "compile_json_object_ms", None)]
    for key, label in (("fill_1", "1 mask"), (f"fill_{K}_drafts", f"{K + 1} rows, K={K} drafts, one call"),
                       (f"specdec_allowed_{K}", f"GrammarState.allowed, K={K} (bool rows)"),
                       ("consume_1", "consume 1 token"), (f"rollback_{K}", f"roll back {K}")):
        rows += [(f"{label}: median (µs)", key, "median_us"), (f"{label}: max (µs)", key, "max_us")]
    for label, key, sub in rows:
        lines.append(f"| {label} | " + " | ".join(cell(e, key, sub) for e in engines) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="a tokenizer.json (Hugging Face tokenizers format)")
    parser.add_argument("--eos", type=int, action="append", help="EOS token id (repeatable; default: 2)")
    parser.add_argument("--runs", type=int, default=3, help="runs; each figure is the median over them")
    parser.add_argument("--no-xgrammar", action="store_true", help="measure llguidance only")
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    args = parser.parse_args(argv)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(args.tokenizer)
    eos = args.eos or [2]
    result = {"cpu": cpu_model(), "cores": os.cpu_count(), "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
              "vocab": tokenizer.get_vocab_size(), "runs": args.runs,
              "llguidance": median_of_runs([measure_llguidance(tokenizer, eos) for _ in range(args.runs)])}
    if not args.no_xgrammar:
        result["xgrammar"] = median_of_runs([measure_xgrammar(args.tokenizer, tokenizer, eos) for _ in range(args.runs)])
    print(json.dumps(result, indent=2) if args.json else markdown(result))


if __name__ == "__main__":
    main()
