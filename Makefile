# Two commands set up everything on a fresh machine: `make demo` and `make test`.
# Both create and reuse .venv; the CPU build of torch is installed first, pinned,
# so nothing pulls a CUDA build. covrl itself is installed last, editable and without
# its dependencies (already there): the packages import from this checkout and the
# commands are console scripts (.venv/bin/covrl: `covrl run`, `covrl study`, ...; pyproject.toml).
PY      := .venv/bin/python
STAMP   := .venv/.covrl-deps
DEPS    := pyproject.toml

BPY     := .venv-bench/bin/python
BSTAMP  := .venv-bench/.covrl-bench-deps
GPY     := .venv-gpu/bin/python
GSTAMP  := .venv-gpu/.covrl-deps

.PHONY: demo test check bench bench-env venv venv-gpu test-gpu-contract test-gpu clean-runs assets

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

# The pinned files (assets/pinned.json: the chain and grid base models, which only the CPU studies and their tests
# read) are kept in git history, not in the tracked tree, so the GPU machine's commands do not carry them
# (hardware/kit.py SPARE_BYTES). Every entry point that may read them writes back any that is missing, sha256-checked
# (common/pinned.py); when all are there it only hashes them (about 0.1 s), and it never overwrites a file that differs.
assets: $(STAMP)
	$(PY) -m common.pinned restore

demo: $(STAMP) assets
	.venv/bin/covrl run --gens 1 --learners 1 --run-dir runs/demo-$$(date +%Y%m%d-%H%M%S)

# The README's test command and CI's, in three phases: the unit tests two at a time (one per core); the integration
# tests that share the machine well two at a time, whole modules per worker, the longest first
# (tests/integration/conftest.py); then the `serial` ones one at a time (their timing assumes the machine to itself:
# autoscaling, frozen generators, Ray). `long` cases (pyproject.toml's markers) run in `make bench`, each beside a
# faster case here that checks the same path. docs/testing.md: which to run when.
test: $(STAMP) assets
	$(PY) -m pytest -q -n 2 tests/unit
	$(PY) -m pytest -q -n 2 --dist loadfile tests/integration -m "not long and not serial"
	$(PY) -m pytest -q tests/integration -m "serial and not long"

# The edit loop: the unit tests and one short end-to-end run (a recorded run, to the bit), in under 3 minutes.
check: $(STAMP) assets
	$(PY) -m pytest -q -n 2 tests/unit tests/integration -m "check or not slow"

# All benchmarks in one go (tests/bench/results.json), then the README table rendered from it.
bench: $(STAMP) $(BSTAMP) assets
	$(PY) -m pytest -q tests/integration -m long -p no:cacheprovider
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

# The GPU environment (.venv-gpu), for a GPU machine with a registry (`make test-gpu`; the contract tests use the
# light CPU envs below): vLLM from the gpu extra with its own torch 2.14.0 (CUDA build, ~9 GB),
# then covrl's dependencies, then covrl itself (editable, as in .venv). vLLM 0.33.0 is installed --no-deps and its
# declared requirements after it, with certifi unpinned: it asks for certifi>=2026.10.19, which the registry did not
# have on 2026-11-22.
venv-gpu: $(GSTAMP)

$(GSTAMP): $(DEPS)
	test -x $(GPY) || python3 -m venv .venv-gpu
	$(GPY) -m pip install -q --upgrade pip packaging
	$(GPY) -m pip install -q --no-deps "$$($(GPY) -c 'import tomllib; \
		print(next(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu"] if d.startswith("vllm")))')"
	$(GPY) -c 'import importlib.metadata as metadata; from packaging.requirements import Requirement; \
		rs = [Requirement(s) for s in metadata.requires("vllm")]; \
		print("\n".join("certifi" if r.name == "certifi" else str(r).split(";")[0].strip() \
		for r in rs if not r.marker or r.marker.evaluate({"extra": ""})))' > .venv-gpu/requirements.txt
	$(GPY) -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
		print("\n".join(p["dependencies"] + p["optional-dependencies"]["test"]))' >> .venv-gpu/requirements.txt
	$(GPY) -m pip install -q -r .venv-gpu/requirements.txt
	$(GPY) -m pip install -q --no-deps -e .
	touch $(GSTAMP)

