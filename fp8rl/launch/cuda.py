"""What CUDA each cell's FP8 recipe needs, against what its cluster profile loads.

Transformer Engine's block-scaled recipes need a newer CUDA than the rest: ``Float8BlockScaling``
(the ``blockwise`` arm's trainer) CUDA >= 12.9, ``MXFP8BlockScaling`` (``mxfp8``) CUDA >= 12.8
(``fp8rl.quant.te``, docs/quant.md). A cluster profile says which CUDA its jobs get in its
``setup`` lines (``module load cuda/12.8``, ``export CUDA_HOME=/usr/local/cuda-12.8``, ...):
:func:`profile_cuda` reads the version from there (None when no line names one: nothing is
said). :func:`cuda_warnings` lists, once per recipe, the cells of a plan that need more than the
profile loads, with the fix; the dry run prints them under its heading and a launch before it
submits (a warning, not a refusal: the profile's module name may not be what the job's torch and
Transformer Engine run on, and the cells would fail at their first step naming the fix anyway).
Emulated cells (``fp8.emulate=true``, every mini cell) run no CUDA kernels and need nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

#: Transformer Engine recipe family (``fp8rl.quant.te.TE_KINDS``) -> (the CUDA it needs, in words).
TE_KIND_CUDA: dict[str, tuple[tuple[int, int], str]] = {
    "block": ((12, 9), "Transformer Engine's Float8BlockScaling"),
    "mxfp8": ((12, 8), "Transformer Engine's MXFP8BlockScaling"),
}
#: A CUDA version in a setup line: ``cuda/12.8``, ``CUDA/12.9.1``, ``cuda-12.8``, ``cuda12.8``.
_CUDA_IN_LINE = re.compile(r"\bcuda(?:toolkit)?[/\-_ ]?(\d+)\.(\d+)", re.IGNORECASE)


def profile_cuda(profile) -> tuple[tuple[int, int], str] | None:
    """``((major, minor), setup line)`` of the last setup line of ``profile`` that names a CUDA
    version, or None."""
    found = None
    for line in getattr(profile, "setup", ()) or ():
        for m in _CUDA_IN_LINE.finditer(line):
            found = ((int(m.group(1)), int(m.group(2))), line)
    return found


def cell_cuda_need(fp8: Mapping) -> tuple[tuple[int, int], str] | None:
    """``((major, minor), what)`` of the CUDA a cell's trainer recipe needs (its ``fp8`` config
    block), or None when it needs no particular one (emulated, or not a Transformer Engine recipe)."""
    if fp8.get("emulate", False):
        return None
    try:
        from fp8rl.quant import resolve_impl
        from fp8rl.quant.te import te_recipe_kind

        if resolve_impl(fp8["trainer_recipe"], fp8.get("impl", "auto"), emulate=False) != "transformer_engine":
            return None
        return TE_KIND_CUDA.get(te_recipe_kind(fp8["trainer_recipe"]))
    except (KeyError, ValueError):  # validated elsewhere
        return None


def _v(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def cuda_warnings(plan) -> list[str]:
    """One warning per trainer recipe whose cells need a newer CUDA than the plan's cluster
    profile loads (module docstring), naming the cells, the profile line and the fix."""
    have = profile_cuda(plan.profile) if plan.profile is not None else None
    if have is None:
        return []
    (version, line), prof = have, plan.profile
    short: dict[str, list] = {}
    needs: dict[str, tuple[tuple[int, int], str]] = {}
    for c in plan.cells:
        fp8 = (c.config or {}).get("fp8") or {}
        need = cell_cuda_need(fp8)
        if need is not None and version < need[0]:
            short.setdefault(fp8["trainer_recipe"], []).append(c)
            needs[fp8["trainer_recipe"]] = need
    out = []
    for recipe, cells in short.items():
        (want, what) = needs[recipe]
        first = ", ".join(c.run_dir.name for c in cells[:2]) + (" ..." if len(cells) > 2 else "")
        out.append(f"warning: {len(cells)} of {len(plan.cells)} cell(s) ({first}) train with fp8.trainer_recipe="
                   f"{recipe} ({what}), which needs CUDA >= {_v(want)}, but cluster profile {prof.name} "
                   f"loads CUDA {_v(version)} (setup: {line!r}); they would fail at their first "
                   f"step. Load CUDA >= {_v(want)} in the profile's setup (e.g. 'module load cuda/{_v(want)}'), "
                   f"or leave those cells out (fp8=... without {fp8_names(cells)})")
    return out


def fp8_names(cells) -> str:
    """The FP8 arms of ``cells``, comma-separated."""
    return ",".join(sorted({str((c.config or {}).get("fp8", {}).get("name")) for c in cells}))


__all__ = ["TE_KIND_CUDA", "cell_cuda_need", "cuda_warnings", "profile_cuda"]
