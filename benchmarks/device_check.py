"""The checks a CUDA machine must pass, as one script: `python -m specdec.benchmarks.device_check ART... --provider cuda`.

It needs only the runtime (numpy, onnxruntime-gpu, tokenizers), so it runs on a lent GPU
machine where specdec's exporter cannot be installed. Per artifact it checks that:
- every session really runs on the requested provider (read back from the session: an
  onnxruntime-gpu that cannot load CUDA otherwise falls back to the CPU in silence);
- the KV cache lives on that device between steps (the OrtValues' device);
- greedy speculative output equals greedy target-only output on that provider, token for
  token, for each drafter the artifact has, at a fixed K and at `auto` (a difference is
  allowed only where the top two logits are within NEAR_TIE: rounding may flip a near-tie);
and, with `--reference cpu`, where the provider's greedy text first parts from the CPU's
(fp16 vs fp32 rounding may flip a near-tie: reported with the logit gap, not failed).
It prints one JSON report and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path


from specdec.runtime.diagnostics import first_mismatch
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.providers import CPU, CUDA

PROMPTS = (
    "Copy this list exactly: red, green, blue, red, green, blue, red, green",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Once upon a time",
)
KV_DEVICE = {"cuda": "cuda", "cpu": "cpu"}  # session device -> OrtValue.device_name(), lower-cased
# A K+1-token verify call and a 1-token step run different kernels (and CUDA's fp32 matmuls
# may use TF32), so greedy output may part where the top two logits are this close.
NEAR_TIE = 1e-2


@dataclass
class ArtifactCheck:
    """What one artifact did on one provider."""

    artifact: str
    requested: str
    target_provider: str = ""
    draft_provider: str | None = None
    kv_device: str = ""
    runs: list[dict] = field(default_factory=list)  # one per prompt and configuration
    reference_mismatches: list[dict] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def check_artifact(artifact: Path, provider: str, max_new_tokens: int = 32, reference: str | None = None,
                   prompts: tuple[str, ...] = PROMPTS) -> ArtifactCheck:
    """Return the ArtifactCheck of `artifact` on `provider`; `failures` lists every check that failed."""
    check = ArtifactCheck(str(artifact), provider)
    engine = Engine.load(artifact, provider=provider)
    check.target_provider = engine.target.provider
    check.draft_provider = engine.draft.provider if engine.draft else None
    expected = {"cuda": CUDA, "cpu": CPU}.get(provider)
    for role, actual in (("target", check.target_provider), ("draft", check.draft_provider)):
        if expected and actual is not None and actual != expected:
            check.failures.append(f"{role} session runs on {actual}, not {expected}")

    cache = engine.target.new_cache(8)
    engine.target.forward(cache, engine.prompt_ids("hello"))
    check.kv_device = cache.tensors[0].device_name()
    wanted_device = KV_DEVICE.get(engine.target.device, "")
    if check.kv_device.lower() != wanted_device:
        check.failures.append(f"KV cache is on {check.kv_device}, not {wanted_device}")

    drafters = ["ngram"] + (["model"] if engine.draft else [])
    reference_engine = Engine.load(artifact, provider=reference) if reference and reference != provider else None
    for prompt in prompts:
        plain_ids, record = _run(engine, prompt, max_new_tokens, "none", None)
        check.runs.append(record)
        for drafter in drafters:
            for k in (4, "auto"):
                ids, record = _run(engine, prompt, max_new_tokens, drafter, k)
                record["greedy_equals_target_only"] = ids == plain_ids
                check.runs.append(record)
                mismatch = first_mismatch(engine, engine.prompt_ids(prompt), plain_ids, ids)
                if mismatch is not None:
                    record["first_mismatch"] = mismatch
                    if mismatch["top2_logit_gap"] > NEAR_TIE:
                        check.failures.append(f"greedy {drafter} K={k} differs from target-only on {prompt[:30]!r} "
                                              f"at token {mismatch['position']}, not a near-tie")
        if reference_engine is not None:
            reference_ids, _ = _run(reference_engine, prompt, max_new_tokens, "none", None)
            mismatch = first_mismatch(reference_engine, reference_engine.prompt_ids(prompt), reference_ids, plain_ids)
            if mismatch is not None:
                check.reference_mismatches.append({"prompt": prompt[:40], **mismatch})
    return check


def _run(engine: Engine, prompt: str, max_new_tokens: int, drafter: str,
         k: int | str | None) -> tuple[list[int], dict]:
    """Return the greedy output's token ids and a record of the run."""
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens, drafter=drafter,
                                                      num_draft_tokens=k))
    stats = result.stats
    return result.token_ids, {
        "prompt": prompt[:40],
        "drafter": drafter,
        "num_draft_tokens": str(k) if k else "0",
        "decode_tokens_per_second": round(stats.decode_tokens_per_second, 2),
        "tokens_per_target_call": round(stats.tokens_per_target_call, 3),
        "alpha": round(stats.alpha, 3),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the checks on each artifact, print the JSON report; return 0 if all passed, else 1."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+", type=Path, help="artifact folders to check")
    parser.add_argument("--provider", default="cuda", choices=["cuda", "cpu", "auto"],
                        help="provider to check (default: cuda)")
    parser.add_argument("--reference", default=None, choices=["cpu"],
                        help="also decode on this provider and report where greedy output first differs")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per generation (default: 32)")
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON report here")
    args = parser.parse_args(argv)
    import onnxruntime

    report = {
        "onnxruntime": onnxruntime.__version__,
        "available_providers": onnxruntime.get_available_providers(),
        "checks": [],
    }
    failed = False
    for artifact in args.artifacts:
        try:
            check = check_artifact(artifact, args.provider, args.max_new_tokens, args.reference)
        except Exception as err:  # noqa: BLE001 - one broken artifact must not hide the others' results
            check = ArtifactCheck(str(artifact), args.provider, failures=[f"{type(err).__name__}: {err}"])
        failed = failed or bool(check.failures)
        report["checks"].append(asdict(check))
    report["passed"] = not failed
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
