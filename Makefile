# Two commands set up everything on a fresh machine: `make demo` and `make test`.
# Both create and reuse .venv; the CPU build of torch is installed first, pinned,
# so nothing pulls a CUDA build. covrl itself is installed last, editable and without
# its dependencies (already there): the packages import from this checkout and the
# launchers are console scripts (.venv/bin/covrl-cluster, covrl-study, ...; pyproject.toml).
PY      := .venv/bin/python
STAMP   := .venv/.covrl-deps
DEPS    := pyproject.toml

BPY     := .venv-bench/bin/python
BSTAMP  := .venv-bench/.covrl-bench-deps
GPY     := .venv-gpu/bin/python
GSTAMP  := .venv-gpu/.covrl-deps

.PHONY: demo test bench bench-env venv venv-gpu test-gpu-contract test-gpu clean-runs

venv: $(STAMP)

$(STAMP): $(DEPS)
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
		print("\n".join(p["dependencies"] + p["optional-dependencies"]["test"]))' > .venv/requirements.txt
	$(PY) -m pip install -q -r .venv/requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	.venv/bin/covrl-cluster --gens 1 --learners 1 --run-dir runs/demo-$$(date +%Y%m%d-%H%M%S)

test: $(STAMP)
	$(PY) -m pytest -q tests/unit tests/integration

# All benchmarks in one go (tests/bench/results.json), then the README table rendered from it.
bench: $(STAMP) $(BSTAMP)
	$(PY) -m pytest -q tests/bench -p no:cacheprovider -s
	$(PY) tests/bench/readme_table.py --write

# Bench-only environment for the TRL comparison (tests/bench/test_bench_trl.py): TRL is not a covrl dependency.
bench-env: $(BSTAMP)

$(BSTAMP): $(DEPS)
	test -x $(BPY) || python3 -m venv .venv-bench
	$(BPY) -m pip install -q --upgrade pip
	$(BPY) -m pip install -q torch==2.13.0
	$(BPY) -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
		print("\n".join(p["dependencies"]))' > .venv-bench/requirements.txt
	$(BPY) -m pip install -q -r .venv-bench/requirements.txt trl==1.16.0
	touch $(BSTAMP)

# The GPU environment (.venv-gpu): vLLM from the gpu extra with its own torch 2.14.0 (CUDA build, ~9 GB),
# then covrl's dependencies, then covrl itself (editable, as in .venv). vLLM 0.33.0 is installed --no-deps and its
# declared requirements after it, with certifi unpinned: it asks for certifi>=2026.10.19, which the registry did not
# have on 2026-11-22.
venv-gpu: $(GSTAMP)

$(GSTAMP): $(DEPS)
	test -x $(GPY) || python3 -m venv .venv-gpu
	$(GPY) -m pip install -q --upgrade pip packaging
	$(GPY) -m pip install -q --no-deps "$$($(GPY) -c 'import tomllib; \
		print(next(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu"] if d.startswith("vllm")))')"
	$(GPY) -c 'import importlib.metadata as m; from packaging.requirements import Requirement as R; \
		rs = [R(s) for s in m.requires("vllm")]; \
		print("\n".join("certifi" if r.name == "certifi" else str(r).split(";")[0].strip() \
		for r in rs if not r.marker or r.marker.evaluate({"extra": ""})))' > .venv-gpu/requirements.txt
	$(GPY) -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
		print("\n".join(p["dependencies"] + p["optional-dependencies"]["test"]))' >> .venv-gpu/requirements.txt
	$(GPY) -m pip install -q -r .venv-gpu/requirements.txt
	$(GPY) -m pip install -q --no-deps -e .
	touch $(GSTAMP)

# Needs no GPU: the names, signatures and config objects actors/vllm_engine.py uses exist in the installed vLLM.
test-gpu-contract: $(GSTAMP)
	PYTHONPATH=. $(GPY) -m pytest -q -m vllm tests/unit/test_vllm_contract.py -p no:cacheprovider

