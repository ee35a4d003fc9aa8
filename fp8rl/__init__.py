"""fp8rl: a harness for full-pipeline FP8 reinforcement learning of LLMs.

Reproduces "Towards Full Pipeline FP8 Reinforcement Learning for LLMs" (arXiv 2609.22870):
FP8 rollout + FP8 training, the PPO-ratio noise that pushes negative-advantage tokens past the
lower clip bound, and Calibrated Clipping. See README.md and docs/design.md.

The library imports with torch alone; GPU-cluster packages are imported lazily where needed.
"""

__version__ = "0.1.0"
