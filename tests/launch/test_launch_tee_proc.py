"""Ctrl-C where a person presses it (issue 32, defects 4 and 6), on a real terminal (a pty).

- ``make reproduce 2>&1 | tee log`` and Ctrl-C: the terminal signals make, python and tee at
  once; tee dies. The launcher still stops its cells at a checkpoint (PREEMPTED, none left
  RUNNING to be found DIED), its summary reaches the terminal and ``<sweep>/launch.log``, and it
  prints ``make reproduce ...`` as the command to resume, which finishes the sweep.
- The venv's python typed by path from a shell without the venv active: the printed resume
  command is that python, and it runs from the same shell (``python`` there has no hydra).

Both shells have a ``PATH`` without the venv and no ``VIRTUAL_ENV``. Stand-in: this checkout may
have no ``.venv`` of its own, so make is given the test interpreter's ``bin`` (``BIN=...``) and
``-o install-run`` (nothing is installed); both are appended to the printed make command too.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fp8rl.runs import RunDir, read_manifest

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from pty_shell import PtyShell  # noqa: E402
from test_launch_interrupt_proc import _furthest  # noqa: E402  (the furthest step a RUNNING cell reached)

# long enough that a Ctrl-C at step 2 lands while the cells run on any machine: with 10 steps the
# cells of this tiny config finished before the stop reached them on an AVX-512 EPYC (a race)
STEPS = 40
BIN = os.path.join(sys.prefix, "bin")
FAST = ["algorithm=grpo", "model=8b", "fp8=bf16", "clip=vanilla,tis", f"steps={STEPS}", "checkpoint_every=0",
        "mini.sft_steps=0", "workers=2", "prompts_per_step=2", "num_mini_batches=2", "max_response_len=16",
        "eval_every=0", "eval_k=1", "algorithm.n_samples_per_prompt=2", "mini.n_train=64", "mini.n_eval=2",
        "mini.num_threads=1"]


def _shell_env() -> dict:
    """A shell without the venv: system PATH, no VIRTUAL_ENV (PYTHONPATH: this checkout's code)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    env["PYTHONPATH"] = str(REPO)
    env.pop("FP8RL_RESUME", None)
    return env


def _ctrl_c_at_step_2(cmd: str, sweep: Path) -> str:
    sh = PtyShell(cmd, REPO, _shell_env())
    if not sh.wait_for(lambda: _furthest(sweep) >= 2):
        pytest.fail(f"no cell reached step 2: {sh.finish(30)[1][-3000:]}")
    sh.ctrl_c()
    _code, out = sh.finish()
    return out


def _resume_line(out: str) -> str:
    (line,) = [x for x in out.replace("\r", "\n").splitlines() if x.startswith("resume with: ")]
    return line.removeprefix("resume with: ")


def _check_preempted_then_done(sweep: Path, resume: str) -> None:
    man = read_manifest(sweep)
    states = [RunDir(man.run_path(c)).state for c in man.cells]
    assert "RUNNING" not in states and "PREEMPTED" in states, states  # stopped, not killed
    res = subprocess.run(["bash", "-c", resume], cwd=REPO, env=_shell_env(), capture_output=True, text=True,
                         timeout=500)
    assert res.returncode == 0, (resume, res.stdout[-2000:], res.stderr[-3000:])
    for c in man.cells:
        rd = RunDir(man.run_path(c))
        assert rd.state == "DONE", (c.run_dir, rd.status())
        assert [r["step"] for r in rd.read_metrics()] == list(range(1, STEPS + 1))


@pytest.mark.slow  # whole launches in real processes, 10-30 s: the slow tier, which CI runs
def test_ctrl_c_under_make_reproduce_piped_to_tee(tmp_path):
    root = tmp_path / "runs"
    args = shlex.join([*FAST, f"output_dir={root}"])
    # the shell survives the Ctrl-C (its trap) to print what make exited with
    out = _ctrl_c_at_step_2(f"trap : INT; make -o install-run reproduce BIN={BIN} ARGS={shlex.quote(args)} 2>&1 "
                            f"| tee {tmp_path}/log; echo \"make exited ${{PIPESTATUS[0]}}\"", root / "main_table")
    assert "[main_table] stopped (Ctrl-C): " in out, out[-3000:]
    # 128 + SIGINT, as for the launcher alone; not 141 (make killed by SIGPIPE writing "Interrupt"
    # to the pipe whose tee the Ctrl-C killed)
    assert "make exited 130" in out, out[-1000:]
    assert "Traceback" not in out and "BrokenPipe" not in out, out[-3000:]
    resume = _resume_line(out)
    assert resume == f"make reproduce ARGS='{args}'", resume
    log = (root / "main_table" / "launch.log").read_text()
    assert "stopped (Ctrl-C): " in log and f"resume with: {resume}" in log, log
    _check_preempted_then_done(root / "main_table", f"{resume} -o install-run BIN={BIN}")


@pytest.mark.slow  # whole launches in real processes, 10-30 s: the slow tier, which CI runs
def test_the_printed_resume_command_works_from_a_shell_without_the_venv(tmp_path):
    root = tmp_path / "runs"
    one = [a for a in FAST if not a.startswith(("clip=", "workers="))] + ["clip=vanilla", "workers=1"]
    cmd = shlex.join([os.path.join(BIN, "python"), "-m", "experiments.launch", "+sweep=smoke", *one,
                      f"output_dir={root}"])
    out = _ctrl_c_at_step_2(cmd, root / "smoke")
    assert "[smoke] stopped (Ctrl-C): " in out, out[-3000:]
    resume = _resume_line(out)
    assert shlex.split(resume)[0] != "python", resume  # `python` here is not the venv's
    _check_preempted_then_done(root / "smoke", resume)