# The contract environments (.venv-vllm-0.26.0, .venv-vllm-0.33.0; 2.7 GB each): CPU only, one per vLLM version
# covrl supports. The contract tests construct configs and inspect signatures, so vLLM's Python is enough: each env
# is the torch 2.13.0 CPU build and covrl's dependencies (as in .venv), then VLLM_CPU_DEPS, then vLLM itself with
# --no-deps (it pins a CUDA torch: 2.11.0 for 0.26, 2.14.0 for 0.33, and ~60 GPU-side packages the tests never
# import), then covrl (editable). VLLM_CPU_DEPS is exactly what importing the modules the tests touch needs, found by
# adding one missing module at a time until nothing raised ModuleNotFoundError (2026-11-26), each pinned and
# installed --no-deps: xgrammar declares triton (286 MB), which its import does not need. What vLLM logs as missing
# (vllm._C, triton) is not used by the tests. VLLM_WHEELS=DIR takes vLLM's wheel from DIR instead of the registry.
VLLM_CONTRACT := 0.26.0 0.33.0
VLLM_CPU_DEPS := pybase64==1.5.1 cbor2==6.3.0 cachetools==8.0.2 cloudpickle==3.1.3 uvloop==0.23.0 \
	prometheus-client==0.26.0 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 \
	multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 openai==3.57.0 openai-harmony==0.0.8 \
	fastapi==0.136.3 starlette==1.10.0 xgrammar==0.2.7 apache-tvm-ffi==0.1.10 llguidance==1.7.6
VLLM_CPU_DEPS_0.33.0 := partial-json-parser==0.2.1.1.post7
VLLM_WHEELS ?=
VSTAMPS := $(foreach v,$(VLLM_CONTRACT),.venv-vllm-$(v)/.covrl-deps)

.PHONY: venv-vllm
venv-vllm: $(VSTAMPS)

.venv-vllm-%/.covrl-deps: $(DEPS)
	test -x $(@D)/bin/python || python3 -m venv $(@D)
	$(@D)/bin/python -m pip install -q --upgrade pip
	$(@D)/bin/python -m pip install -q torch==2.13.0
	$(@D)/bin/python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
		print("\n".join(p["dependencies"] + p["optional-dependencies"]["test"]))' > $(@D)/requirements.txt
	$(@D)/bin/python -m pip install -q -r $(@D)/requirements.txt
	$(@D)/bin/python -m pip install -q --no-deps $(VLLM_CPU_DEPS) $(VLLM_CPU_DEPS_$*)
	$(@D)/bin/python -m pip install -q --no-deps $(if $(VLLM_WHEELS),--find-links $(VLLM_WHEELS)) vllm==$*
	$(@D)/bin/python -m pip install -q --no-deps -e .
	touch $@

# Needs no GPU: the names, signatures and config objects actors/vllm_engine.py uses exist in each supported vLLM.
# Runs every version, then one line per version ("vLLM 0.26.0: 12 passed"); fails if any version failed or passed
# nothing (pytest.importorskip turns an import error in vllm into skips).
test-gpu-contract: $(VSTAMPS)
	@status=0; for v in $(VLLM_CONTRACT); do \
		env=.venv-vllm-$$v; \
		got=$$($$env/bin/python -c 'import importlib.metadata as metadata; print(metadata.version("vllm"))') || exit 1; \
		[ "$$got" = "$$v" ] || { echo "$$env has vLLM $$got, not $$v: rm -rf $$env and rerun"; exit 1; }; \
		echo "== vLLM $$v ($$env)"; \
		PYTHONPATH=. $$env/bin/python -m pytest -q -m vllm tests/unit/test_vllm_contract.py -p no:cacheprovider \
			> $$env/contract.log 2>&1 || status=1; \
		cat $$env/contract.log; \
		tail -n 1 $$env/contract.log | grep -q passed || status=1; \
	done; \
	for v in $(VLLM_CONTRACT); do \
		echo "vLLM $$v: $$(tail -n 1 .venv-vllm-$$v/contract.log | sed -e 's/^=* *//' -e 's/ in [0-9.]*s.*$$//')"; \
	done; \
	exit $$status

# On a GPU machine: the real vLLM engine, the NCCL weight path (2+ GPUs), then hardware/check.py.
test-gpu: $(GSTAMP)
	PYTHONPATH=. $(GPY) -m pytest -q -m gpu tests/gpu -p no:cacheprovider

clean-runs:
	rm -rf runs

# ---- GPU proof (hardware/proof.py) --------------------------------------------------------------------------------
# A GPU machine without a registry (Python 3.12, torch 2.11.0+cu130, transformers 5.17) gets what it lacks to run
# covrl and vLLM 0.26.0 as the kit in .kit/ (git-ignored; hardware/kit.py says what is in it and why).
# `make gpu-kit` runs HERE, where pip reaches a registry; a second run reuses the downloads and archives. A command
# on the GPU machine carries .kit/common and ONE of .kit/bin-sm90 (primary: vLLM's _C pruned to sm_90) or
# .kit/bin-ptx (fallback: PTX kept); with the tracked tree it stays under 60 MiB (`python3 -m hardware.kit check`,
# and tests/unit/test_gpu_kit.py from hardware/kit_sizes.json, which the build updates: commit it).
# GPU_KIT_ARGS: e.g. "--wheel-cache DIR" (a folder that already holds wheels), "--with-transformers".
KIT_PY ?= python3
GPU_PY ?= python3
GPU_KIT_ARGS ?=
GPU_PROOF_ARGS ?=

