# Two commands set up everything on a fresh machine: `make demo` and `make test`.
# Both create and reuse .venv; the CPU build of torch is installed first, pinned,
# so nothing pulls a CUDA build.
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
	touch $(STAMP)

demo: $(STAMP)
	$(PY) launch/cluster.py --gens 1 --learners 1 --run-dir runs/demo-$$(date +%Y%m%d-%H%M%S)

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
# then covrl's dependencies. vLLM 0.33.0 is installed --no-deps and its declared requirements after it,
# with certifi unpinned: it asks for certifi>=2026.10.19, which the registry did not have on 2026-11-22.
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
	touch $(GSTAMP)

# Needs no GPU: the names, signatures and config objects actors/vllm_engine.py uses exist in the installed vLLM.
test-gpu-contract: $(GSTAMP)
	PYTHONPATH=. $(GPY) -m pytest -q -m vllm tests/unit/test_vllm_contract.py -p no:cacheprovider

# On a GPU machine: the real vLLM engine, the NCCL weight path (2+ GPUs), then launch/gpu_check.py.
test-gpu: $(GSTAMP)
	PYTHONPATH=. $(GPY) -m pytest -q -m gpu tests/gpu -p no:cacheprovider

clean-runs:
	rm -rf runs
