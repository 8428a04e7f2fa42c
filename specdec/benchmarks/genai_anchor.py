"""onnxruntime-genai as an anchor, run in its own venv (its model builder needs transformers >= 5).

Set up by `make anchors-genai`:
  1. `python -m specdec.benchmarks.genai_anchor save-hf GGUF OUT` (specdec's venv, transformers 4.57)
     saves the GGUF as a plain fp32 Hugging Face folder (transformers >= 5 refuses to);
  2. genai's builder turns that folder into its own ONNX model (fp32, cpu);
  3. `fix-tokenizer` replaces the GGUF-derived tokenizer decoder, which genai misreads as
     SentencePiece-style (spaces would encode as -1), with a plain ByteLevel decoder.
`specdec bench --genai-python .venv-genai/bin/python --genai-model DIR` then runs
`worker` below in that venv (one process for the whole run, `GenaiWorker`) on the same
prompt ids as specdec, on a copy of DIR whose
genai_config.json carries specdec's session settings (`session_options`): genai's builder
writes none, and genai's own default thread count ran this model at about half speed on
a 2-core machine (24 against 45 tok/s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

GENAI_SYSTEM = "onnxruntime-genai"  # the graph name of its step times (`bench --steps`)


def session_options(threads: int, spin: bool = True) -> dict:
    """Return the genai `session_options` matching what specdec's target session runs with.

    specdec sets the intra-op thread count and spinning (on for a lone target, off where
    sessions take turns) and keeps onnxruntime's defaults otherwise (memory arena and
    patterns on, ORT_ENABLE_ALL), written out here so that neither side depends on a
    default the other does not share.
    """
    return {"intra_op_num_threads": threads, "inter_op_num_threads": 1, "enable_cpu_mem_arena": True,
            "enable_mem_pattern": True, "graph_optimization_level": "ORT_ENABLE_ALL",
            "session.intra_op.allow_spinning": "1" if spin else "0"}


def configured_model(model_dir: Path, options: dict, folder: Path) -> Path:
    """Return `folder`, now a view of `model_dir` (symbolic links) whose genai_config.json has `options`
    under model.decoder.session_options; the builder's folder is left as it is."""
    source = Path(model_dir).resolve()
    for item in source.iterdir():
        if item.name != "genai_config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((source / "genai_config.json").read_text(encoding="utf-8"))
    config["model"]["decoder"].setdefault("session_options", {}).update(options)
    (folder / "genai_config.json").write_text(json.dumps(config, indent=4), encoding="utf-8")
    return folder


