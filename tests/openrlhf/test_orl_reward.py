"""The reward function file: boxed extraction, math-verify grading from threads, deadlines."""

import importlib.util
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from orl_helpers import FIXTURES, REPO

from fp8rl.backends.openrlhf.grading import GradingPool, last_boxed, response_of

GRADED = json.loads((FIXTURES / "graded.json").read_text())


def load_reward_file():
    """As OpenRLHF does: importlib by path under the module name ``reward_func``."""
    spec = importlib.util.spec_from_file_location("reward_func", REPO / "fp8rl/backends/openrlhf/reward_func.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def pool():
    p = GradingPool(workers=2, timeout_s=20.0)
    yield p
    p.close()


def test_boxed_extraction():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{{a}+{b}}") == "{a}+{b}"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("none") is None
    assert response_of("PROMPT<think>\\boxed{1}</think>\\boxed{2}", "PROMPT") == "\\boxed{2}"


def test_fixture_set_graded_from_worker_threads(pool):
    mod = load_reward_file()
    with ThreadPoolExecutor(4) as ex:  # OpenRLHF calls reward_func via asyncio.to_thread
        outs = list(ex.map(lambda g: mod.reward_func([g[0]], [""], [g[1]], pool=pool), GRADED))
    assert [o["rewards"] for o in outs] == [g[2] for g in GRADED]
    assert all(o["scores"] == o["rewards"] for o in outs)
    assert outs[4]["extra_logs"]["rollout/garbled_frac"] == 1.0  # no boxed answer
    assert all(o["extra_logs"]["reward/timeout_frac"] == 0.0 for o in outs)
    batch = mod.reward_func([g[0] for g in GRADED], [""] * len(GRADED), [g[1] for g in GRADED], pool=pool)
    assert batch["rewards"] == [g[2] for g in GRADED]
    assert batch["extra_logs"]["rollout/acc"] == pytest.approx(sum(g[2] for g in GRADED) / len(GRADED))


def test_pathological_input_times_out_off_the_main_thread():
    """sympy hangs for minutes on a tower of powers; the deadline scores it 0 and the pool recovers."""
    mod = load_reward_file()
    p = GradingPool(workers=1, timeout_s=60.0)
    try:
        assert p.grade("1", "1") == (True, False, False)  # warm the worker (spawn + math-verify import)
        p.timeout_s = 3.0
        with ThreadPoolExecutor(1) as ex:
            t0 = time.monotonic()
            out = ex.submit(mod.reward_func, ["\\boxed{9^{9^{9^{9}}}}"], [""], ["1"], p).result(timeout=60)
            took = time.monotonic() - t0
        assert out["rewards"] == 0.0 and out["extra_logs"]["reward/timeout_frac"] == 1.0
        assert 2.5 < took < 15
        assert p.timeouts == 1
        p.timeout_s = 60.0  # the replacement worker starts cold (spawn + sympy import): slow on a loaded machine
        assert p.grade("\\frac{1}{2}", "0.5") == (True, False, False)  # a fresh pool grades again
    finally:
        p.close()


def test_bad_pool_settings():
    with pytest.raises(ValueError):
        GradingPool(workers=0)
