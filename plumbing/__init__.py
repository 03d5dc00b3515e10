"""The plumbing every script shares: a reader of an algorithm may skip this folder.

errors.py (UserError: bad input in one line), flags.py (the command line), tasks.py (data),
calc.py (the calculator task), chat_sums.py (the real-model task --data chat-sums), rg.py
(reasoning-gym's generators, --data rg:NAME), loading.py (models, LoRA, reward functions),
envs.py (--env and --tools episodes, their tool metrics), runs.py (the run folder, metrics,
checkpoints, resume, Ctrl-C, torchrun, and Keeper: every loop's run-keeping), ctrl_c.py (Ctrl-C
while a script's imports load), vllm_sampler.py (--vllm: vLLM's engine as the sampler). They
import common.py (the algorithmic core, one folder up) and never a script; common.py imports
nothing from here.
"""
