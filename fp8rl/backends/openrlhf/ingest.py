"""OpenRLHF 0.11.2 log lines -> our ``metrics.jsonl`` / ``eval.jsonl`` (shared metric names).

Source: the driver's captured stdout/stderr (``<run>/openrlhf/driver.<attempt>.log``). OpenRLHF
prints every training step as ``... Global step N: {python dict repr}`` and every evaluation
as ``... Evaluation completed in H:MM:SS, global_step N, eval_metrics: {...}``; both dicts are
parsed with ``ast.literal_eval`` (they are Python reprs, not JSON; ``nan``/``inf`` are handled).
TensorBoard event files are also written (``--logger.tensorboard_dir``) for humans, but
ingestion reads the log lines only: they carry the same numbers and need no TensorBoard
package (the TB path is left out on purpose; see docs/cluster.md).

Key mapping (``KEY_MAP``; unknown keys are kept as ``openrlhf/<key>`` so nothing is lost):

===============================  ================================================================
OpenRLHF                         ours
===============================  ================================================================
``policy_loss``                  ``actor/pg_loss``
``actor_grad_norm``              ``actor/grad_norm``
``ppo_kl``                       ``actor/ppo_kl``
``ppo_clip_ratio``               ``actor/clipfrac``
``entropy_loss``                 ``actor/entropy`` (logged with ``--actor.entropy_coef 0``)
``vllm_kl``                      ``rollout/mismatch_kl`` **only if** the plugin's k3 estimate
                                 (logged as ``rollout/mismatch_kl``) is absent; else
                                 ``rollout/mismatch_k1`` (``vllm_kl`` is the k1 mean)
``is_filter_ratio``              ``rollout/is_clipfrac``
``rollout/reward_mean``          ``rollout/reward_mean``
``rollout/response_length_mean`` ``rollout/response_len``
``rollout/truncated_rate``       ``rollout/truncated_frac``
``dynamic_filtering_pass_rate``  ``dapo/kept_group_frac`` = rate / (100 x n), a fraction in
                                 [0, 1] (below; n from the run's ``config.yaml``)
``timing/step_total``            ``perf/step_s``; ``timing/generation`` -> ``perf/rollout_s``;
                                 ``timing/ppo_train`` -> ``perf/train_s``
===============================  ================================================================

Keys already in our vocabulary (``actor/clipfrac_neg_low``, ``clip/low``, ``shadow/*``, ``sc/*``,
``rollout/acc``, ``rollout/garbled_frac``, ...; written by the plugin and the reward function)
pass through unchanged. Evaluation: ``eval_<ds>_pass1`` -> ``eval/<ds>/avg@k`` (the mean 0/1
reward over the k samples = avg@k) and ``eval_<ds>_pass<k>`` -> ``eval/<ds>/pass@k``. OpenRLHF
averages the *rewards* there, so under the ``signed`` reward scheme (+1/-1, DAPO cells; the run's
``config.yaml``, ``openrlhf.reward_scheme``) it logs ``2 x accuracy - 1`` for both, and ingestion
maps them back: ``(v + 1) / 2`` (exact: evaluation rewards carry no overlong penalty, and the max
over k samples of +1/-1 is +1/-1 as well). ``rollout/reward_mean`` stays the mean reward as
OpenRLHF logs it (scheme and overlong penalty included); ``rollout/acc`` is the accuracy.

``dapo/kept_group_frac`` is the share of prompt groups dynamic filtering kept, a fraction in [0, 1]
at both scales. OpenRLHF logs ``dynamic_filtering_pass_rate = len(experiences) / prompts_consumed
x 100`` (``SamplesGenerator.generate_samples``), where ``experiences`` are *samples*, ``n =
algorithm.n_samples_per_prompt`` per kept group, and ``prompts_consumed`` counts every prompt the
step drew, the replacements of dropped groups included: 100 x n when every group is kept (400 at
n = 4). Ingestion divides by ``100 x n`` (:func:`kept_group_frac`), giving kept groups / prompts
drawn in the step. OpenRLHF replaces each dropped group with the next prompt until
``prompts_per_step`` groups are kept (a step whose prompts ran out first is dropped by the plugin
and logs nothing), so the value is ``prompts_per_step / prompts drawn``: a fixed number kept over
a random number of tries. The mini backend (``fp8rl.backends.mini.trainer``) logs kept groups /
groups of the step's *first* rollout round: a random number kept over ``prompts_per_step`` tries
(its refill rounds are not counted). Both estimate the same share, the probability that a prompt
group of the current policy has mixed rewards; with few groups per step the OpenRLHF ratio runs
above it on average (B = ``prompts_per_step``, X the prompts drawn, a sum of B geometric counts:
E[B / X] >= B / E[X] = p, Jensen), the mini one not. ``n`` comes from the run's ``config.yaml``
(``algorithm.n_samples_per_prompt``, or the ``n_samples_per_prompt`` argument); a log with a pass rate and no ``n`` raises rather than assume a default (every
``config.yaml`` fp8rl writes records ``n``, so a missing one is a run dir not written by fp8rl or a
damaged one, and a guessed ``n`` would put the metric on a second scale again). A converted value
outside [0, 1] raises too (the recorded ``n`` is not the one the run used).

Resumed runs print a step again after a restart: the last occurrence wins (the ingestion is a
pure function of the log files, rewritten atomically each time).
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from fp8rl.runs import metrics as M

STEP_RE = re.compile(r"Global step (\d+): (\{.*\})\s*$")
EVAL_RE = re.compile(r"global_step (\d+), eval_metrics: (\{.*\})\s*$")
_EVAL_KEY_RE = re.compile(r"^eval_(?P<ds>.+)_pass(?P<k>\d+)$")

KEY_MAP: dict[str, str] = {
    "policy_loss": M.ACTOR_PG_LOSS,
    "actor_grad_norm": M.ACTOR_GRAD_NORM,
    "ppo_kl": M.ACTOR_PPO_KL,
    "ppo_clip_ratio": M.ACTOR_CLIPFRAC,
    "entropy_loss": M.ACTOR_ENTROPY,
    "is_filter_ratio": M.ROLLOUT_IS_CLIPFRAC,
    "rollout/reward_mean": M.ROLLOUT_REWARD_MEAN,
    "rollout/response_length_mean": M.ROLLOUT_RESPONSE_LEN,
    "rollout/truncated_rate": M.ROLLOUT_TRUNCATED_FRAC,
    "timing/step_total": M.PERF_STEP_S,
    "timing/generation": M.PERF_ROLLOUT_S,
    "timing/ppo_train": M.PERF_TRAIN_S,
}
#: OpenRLHF's key for dynamic filtering's pass rate (samples kept per 100 prompts drawn).
PASS_RATE_KEY = "dynamic_filtering_pass_rate"
#: Our own names that arrive verbatim (plugin / reward function) and pass through.
PASSTHROUGH_PREFIXES = ("actor/", "clip/", "shadow/", "rollout/", "dapo/", "perf/", "reward/", "sc/")


class _Names(ast.NodeTransformer):
    """``nan`` / ``inf`` in a repr are names; turn them into float constants."""

    def visit_Name(self, node: ast.Name):
        if node.id in ("nan", "inf"):
            return ast.copy_location(ast.Constant(float(node.id)), node)
        return node


def parse_dict(text: str) -> dict:
    """A Python dict repr of numbers/strings/lists (``nan``, ``inf`` allowed) -> dict."""
    tree = _Names().visit(ast.parse(text, mode="eval"))
    return ast.literal_eval(ast.fix_missing_locations(tree))


def _number(v) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


def check_samples_per_prompt(n, where: str = "n_samples_per_prompt") -> int:
    """``n`` as the group size (an int >= 1); anything else raises, naming ``where``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{where}={n!r} must be an integer >= 1 (responses per prompt, the group size), "
                         f"needed to read OpenRLHF's {PASS_RATE_KEY} as a kept-group fraction")
    return n


