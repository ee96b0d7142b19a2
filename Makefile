# Two commands set up everything on a fresh machine: `make demo` and `make test`.
# Both create and reuse .venv; the CPU build of torch is installed first, pinned,
# so nothing pulls a CUDA build.
PY      := .venv/bin/python
STAMP   := .venv/.covrl-deps
DEPS    := pyproject.toml

.PHONY: demo test bench venv clean-runs

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

bench: $(STAMP)
	$(PY) -m pytest -q tests/bench -p no:cacheprovider -s

clean-runs:
	rm -rf runs
