"""Paper scale and the FP4/FP6 arms: the dry run refuses every such cell before submission in one
line naming what its rollout side (GPU generation, vLLM method) and its trainer side (GPU
generation, Transformer Engine recipe and version) would need; the trainer-side text is the one
``convert_to_fp8`` raises on a node, so both places refuse alike. Starts one launcher process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUBBYTE_ARMS = ("nvfp4", "nvfp4_rn", "w4a16", "mxfp4", "mxfp6")
#: (rollout GPU generation, trainer GPU generation / library) each arm's line must name
NEEDS = {
    "nvfp4": ("Blackwell (sm100+)", "sm100/sm103) with Transformer Engine >= 2.8's NVFP4BlockScaling"),
    "nvfp4_rn": ("Blackwell (sm100+)", "Transformer Engine >= 2.8's NVFP4BlockScaling(disable_rht"),
    "w4a16": ("Ampere or newer (sm80+, Marlin FP4 W4A16)", "Transformer Engine 2.20.2 has no weight-only recipe"),
    "mxfp4": ("Blackwell (sm100+, FlashInfer W4A4) for vLLM 0.29's online mxfp4", "Transformer Engine 2.20.2 has MXFP8"),
    "mxfp6": ("Blackwell (sm100+)", "Transformer Engine 2.20.2 has MXFP8"),
}


def test_paper_dry_run_refuses_each_subbyte_arm_in_one_line(tmp_path):
    out = tmp_path / "runs"
    res = subprocess.run(
        [sys.executable, "-m", "experiments.launch", "scale=paper", f"fp8={','.join(SUBBYTE_ARMS)}",
         "cluster=example", "dry_run=true", f"output_dir={out}"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    text = res.stdout + res.stderr
    assert res.returncode != 0, text
    assert f"{len(SUBBYTE_ARMS)} problem(s) in {len(SUBBYTE_ARMS)} cell(s)" in text, text
    for arm in SUBBYTE_ARMS:
        lines = [ln for ln in text.splitlines() if f"fp8={arm} " in ln]
        assert len(lines) == 1, (arm, text)
        line = lines[0]
        rollout_need, trainer_need = NEEDS[arm]
        assert f"rollout {arm} needs {rollout_need}" in line, line
        assert f"trainer {arm} needs" in line and trainer_need in line, line
        assert "vLLM 0.29" in line and "refused at paper scale" in line, line
    assert not out.exists()


@pytest.mark.parametrize("arm", SUBBYTE_ARMS)
def test_trainer_refusal_is_the_conversion_refusal(arm):
    """The line given before submission and the error ``convert_to_fp8`` raises on a GPU node name
    the same needs (``fp8rl.quant.te.SUBBYTE_TRAINER_NEEDS``); an FP4/FP6 trainer behind an FP8
    rollout is refused too, naming the trainer side only."""
    from fp8rl.backends.openrlhf.plugin.fp8_rollout import check_paper_scale_recipes
    from fp8rl.backends.openrlhf.plugin.fp8_training import trainer_recipe_problem
    from fp8rl.quant import Fp8UnsupportedError, check_supported, get_recipe
    from fp8rl.quant.te import SUBBYTE_TRAINER_NEEDS

    need = SUBBYTE_TRAINER_NEEDS[arm]
    assert trainer_recipe_problem(arm) == f"trainer {arm} needs {need}"
    with pytest.raises(Fp8UnsupportedError) as node:
        check_supported(get_recipe(arm), impl="fp8rl", device_type="cuda", capability=(10, 0))
    assert need in str(node.value)
    with pytest.raises(ValueError) as cell:
        check_paper_scale_recipes("tensorwise", arm)
    assert need in str(cell.value) and "rollout" not in str(cell.value).split("refused at paper scale:")[1]
    assert "\n" not in str(cell.value)
    check_paper_scale_recipes("tensorwise", "tensorwise")  # FP8 arms pass
