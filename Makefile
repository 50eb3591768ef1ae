# rbln-ray developer entry points. `make setup` then `make test` is the whole story.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.rbln-ray-installed
# Side env for Rebellions' own vLLM plugin (vllm-rbln 0.12.0), the peer the benchmarks and
# tests/peer compare against; separate because both plugins are named `rbln` in vLLM.
PEER       := .venv-vllm-rbln
PEER_STAMP := $(PEER)/.peer-installed

.PHONY: setup peer-env test lint demo clean

setup: $(STAMP) $(PEER_STAMP)

peer-env: $(PEER_STAMP)

# Re-runs only when its inputs change (scripts/peer_env.sh explains each step).
$(PEER_STAMP): requirements-peer.txt scripts/peer_env.sh scripts/peer_env/torchvision_ops.py
	scripts/peer_env.sh $(PY) $(PEER)
	touch $(PEER_STAMP)

# Re-runs only when a requirements file changes, so a second `make setup` is instant.
$(STAMP): requirements.txt requirements-test.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -r requirements.txt -r requirements-test.txt
	# optimum-rbln pins +cpu torchvision/torchaudio/torchcodec builds PyPI lacks: no deps.
	$(BIN)/pip install --no-deps optimum-rbln==0.12.0
	# PyPI's torchvision breaks `import transformers` beside torch 2.13.0+cpu; nothing needs it.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	$(BIN)/pip install --no-deps -e .
	$(BIN)/python -c "import vllm, ray, transformers, rbln_ray; print('rbln-ray environment ready')"
	touch $(STAMP)

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint:
	$(BIN)/ruff check .

# The main job: the embedded default (demo model, 2 replicas, emulated ATOM, local Ray).
demo: setup
	$(BIN)/rbln-ray serve

clean:
	rm -rf $(VENV) $(PEER) build *.egg-info