def kept_group_frac(pass_rate: float, n_samples_per_prompt: int) -> float:
    """OpenRLHF's ``dynamic_filtering_pass_rate`` as ``dapo/kept_group_frac``: ``rate / (100 n)``.

    OpenRLHF 0.11.2: ``rate = samples kept / prompts drawn x 100`` with ``n`` samples per kept
    group, so the result is kept groups / prompts drawn, in [0, 1]; outside it (beyond rounding)
    the ``n`` given is not the run's, and it raises."""
    n = check_samples_per_prompt(n_samples_per_prompt)
    frac = float(pass_rate) / (100.0 * n)
    if not -1e-9 <= frac <= 1.0 + 1e-9:
        raise ValueError(
            f"{PASS_RATE_KEY}={pass_rate} is not in [0, 100 x n_samples_per_prompt] = [0, {100 * n}]: the run "
            f"kept more samples per prompt than n_samples_per_prompt={n} allows; the recorded n is not the n "
            "the run sampled with (check config.yaml's algorithm.n_samples_per_prompt against the command)")
    return min(max(frac, 0.0), 1.0)


def map_step(raw: Mapping, n_samples_per_prompt: int | None = None) -> dict:
    """One OpenRLHF step dict -> our metric names (numbers only; non-numbers dropped).

    ``n_samples_per_prompt``: the run's group size, which a dict with ``dynamic_filtering_pass_rate``
    needs (:func:`kept_group_frac`); without it such a dict raises."""
    out: dict[str, float | None] = {}
    for k, v in raw.items():
        x = _number(v)
        if x is None:
            continue
        if not math.isfinite(x):
            x = None
        if k in KEY_MAP:
            out[KEY_MAP[k]] = x
        elif k == PASS_RATE_KEY:
            if x is not None and n_samples_per_prompt is None:
                raise ValueError(
                    f"OpenRLHF logged {PASS_RATE_KEY}={x} (samples kept per 100 prompts drawn) but no "
                    "n_samples_per_prompt was given to turn it into dapo/kept_group_frac (kept groups / prompts "
                    "drawn): pass the run's algorithm.n_samples_per_prompt")
            out[M.DAPO_KEPT_GROUP_FRAC] = None if x is None else kept_group_frac(x, n_samples_per_prompt)
        elif k == "vllm_kl":
            continue
        elif k.startswith(PASSTHROUGH_PREFIXES):
            out.setdefault(k, x)
        else:
            out[f"openrlhf/{k}"] = x
    if "vllm_kl" in raw and _number(raw["vllm_kl"]) is not None:
        key = M.ROLLOUT_MISMATCH_KL if M.ROLLOUT_MISMATCH_KL not in raw else "rollout/mismatch_k1"
        out[key] = _number(raw["vllm_kl"])
    return out