.PHONY: gpu-kit gpu-wheels gpu-proof gpu-first-lease

gpu-kit:
	$(KIT_PY) -m hardware.kit build --out .kit $(GPU_KIT_ARGS)

gpu-wheels: gpu-kit

# The one command for a machine with one NVIDIA GPU (no registry, no .venv): the carried kit into /tmp/site,
# then every stage of hardware/proof.py, run as a module from the repo root (covrl is not installed there; `-m`
# puts the checkout on sys.path and the script puts it on its children's PYTHONPATH). Results in $OUT (the device
# tool's folder) or runs/gpu-proof; the runs themselves (checkpoints, the 0.5B model) in /tmp/covrl-gpu-proof.
# The proof stops starting stages GPU_PROOF_DEADLINE_S seconds in (a lease's command runs at most 9 minutes; the
# machine's start and the transfers take the rest of 12) and records the rest as not run. Seen on an H200
# (2026-11-26): vllm-kit 70 s, vllm-run 82 s, throughput 72 s (learner) + 72 s (model, torch and vLLM generation),
# the vLLM engine tests without gpu_check 40 s; so the torch stages z1 and z3 come after the deadline: later
# commands run them. Seen on an H100 (2026-11-27): tests 32 s, z1 255 s, z3 253 s (each with its resume half), so
# GPU_PROOF_ARGS="--stages tests,z1" and then GPU_PROOF_ARGS="--stages z3". Seen on an H200 (2026-11-27): vllm-tests
# with gpu_check 153 s, vllm-z3 153 s, tests 25 s, z1 194 s.
GPU_PROOF_DEADLINE_S ?= 480
.PHONY: gpu-proof-rehearse
gpu-proof:
	@if [ -d .kit ]; then $(GPU_PY) -m hardware.kit unpack --kit .kit --target /tmp/site || exit 1; fi
	PYTHONPATH=/tmp/site$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 $(GPU_PY) -m hardware.proof \
		--out $${OUT:-runs/gpu-proof} --work $${GPU_PROOF_WORK:-/tmp/covrl-gpu-proof} \
		--deadline-s $(GPU_PROOF_DEADLINE_S) $(GPU_PROOF_ARGS)

# The first GPU lease's command (docs/gpu.md, Pending item 1): the learner stage's FIRST_LEASE_PLAN, then the GPU
# tests in what time is left, everything within 480 s of this target's start (hardware/proof.py --first-lease), the
# kit's unpack included and timed: only its site tree (no vLLM runs here), so the device command carries
# .kit/common/site312.tar.xz and .kit/manifest.json. GPU_PROOF_ARGS="--rehearse-cpu" rehearses it on a CPU.
gpu-first-lease:
	@t0=$$(date +%s.%N); out=$${OUT:-runs/gpu-proof}; mkdir -p $$out; kitlog=; \
	if [ -d .kit ]; then kitlog=$$out/kit_unpack.log; \
		$(GPU_PY) -m hardware.kit unpack --no-vllm --kit .kit --target /tmp/site > $$kitlog 2>&1; rc=$$?; \
		cat $$kitlog; [ $$rc -eq 0 ] || exit 1; fi; \
	PYTHONPATH=/tmp/site$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 $(GPU_PY) -m hardware.proof --first-lease \
		--command-start-unix $$t0 --out $$out --work $${GPU_PROOF_WORK:-/tmp/covrl-gpu-proof} \
		$${kitlog:+--kit-log $$kitlog} $(GPU_PROOF_ARGS)

# The proof's CPU rehearsal, here: every stage at toy scale, with vLLM 0.26.0's Python taken from the kit's own tree
# (.kit/common/vllm-py.tar.xz, so vllm-kit proves that tree imports; the kit's site tree is for CPython 3.12 and
# stays packed) in the 0.26 contract env, which has covrl's dependencies and a CPU torch. The GPU-only parts are
# recorded as skipped, never as passed. Without a built kit, the env's own vLLM 0.26.0 is imported instead.
REHEARSE_DIR := /tmp/covrl-kit-rehearse
gpu-proof-rehearse: .venv-vllm-0.26.0/.covrl-deps
	rm -rf $(REHEARSE_DIR) && mkdir -p $(REHEARSE_DIR)/site
	if [ -f .kit/common/vllm-py.tar.xz ]; then tar -xJf .kit/common/vllm-py.tar.xz -C $(REHEARSE_DIR)/site; fi
	PYTHONPATH=$(REHEARSE_DIR)/site .venv-vllm-0.26.0/bin/python -m hardware.proof --rehearse-cpu \
		--out $(REHEARSE_DIR)/out --work $(REHEARSE_DIR)/work $(GPU_PROOF_ARGS)
