"""Hydra plugin package of fp8rl (Hydra discovers plugins only under ``hydra_plugins``)."""
