# Every target creates .venv if missing and installs the project into it first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The CPU wheel of torch; on a GPU machine use e.g. `make demo TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo notebooks test test-fast lint format benchmark gpu-wheels clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@# torch first and pinned, so the range in pyproject.toml never pulls a multi-GB CUDA build
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --no-compile "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-compile -e ".[dev]"
	@# Bytecode for every installed module, compiled on both cores at once. Python writes none
	@# where PYTHONDONTWRITEBYTECODE is set (as on our development and CI machines): every Ray
	@# worker, trainer and CLI process would compile torch, Ray and MLflow from source again,
	@# which more than doubled the CPU a tiny training run costs. Dependencies' own test folders
	@# are skipped; `|| true`: a few files in their testing helpers are written for newer
	@# Pythons and cannot compile, nor are they imported.
	$(PY) -m compileall -q -j 0 -x '/tests/' "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
	@touch $(STAMP)

# Only set up .venv with the package and its dev tools (what `raytrain-lm cluster up` needs).
install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/raytrain-lm train

# JupyterLab on the notebooks, from this venv: the `notebooks` extra (JupyterLab, with
# nbconvert), installed once. JUPYTER_PATH puts this venv's kernelspec first, so the notebooks'
# `python3` kernel is this venv's Python even where a user's own `python3` kernelspec exists.
# The server's root is the checkout: the notebooks show ../docs/images. As root (a container)
# Jupyter refuses to start without --allow-root. JUPYTER_ARGS adds options, e.g.
# `make notebooks JUPYTER_ARGS="--no-browser --port 8899"`.
NOTEBOOKS_STAMP := $(VENV)/.notebooks-stamp
JUPYTER_ARGS ?=
$(NOTEBOOKS_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-compile -e ".[dev,notebooks]"
	$(PY) -m compileall -q -j 0 -x '/tests/' "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
	@touch $(NOTEBOOKS_STAMP)

notebooks: $(NOTEBOOKS_STAMP)
	JUPYTER_PATH="$(abspath $(VENV))/share/jupyter" $(VENV)/bin/jupyter lab \
		--ServerApp.root_dir=. $$(test "$$(id -u)" = 0 && echo --allow-root) $(JUPYTER_ARGS) \
		notebooks/01_quickstart.ipynb

# Tests that start Rays of their own (chaos: a multi-node Ray whose nodes they kill, drain and
# bring back, under both fault-tolerance modes; own_ray: a cluster, a notebook kernel or a CLI
# sweep) run in a second pytest process beside those sharing the session's Ray. They spend much
# of their time waiting on nodes and processes, so a few long tests that mostly wait (beside)
# join them there, with a session Ray of that process. (A third process for the chaos tests
# made the suite slower, 32.8 minutes: it is CPU-bound, the 2 cores 97 % busy, and more
# processes only contend more.) Their output follows; the target fails if either fails.
ALONGSIDE := chaos or own_ray or beside
test: $(STAMP)
	@# The project's own bytecode too (see $(STAMP)): each test process imports it afresh.
	@$(PY) -m compileall -q raytrain_lm tests > /dev/null
	@$(VENV)/bin/pytest -q -p no:cacheprovider --durations=0 --durations-min=20 -m "$(ALONGSIDE)" > .tests-alongside.log 2>&1 & alongside=$$!; \
	$(VENV)/bin/pytest -q --durations=0 --durations-min=20 -m "not ($(ALONGSIDE))"; rest=$$?; \
	wait $$alongside; alongside_status=$$?; \
	echo "----- tests with Rays of their own (pytest -m \"$(ALONGSIDE)\"), run alongside -----"; \
	cat .tests-alongside.log; \
	test $$rest -eq 0 && test $$alongside_status -eq 0

# The inner loop: the tests that need no Ray (the model, configs, the loop's parts, the
# contracts), in under 3 minutes.
test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -p no:cacheprovider -m no_ray

# ruff (with its complexity rules) and the import contracts of pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

benchmark: $(STAMP)
	$(PY) benchmarks/ddp_overhead.py

# The wheels benchmarks/gpu_check.sh needs on the lent GPU machine (Python 3.12, no network):
# pydantic and what it needs, at the versions installed here (benchmarks/gpu_wheels.py), into
# .whl/ (a few MB), which travels with the tree: docs/benchmarks.md.
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
gpu-wheels: $(STAMP)
	rm -rf .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(addprefix --platform ,$(GPU_PLATFORMS)) -d .whl \
		$$($(PY) benchmarks/gpu_wheels.py)
	@ls .whl; du -sh .whl

clean:
	rm -rf runs data mlflow.db .pytest_cache