def accuracy(value: float, scheme: str = "binary") -> float:
    """An OpenRLHF eval value (mean reward) as accuracy under reward ``scheme``."""
    if scheme == "binary":
        return value
    if scheme == "signed":
        return (value + 1.0) / 2.0
    raise ValueError(f"reward scheme {scheme!r} is not binary or signed (openrlhf.reward_scheme)")


def map_eval(step: int, raw: Mapping, sizes: Mapping[str, int] | None = None,
             scheme: str = "binary") -> list[dict]:
    """One evaluation dict -> ``eval.jsonl`` rows (one per dataset), as accuracies."""
    per: dict[str, dict[int, float]] = {}
    for key, v in raw.items():
        m = _EVAL_KEY_RE.match(key)
        if m and _number(v) is not None:
            per.setdefault(m.group("ds"), {})[int(m.group("k"))] = accuracy(float(v), scheme)
    rows = []
    for ds, by_k in sorted(per.items()):
        if 1 not in by_k:
            continue
        ks = sorted(k for k in by_k if k != 1)
        k = ks[-1] if ks else 1
        n = int((sizes or {}).get(ds, 1))
        rows.append(M.eval_row(step, ds, avg_at_k=by_k[1], pass_at_k=by_k.get(k) if ks else by_k[1], k=k, n=n))
    return rows