# On a GPU machine: the real vLLM engine, the NCCL weight path (2+ GPUs), then launch/gpu_check.py.
test-gpu: $(GSTAMP)
	PYTHONPATH=. $(GPY) -m pytest -q -m gpu tests/gpu -p no:cacheprovider

clean-runs:
	rm -rf runs

# ---- GPU proof (launch/gpu_proof.py) --------------------------------------------------------------------------------
# A GPU machine without a registry gets covrl's missing packages as wheels in .whl/ (git-ignored; the device tool
# carries it). `make gpu-wheels` runs HERE, where pip reaches a registry: every wheel such a machine lacks, for
# CPython 3.12 on manylinux x86_64. That machine has torch 2.11 (CUDA), transformers 5.17 and the common packages
# (numpy, tokenizers, safetensors, huggingface-hub 1.x, httpx, typer, sympy, msgpack, ninja, einops, psutil,
# py-cpuinfo, packaging, tqdm, regex, pyyaml, pytest, tensorboard, matplotlib, pyarrow). What travels:
#   compiled: msgspec, pyzmq, pydantic-core (pydantic's core, for deepspeed);
#   pure:     transformers 5.20.2 (pyproject pins >=5.20,<5.21), huggingface-hub 1.33.0 (transformers 5.20 needs
#             >=1.31, 5.17 allowed >=1.5; its click/hf-xet minimums are for the CLI and downloads, not used offline),
#             math-verify + latex2sympy2_extended + antlr4 runtime, tomli_w, pydantic + annotated-types +
#             typing-inspection + typing-extensions (pydantic 2.14 needs >=4.16), hjson;
#   built:    deepspeed 0.19.8 (sdist only on the registry; pip reuses a wheel it built before).
WHEEL_PY ?= python3
GPU_PY ?= python3
GPU_WHEEL_TAGS := --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
GPU_WHEELS_COMPILED := msgspec==0.22.0 pyzmq==27.3.0 pydantic-core==2.50.5
GPU_WHEELS_PURE := transformers==5.20.2 huggingface-hub==1.33.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
	antlr4-python3-runtime==4.13.2 tomli_w==1.2.0 pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
	typing-extensions==4.16.0 hjson==3.1.0
GPU_PROOF_ARGS ?=

.PHONY: gpu-wheels gpu-proof

gpu-wheels:
	mkdir -p .whl
	$(WHEEL_PY) -m pip download -q $(GPU_WHEEL_TAGS) --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS_COMPILED)
	$(WHEEL_PY) -m pip download -q $(GPU_WHEEL_TAGS) --platform any -d .whl $(GPU_WHEELS_PURE)
	ls .whl/deepspeed-0.19.8-*.whl >/dev/null 2>&1 || $(WHEEL_PY) -m pip wheel -q --no-deps deepspeed==0.19.8 -w .whl
	@ls -1 .whl; du -sh .whl

# The one command for a machine with one NVIDIA GPU (no registry, no .venv): the carried wheels into /tmp/site,
# then every stage of launch/gpu_proof.py, run as a module from the repo root (covrl is not installed there; `-m`
# puts the checkout on sys.path and the script puts it on its children's PYTHONPATH). Results in $OUT (the device
# tool's folder) or runs/gpu-proof; the runs themselves (checkpoints, the 0.5B model) in /tmp/covrl-gpu-proof.
# E.g. GPU_PROOF_ARGS="--stages z3 --no-z3-resume".
gpu-proof:
	@if [ -d .whl ]; then $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
		--target /tmp/site .whl/*.whl || exit 1; fi
	PYTHONPATH=/tmp/site$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 $(GPU_PY) -m launch.gpu_proof \
		--out $${OUT:-runs/gpu-proof} --work $${GPU_PROOF_WORK:-/tmp/covrl-gpu-proof} $(GPU_PROOF_ARGS)
