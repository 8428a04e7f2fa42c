"""The runtime must run where torch and transformers cannot even be imported."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import importlib.abc, sys

    BLOCKED = ("torch", "transformers", "optimum", "onnx")

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Block())
    from specdec.runtime import Engine, GenerationConfig
    from specdec.cli.main import main  # the CLI module must not pull them in either

    engine = Engine.load(sys.argv[1], provider="cpu")
    result = engine.generate("The quick brown fox", GenerationConfig(max_new_tokens=12, num_draft_tokens=3))
    sampled = engine.generate("Hello", GenerationConfig(max_new_tokens=8, temperature=0.9, drafter="ngram"))
    assert len(result.token_ids) == 12 and sampled.token_ids
    from tokenizers import Tokenizer  # structured outputs: the grammar engine must not pull them in either
    from specdec.runtime.grammar import GrammarSpec, compile_grammar, grammar_tokenizer
    adapter = grammar_tokenizer(Tokenizer.from_file(sys.argv[1] + "/tokenizer/tokenizer.json"), [2])
    assert compile_grammar(GrammarSpec("json_object"), adapter).start(adapter.vocab_size).allowed([])[1].any()
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("runtime ok without", ", ".join(BLOCKED))
""")


def test_runtime_runs_without_torch_or_transformers(tiny_artifacts):
    completed = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_artifacts["llama"])],
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "runtime ok" in completed.stdout


def test_blocker_really_blocks():
    completed = subprocess.run([sys.executable, "-c", SCRIPT.split("from specdec")[0] + "import torch"],
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode != 0 and "blocked" in completed.stderr


NO_ONNXRUNTIME = textwrap.dedent("""
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "onnxruntime":
                raise ImportError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, Block())
""")


def test_without_onnxruntime_the_runtime_says_what_to_install(tiny_artifacts, tmp_path):
    """onnxruntime comes from the `cpu` or `gpu` extra; with neither, a clear message, not a traceback."""
    library = NO_ONNXRUNTIME + textwrap.dedent("""
        try:
            from specdec.runtime import Engine
        except ImportError as err:  # a library user catches it as an ImportError
            print("ImportError:", err)
    """)
    completed = subprocess.run([sys.executable, "-c", library], capture_output=True, text=True, timeout=60)
    assert "ImportError: specdec's runtime needs onnxruntime: pip install 'specdec[cpu]'" in completed.stdout

    cli = NO_ONNXRUNTIME + "from specdec.cli.main import main\nmain()"
    for args in (["generate", str(tiny_artifacts["llama"]), "hi"],
                 ["export", "--target", "x.gguf", "--draft", "none", "-o", str(tmp_path / "art")]):
        completed = subprocess.run([sys.executable, "-c", cli, *args], capture_output=True, text=True, timeout=60)
        assert completed.returncode == 1, completed.stderr[-2000:]
        assert completed.stderr.strip().splitlines() == [
            "Error: specdec's runtime needs onnxruntime: pip install 'specdec[cpu]', "
            "or 'specdec[gpu]' (onnxruntime-gpu) on a CUDA machine"]
        assert not (tmp_path / "art").exists()
    helped = subprocess.run([sys.executable, "-c", cli, "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "generate" in helped.stdout
