"""``python -m experiments.launch --help``: what this launch can run, read from the config tree.

Lists the sweeps (``sweeps/sweep/*.yaml``, each with the first sentence of its header comment),
the scales, the cluster profiles (``slurm/profiles/``), the config groups with their options
and defaults, the main keys with their default values (the composed default config, so what
a launch without overrides uses) and one example per entry point (launch, status, report).
Hydra's own options stay under ``--hydra-help``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fp8rl.launch.keys import SWEEPS_DIR, config_groups

#: The main keys (beyond the config groups), with what they do; all other keys: ``--cfg job``.
MAIN_KEYS: tuple[tuple[str, str], ...] = (
    ("seeds", "seeds per cell: seed, seed+1, ... (an axis of the grid)"),
    ("seed", "the first seed"),
    ("steps", "RL steps per run"),
    ("prompts_per_step", "prompts per rollout batch"),
    ("lr", "learning rate of the policy body"),
    ("output_dir", "runs root: a sweep S lands in OUTPUT_DIR/S/"),
    ("sweep_name", "the sweep's directory under output_dir (each sweep file sets its own)"),
    ("dry_run", "expand, validate and print every cell; run and write nothing"),
    ("launcher", "local | local_parallel | slurm"),
    ("workers", "cells at once with launcher=local (null = one per CPU core)"),
    ("cluster", "cluster profile for launcher=slurm or scale=paper: a name below or a path"),
    ("wait", "block until every cell ends (null: local blocks, slurm returns)"),
    ("array_parallelism", "most cells at once on Slurm / with local_parallel"),
    ("gpus_per_node", "GPUs per node of every cell, replacing the profile's"),
    ("checkpoint_every", "checkpoint cadence in steps (0 = off)"),
    ("clip.period", "Calibrated Clipping's recalibration period in steps"),
    ("fp8.emulate", "FP8 by quantize-dequantize (CPU); false = FP8 kernels"),
    ("mini.num_threads", "torch threads per mini run (changes the numbers; part of the run identity)"),
    ("mini.device", "cpu or cuda[:i] (mini scale)"),
    ("logging.wandb_project", "also log to W&B (pip install -e '.[wandb]')"),
)

EXAMPLES = (
    ("launch", "python -m experiments.launch +sweep=quick seeds=3"),
    ("", "python -m experiments.launch +sweep=main_table dry_run=true"),
    ("", "python -m experiments.launch +sweep=main_table launcher=slurm cluster=example"),
    ("status", "python -m experiments.status runs/quick"),
    ("report", "python -m analysis.report runs/quick"),
)


def header_summary(path: Path, width: int = 78) -> str:
    """The first sentence of a YAML file's header comment (``# @package`` and ``Command:`` lines left out)."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text.startswith("@package"):
            continue
        if text.startswith(("Command:", "Grid:", "Example:", "Fields:")) or not text:
            break
        lines.append(text)
    text = " ".join(lines)
    text = re.sub(r"^(Paper artefact|(Scale|Backend) '[^']*'( \([^)]*\))?):\s*", "", text)
    text = re.sub(r"^none directly\.\s*", "", text)
    m = re.match(r"^none \((.*?)\)(\.|$)", text)
    if m:
        text = m.group(1)
    text = _first_clause(text)
    if len(text) > width:
        text = text[: width - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."
    return text


def _first_clause(text: str) -> str:
    """``text`` up to its first ``.``, ``;`` or ``:`` followed by a space outside parentheses."""
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth <= 0 and ch in ".;:" and text[i + 1: i + 2] == " ":
            return text[:i]
    return text.rstrip(".;:")


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (SWEEPS_DIR / group).glob("*.yaml"))


def _composed_defaults() -> Any:
    """The default launch config (no overrides), composed by Hydra; ``None`` if that fails."""
    try:
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        from fp8rl.launch.schema import register_configs

        register_configs()
        if GlobalHydra.instance().is_initialized():
            GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(SWEEPS_DIR), version_base=None):
            return compose("config")
    except Exception:  # the help must print even from a broken tree; then schema defaults
        return None


def _default_of(cfg: Any, key: str) -> str:
    from omegaconf import OmegaConf

    if cfg is None:
        return "?"
    value = OmegaConf.select(cfg, key, default="?")
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _group_defaults() -> dict[str, str]:
    from omegaconf import OmegaConf

    out = {}
    raw = OmegaConf.load(SWEEPS_DIR / "config.yaml")
    for entry in raw.get("defaults", []):
        if isinstance(entry, str) or not hasattr(entry, "items"):
            continue
        for k, v in entry.items():
            if "/" not in str(k) and not str(k).startswith("override"):
                out[str(k)] = str(v)
    return out


def launch_help() -> str:
    """The text of ``python -m experiments.launch --help``."""
    from fp8rl.launch.profiles import PROFILES_DIR, available_profiles

    cfg = _composed_defaults()
    out = [
        "usage: python -m experiments.launch [+sweep=NAME] [key=value ...] [group=option ...]",
        "",
        "Run a sweep of the paper's grid (algorithm x model x fp8 x clip x seed): expand it, validate",
        "every cell (an unknown key, group or value stops here: nothing runs), then run the cells on",
        "this machine or submit them to Slurm. No +sweep: one default run. Relaunching skips DONE",
        "cells and resumes interrupted ones. Comma-separated values make an axis: fp8=bf16,tensorwise.",
        "",
        "sweeps (+sweep=NAME):",
    ]
    for p in sorted((SWEEPS_DIR / "sweep").glob("*.yaml")):
        out.append(f"  {p.stem:<22} {header_summary(p, 72)}")
    out += ["", f"scales (scale=NAME, default {_default_of(cfg, 'scale')}):"]
    for p in sorted((SWEEPS_DIR / "scale").glob("*.yaml")):
        out.append(f"  {p.stem:<22} {header_summary(p, 72)}")
    out += ["", "cluster profiles (cluster=NAME or cluster=/path/to/profile.yaml; slurm/profiles/):"]
    for name in available_profiles():
        out.append(f"  {name:<22} {header_summary(PROFILES_DIR / f'{name}.yaml', 72)}")
    out += ["", "config groups (group=option; default first):"]
    defaults = _group_defaults()
    for g in config_groups():
        if g in ("sweep", "scale", "smoke_cell"):
            continue
        opts = _options(g)
        d = defaults.get(g)
        if d in opts:
            opts = [d, *[o for o in opts if o != d]]
        out.append(f"  {g:<22} {', '.join(opts)}")
    out += ["", "main keys (key=value; default at mini scale):"]
    for key, what in MAIN_KEYS:
        out.append(f"  {key + '=' + _default_of(cfg, key):<30} {what}")
    out += ["", "examples:"]
    for what, cmd in EXAMPLES:
        out.append(f"  {what + ':' if what else '':<8} {cmd}")
    out += [
        "",
        "Every key: add --cfg job (prints the composed config). Hydra's options: --hydra-help.",
        "Docs: docs/launch.md (sweeps and launching), docs/cluster.md (paper scale on Slurm).",
    ]
    return "\n".join(out)