def save_hf(gguf: str, out: str) -> None:
    """Write the GGUF model and tokenizer as an fp32 Hugging Face folder (tokenizer_config.json as
    `hf_tokenizer_config` corrects it)."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    fields = GGUFReader(path).fields
    model_field, bos_field = fields.get("tokenizer.ggml.model"), fields.get("tokenizer.ggml.add_bos_token")
    kind = model_field.contents() if model_field is not None else ""
    add_bos = bool(bos_field.contents()) if bos_field is not None else None
    config_path = Path(out) / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config_path.write_text(json.dumps(hf_tokenizer_config(config, kind, add_bos), indent=2, ensure_ascii=False),
                           encoding="utf-8")


def hf_tokenizer_config(config: dict, gguf_tokenizer: str, add_bos: bool | None) -> dict:
    """Return a saved tokenizer_config.json naming the class of the GGUF's tokenizer, with its BOS setting.

    transformers' GGUF loader names every tokenizer LlamaTokenizer. A byte-level BPE one (GGUF
    tokenizer model "gpt2": SmolLM2, Qwen) loaded under that name by transformers >= 5 (vLLM's venv)
    is rebuilt SentencePiece-style: spaces vanish from encoded prompts and come back as "Ġ" in
    decoded text, so vLLM served garbled prompts and answers. GPT2Tokenizer, as SmolLM2's own
    repository names it, reads tokenizer.json's byte-level steps in transformers 4 and 5.
    """
    fixed = dict(config)
    if gguf_tokenizer == "gpt2":
        fixed["tokenizer_class"], fixed["add_prefix_space"] = "GPT2Tokenizer", False
    if add_bos is not None:
        fixed["add_bos_token"] = add_bos
    return fixed


def fix_tokenizer(model_dir: str) -> None:
    """Give genai's copy of tokenizer.json a plain ByteLevel decoder."""
    path = Path(model_dir) / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def worker() -> None:
    """In the genai venv: per line of stdin, a job (runs: {model, prompts: {id: ids}, max_new_tokens, ...}; or
    kind "steps": {model, tokens, past_lengths, new_tokens, repeats}; or kind "prefill": {model, ids, count});
    per job, one line of JSON. The model
    is loaded once: one worker serves one model for as many jobs as it is sent."""
    import onnxruntime_genai as og

    model, loaded = None, None
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        if model is None:
            model, loaded = og.Model(job["model"]), job["model"]
        elif job["model"] != loaded:
            raise SystemExit(f"this worker serves {loaded}, not {job['model']}")
        work = {"steps": _genai_steps, "prefill": _genai_prefills}.get(job.get("kind"), _genai_runs)
        print(json.dumps(work(og, model, job)), flush=True)


def _genai_runs(og, model, job: dict) -> list[dict]:
    """Return one job's runs: a warm-up on its first prompt, then greedy and n-gram runs of every prompt."""
    import time

    runs = []
    warm = og.GeneratorParams(model)  # warm-up: the first generator pays one-time costs
    warm.set_search_options(do_sample=False, max_length=len(next(iter(job["prompts"].values()))) + 4)
    warm_generator = og.Generator(model, warm)
    warm_generator.append_tokens(next(iter(job["prompts"].values())))
    while not warm_generator.is_done():
        warm_generator.generate_next_token()
    def greedy_params(ids):
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + job["max_new_tokens"])
        return params

    modes = [("onnxruntime-genai greedy", None), ("onnxruntime-genai ngram", {"ngram_size": 3, "max_draft_tokens": 4})]
    for repeat in range(job.get("repeats", 1)):
        for prompt_id, ids in job["prompts"].items():
            # One prefill is a noisy time to first token (+-30% here): time a few more, as the runs do theirs.
            samples = _prefill_seconds(og, model, ids, job.get("prefill_samples", 0), len(ids) + job["max_new_tokens"])
            for system, speculative in (modes if repeat % 2 == 0 else modes[::-1]):
                params = greedy_params(ids)
                if speculative:
                    if not hasattr(params, "set_speculative_options"):
                        continue
                    params.set_speculative_options(**speculative)
                start = time.perf_counter()
                generator = og.Generator(model, params)
                prefill_start = time.perf_counter()
                generator.append_tokens(ids)  # the prefill: logits for the first new token
                decode_start = time.perf_counter()
                while not generator.is_done():
                    generator.generate_next_token()
                end = time.perf_counter()
                tokens = list(generator.get_sequence(0))[len(ids):]
                runs.append({"system": system, "prompt_id": prompt_id, "token_ids": [int(t) for t in tokens],
                             "seconds": end - start, "prefill_seconds": decode_start - prefill_start,
                             "decode_seconds": end - decode_start,
                             "prefill_samples": samples if speculative is None else []})
    return runs


def _genai_prefills(og, model, job: dict) -> list[float]:
    """Return the seconds of `count` prefills of `ids`, each on a new greedy generator for one more token."""
    return _prefill_seconds(og, model, job["ids"], job.get("count", 1), len(job["ids"]) + 1)


def _prefill_seconds(og, model, ids: list[int], count: int, max_length: int) -> list[float]:
    """Return the seconds of `count` prefills of `ids` (append_tokens on a new greedy generator of `max_length`)."""
    import time

    seconds = []
    for _ in range(count):
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=max_length)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(ids)
        seconds.append(time.perf_counter() - start)
        del generator
    return seconds


def _genai_steps(og, model, job: dict) -> list[dict]:
    """Return one job's step times: a call over n new tokens after a past of P tokens, medians over repeats."""
    import statistics
    import time

    tokens = job["tokens"]
    out = []
    for past in job["past_lengths"]:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=past + max(job["new_tokens"]) + 8)
        generator = og.Generator(model, params)
        generator.append_tokens(tokens[:past])
        for n in job["new_tokens"]:
            samples = []
            for _ in range(job["repeats"]):
                start = time.perf_counter()
                generator.append_tokens(tokens[past:past + n])
                samples.append(time.perf_counter() - start)
                generator.rewind_to(past)
            out.append({"past": past, "n": n, "seconds": statistics.median(samples)})
    return out


