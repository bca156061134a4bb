# Every target creates .venv if missing and installs the project into it first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The CPU wheel of torch; on a GPU machine use e.g. `make demo TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint format benchmark clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# torch first and pinned, so the range in pyproject.toml never pulls a multi-GB CUDA build
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/raytrain-lm train

# Chaos tests need a multi-node Ray of their own and spend most of their time waiting for
# nodes to die, drain and come back, so they run in a second pytest process beside the others;
# their output follows. The target fails if either process fails.
test: $(STAMP)
	@$(VENV)/bin/pytest -q -p no:cacheprovider -m chaos > .chaos-tests.log 2>&1 & chaos=$$!; \
	$(VENV)/bin/pytest -q -m "not chaos"; rest=$$?; \
	wait $$chaos; chaos_status=$$?; \
	echo "----- chaos tests (pytest -m chaos), run alongside -----"; cat .chaos-tests.log; \
	test $$rest -eq 0 && test $$chaos_status -eq 0

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

benchmark: $(STAMP)
	$(PY) benchmarks/ddp_overhead.py

clean:
	rm -rf runs data mlflow.db .pytest_cache