def parse_log(lines: Iterable[str]) -> tuple[dict[int, dict], dict[int, dict]]:
    """``(steps, evals)``: step -> raw OpenRLHF dict, last occurrence wins."""
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for line in lines:
        m = STEP_RE.search(line)
        if m:
            steps[int(m.group(1))] = parse_dict(m.group(2))
            continue
        m = EVAL_RE.search(line)
        if m:
            evals[int(m.group(1))] = parse_dict(m.group(2))
    return steps, evals


def log_files(run_dir: str | Path) -> list[Path]:
    """The driver logs of a run, oldest attempt first."""
    d = Path(run_dir) / "openrlhf"
    return sorted(d.glob("driver.*.log"), key=lambda p: int(p.stem.split(".")[-1]) if p.stem.split(".")[-1].isdigit() else 0)


def samples_per_prompt(config: Mapping | None) -> int | None:
    """``algorithm.n_samples_per_prompt`` of a recorded ``config.yaml`` dict; ``None`` when absent
    (a present but bad value raises)."""
    n = ((config or {}).get("algorithm") or {}).get("n_samples_per_prompt")
    return None if n is None else check_samples_per_prompt(n, "config.yaml algorithm.n_samples_per_prompt")


def ingest(run_dir: str | Path, *, eval_sizes: Mapping[str, int] | None = None,
           files: Iterable[str | Path] | None = None, scheme: str | None = None,
           n_samples_per_prompt: int | None = None) -> dict:
    """Rewrite ``metrics.jsonl`` and ``eval.jsonl`` of ``run_dir`` from its OpenRLHF logs.

    Returns ``{"steps": n, "evals": n, "last_step": s}``. Existing rows from our own
    ``experiments.evaluate`` (``source == "final"``) are kept in ``eval.jsonl``. ``scheme``: the
    reward scheme the evaluation values are in; ``None`` = the run's ``config.yaml`` (binary when
    it records none). ``n_samples_per_prompt``: the group size that turns OpenRLHF's pass rate into
    ``dapo/kept_group_frac``; ``None`` = the run's ``config.yaml``; a log with a pass rate and no
    ``n`` in either raises (module docstring).
    """
    from fp8rl.backends.openrlhf.config import reward_scheme
    from fp8rl.runs import RunDir
    from fp8rl.runs.rundir import atomic_write_text, dumps, read_jsonl

    rd = RunDir(run_dir)
    config = rd.config() or {}
    if scheme is None:
        scheme = reward_scheme(config)
    if n_samples_per_prompt is None:
        n_samples_per_prompt = samples_per_prompt(config)
    lines: list[str] = []
    for f in (files if files is not None else log_files(run_dir)):
        lines += Path(f).read_text(encoding="utf-8", errors="replace").splitlines()
    steps, evals = parse_log(lines)
    if n_samples_per_prompt is None and any(_number(raw.get(PASS_RATE_KEY)) is not None for raw in steps.values()):
        raise ValueError(
            f"{rd.config_path} records no algorithm.n_samples_per_prompt, which turns the log's {PASS_RATE_KEY} "
            "(samples kept per 100 prompts drawn) into dapo/kept_group_frac (kept groups / prompts drawn); "
            "a config.yaml fp8rl writes always has it: pass ingest(..., n_samples_per_prompt=n) with the run's n")
    rows = [{M.STEP: s, **map_step(raw, n_samples_per_prompt)} for s, raw in sorted(steps.items())]
    atomic_write_text(rd.metrics_path, "".join(dumps(r) + "\n" for r in rows))
    kept = [r for r in read_jsonl(rd.eval_path) if r.get("source") == "final"] if rd.eval_path.exists() else []
    erows = [row for s, raw in sorted(evals.items()) for row in map_eval(s, raw, eval_sizes, scheme)]
    atomic_write_text(rd.eval_path, "".join(dumps(r) + "\n" for r in erows + kept))
    return {"steps": len(rows), "evals": len(erows), "last_step": max(steps) if steps else 0}