class GenaiWorker:
    """onnxruntime-genai's `worker` as one long-lived process: its model stays loaded between jobs.

    `specdec bench` keeps one open for its whole run, so specdec and genai are each timed while
    the other's process holds its model in memory. A worker started per prompt timed genai
    alone with specdec's process holding ~0.6 GB while specdec ran without genai's: genai's
    prefills read ~40% slower than with no other process, specdec's did not (docs/FAIR_ANCHORS.md).
    """

    def __init__(self, python: Path, model_dir: Path, options: dict, env: dict[str, str] | None = None):
        """Start the worker; `env` adds environment variables to its process (onnxruntime reads some)."""
        from specdec.models.errors import SpecdecError

        if model_dir is None or not Path(model_dir, "genai_config.json").is_file():
            raise SpecdecError("--genai-python needs --genai-model, a folder made by genai's builder "
                               "(make anchors-genai)")
        self._scratch = tempfile.TemporaryDirectory(prefix="specdec-genai-")
        self._model = configured_model(Path(model_dir), options, Path(self._scratch.name))
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._process = subprocess.Popen([str(python), __file__, "worker"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self._stderr, text=True,
                                         env={**os.environ, **env} if env else None)

    def run(self, prompt_ids: dict[str, list[int]], max_new_tokens: int, repeats: int = 1,
            prefill_samples: int = 0) -> list:
        """Return AnchorRuns: a warm-up on the first prompt, then `repeats` x (genai greedy, genai n-gram) per
        prompt, each greedy run carrying `prefill_samples` more prefills of its prompt timed just before it.
        Raises SpecdecError if the worker fails."""
        from specdec.benchmarks.anchors import AnchorRun

        job = {"model": str(self._model), "prompts": prompt_ids, "max_new_tokens": max_new_tokens,
               "repeats": repeats, "prefill_samples": prefill_samples}
        return [AnchorRun(**run, max_new_tokens=max_new_tokens) for run in json.loads(self._ask(job))]

    def _ask(self, job: dict) -> str:
        """Send one job; return the worker's line of JSON, or raise SpecdecError with what it last printed."""
        from specdec.models.errors import SpecdecError

        try:
            self._process.stdin.write(json.dumps(job) + "\n")
            self._process.stdin.flush()
            line = self._process.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self._stderr.seek(0)
            said = self._stderr.read().strip().splitlines()[-1:]
            raise SpecdecError(f"onnxruntime-genai anchor failed: {said}")
        return line

    def prefills(self, ids: list[int], count: int = 1) -> list[float]:
        """Return the seconds of `count` genai prefills of `ids`, one after the other."""
        return json.loads(self._ask({"kind": "prefill", "model": str(self._model), "ids": ids, "count": count}))

    def steps(self, tokens: list[int], past_lengths, new_tokens, repeats: int) -> dict[tuple[str, int, int], float]:
        """Return {(GENAI_SYSTEM, past, n): median seconds of a call over n new tokens after `past`}."""
        job = {"kind": "steps", "model": str(self._model), "tokens": tokens, "past_lengths": list(past_lengths),
               "new_tokens": list(new_tokens), "repeats": repeats}
        return {(GENAI_SYSTEM, r["past"], r["n"]): r["seconds"] for r in json.loads(self._ask(job))}

    def close(self) -> None:
        """End the worker (it exits at the end of its input) and remove its model view."""
        if self._process.stdin and not self._process.stdin.closed:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._stderr.close()
        self._scratch.cleanup()

    def __enter__(self) -> "GenaiWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "save-hf":
        save_hf(sys.argv[2], sys.argv[3])
    elif command == "fix-tokenizer":
        fix_tokenizer(sys.argv[2])
    elif command == "worker":
        worker()
    else:
        sys.exit("usage: genai_anchor.py save-hf GGUF OUT | fix-tokenizer DIR | worker < job.json")
