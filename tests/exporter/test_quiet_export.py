"""`specdec export` prints its own progress lines and real problems only: no notices our calls cause."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

from tests.conftest import smollm2_gguf

PROGRESS = re.compile(r"^\[\s*\d+\.\ds\] ")


def test_export_stderr_holds_only_progress_lines(tiny_sources, tmp_path):
    target, _ = tiny_sources["llama"]
    run = subprocess.run([sys.executable, "-m", "specdec.cli.main", "export", "--target", str(target), "--draft",
                          "none", "--output", str(tmp_path / "art")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    others = [line for line in run.stderr.splitlines() if line.strip() and not PROGRESS.match(line)]
    assert others == []  # optimum's own from_pretrained used to add "`torch_dtype` is deprecated!"


def test_the_gguf_tokenizer_loads_without_the_legacy_notice(caplog):
    """The mode transformers picks by default, chosen explicitly (same ids): nothing to say about it."""
    from transformers import AutoConfig
    from transformers.utils import logging as transformers_logging

    from specdec.exporter.sources import gguf_tokenizer

    gguf = smollm2_gguf()
    transformers_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
            caplog.clear()
            tokenizer = gguf_tokenizer(gguf, config)
    finally:
        transformers_logging.disable_propagation()
    assert not [r for r in caplog.records if "legacy" in r.getMessage()]
    assert tokenizer("Hello world").input_ids
