"""The sweep display while a warm start trains (issue 32, defect 5): instead of ``starting`` for
minutes, a bar of its own with its steps and ETA (terminal) or a part of the line (elsewhere),
read from the progress file a real warm start writes, found through the backend's hook from a
real cell plan."""

from __future__ import annotations

import dataclasses
import io
import re

from fp8rl.backends.mini import sft
from fp8rl.launch.grid import CellPlan
from fp8rl.launch.progress import SweepProgress

STEPS = 40
MINI = ["mini.n_train=64", "mini.n_eval=2", "mini.sft_batch_size=4", "mini.min_terms=2", "mini.max_terms=3",
        "mini.max_operand=9", "mini.num_threads=1", f"mini.sft_steps={STEPS}"]


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_the_display_shows_a_real_warm_start_with_its_steps_and_eta(tmp_path, monkeypatch):
    from fp8rl.backends.mini.__main__ import parse_config
    from fp8rl.backends.mini.run import prepare_warm_start, resolve_run_dir

    cfg = parse_config([*MINI, "steps=3", f"mini.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'runs'}"])[0]
    cell = CellPlan(index=1, total=1, overrides=(), seed=0, backend="mini", config=dataclasses.asdict(cfg),
                    run_dir=resolve_run_dir(cfg), name="cell", hash="", axes={}, steps=cfg.steps)
    tty, plain = Tty(), io.StringIO()
    bar_view, line_view = SweepProgress([cell], name="s", stream=tty), SweepProgress([cell], name="s", stream=plain)
    bar_view.tty, bar_view._bar = True, bar_view._make_bar()
    seen = {}
    original = sft.sft_batch

    def look(*a):  # once a step, inside the real warm start's loop
        seen["calls"] = seen.get("calls", 0) + 1
        if seen["calls"] == 21:  # 20 steps done (the file is rewritten every step of 40)
            seen["line"] = line_view.line()[0]
            bar_view._update_bar()
            seen["bar"] = tty.getvalue()
        return original(*a)

    monkeypatch.setattr(sft, "sft_batch", look)
    prepare_warm_start(cfg)
    assert re.search(rf"\| starting \| warm start 8b 20/{STEPS} ETA \d+:\d\d \| elapsed", seen["line"]), seen["line"]
    screen = seen["bar"].split("\r")
    assert any(re.fullmatch(rf"warm start 8b +50%\|\S+ *\| 20/{STEPS}, ETA \d+:\d\d\s*", x.split("\x1b")[0])
               for x in screen), screen
    assert "ETA after the warm start" in seen["bar"]
    # done: the part and the bar are gone
    assert "warm start" not in line_view.line()[0]
    bar_view._update_bar()
    assert not bar_view.prep._bars
    bar_view._bar.close()
