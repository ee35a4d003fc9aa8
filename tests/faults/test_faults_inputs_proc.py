"""Bad inputs that used to be accepted and then hung or broke a run: each is refused at expand
time (exit status 1, nothing run, submitted or written) with a message naming the key, the bad
value and the valid values; their neighbours (negative, zero, huge, wrong type, unknown choice)
too: a seed count that would expand for minutes, a step count no run can take, an empty
``output_dir``. A sweep file (or an option it selects) that is not valid YAML: one line with the
file, line and column, exit status 2. Cluster profiles: control characters in any string field
are refused naming the field.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


def _conftest(area: str):
    """``tests/<area>/conftest.py`` as a plain module (its helpers, not its fixtures)."""
    import importlib.util

    name = f"_faults_{area}_conftest"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / area / "conftest.py"
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


#: ``python -m experiments.launch ARGS`` in this process (the launch tests' helper).
_launch_in_process = _conftest("launch").run_launch


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


REFUSED = [
    # (id, overrides, substrings the message must contain)
    ("array-parallelism-negative", ["launcher=local_parallel", "array_parallelism=-1"],
     ["array_parallelism", "-1", ">= 1"]),
    ("array-parallelism-zero", ["launcher=local_parallel", "array_parallelism=0"],
     ["array_parallelism", "0", ">= 1"]),
    ("array-parallelism-wrong-type", ["array_parallelism=two"], ["array_parallelism", "two"]),
    ("max-response-len-above-positions", ["max_response_len=1000"],
     ["max_response_len", "1000", "256"]),
    ("max-response-len-just-above", ["max_response_len=242"], ["max_response_len", "242"]),
    ("max-response-len-huge", ["max_response_len=10000000000"], ["max_response_len"]),
    ("max-response-len-negative", ["max_response_len=-5"], ["max_response_len", "-5"]),
    ("max-response-len-zero", ["max_response_len=0"], ["max_response_len"]),
    ("device-missing", ["mini.device=cuda:7"], ["mini.device", "'cuda:7'", "cpu"]),
    ("device-negative-index", ["mini.device=cuda:-1"], ["mini.device", "cuda:-1", "cpu"]),
    ("device-garbage-index", ["mini.device=cuda:x"], ["mini.device", "cuda:x", "cpu"]),
    ("seed-negative", ["seed=-1"], ["seed", "-1", ">= 0"]),
    ("seed-huge", ["seed=100000000000000000000"], ["seed"]),
    ("seed-wrong-type", ["seed=abc"], ["seed", "abc"]),
    ("seed-negative-in-axis", ["seed=0,-2"], ["seed", "-2", ">= 0", "cell 2/2"]),
    ("fp8-name-free-text", ["fp8.name=whatever"], ["fp8.name", "'whatever'", "rowwise", "tensorwise"]),
    ("fp8-name-empty", ["fp8.name="], ["fp8.name"]),
    ("seeds-huge", ["seeds=100000000"], ["seeds=100000000", "100,000,000 cells", "seeds <= 10000"]),
    ("seeds-huge-grid", ["fp8=bf16,tensorwise", "seeds=6000"], ["seeds=6000", "12,000 cells", "seeds <= 5000"]),
    ("steps-huge", ["steps=99999999999999999999"], ["steps=99999999999999999999", "responses", "1000000"]),
    ("steps-just-above", ["steps=1000001"], ["steps=1000001", "1000000"]),
]


@pytest.mark.parametrize(("overrides", "expected"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_bad_value_refused_at_expand_time(capsys, tmp_path, overrides, expected):
    if overrides == ["mini.device=cuda:7"] and _cuda_count() > 7:
        pytest.skip("this machine has a cuda:7")
    res = _launch_in_process([*overrides, "dry_run=true", f"output_dir={tmp_path}/runs"], capsys)
    msg = res.err + res.out
    assert res.code == 1, msg
    assert "Traceback" not in msg, msg
    for s in expected:
        assert s in msg, f"{s!r} not in message:\n{msg}"
    assert not (tmp_path / "runs").exists()


ACCEPTED = [
    ["launcher=local_parallel", "array_parallelism=1"],
    ["steps=1000000"],
    ["seeds=3"],
    ["max_response_len=200"],
    ["mini.device=cpu"],
    ["seed=4294967295"],
    ["fp8=rowwise"],
]


@pytest.mark.parametrize("overrides", ACCEPTED, ids=[" ".join(a) for a in ACCEPTED])
def test_valid_neighbour_accepted(capsys, tmp_path, overrides):
    res = _launch_in_process([*overrides, "dry_run=true", f"output_dir={tmp_path}/runs"], capsys)
    assert res.code == 0, res.err + res.out
    assert "dry run" in res.out


REPO = Path(__file__).resolve().parents[2]


def _launch(args: list[str], cwd: Path, timeout: float = 120):
    """``python -m experiments.launch ARGS`` as a user runs it (a subprocess in ``cwd``)."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "experiments.launch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_huge_seed_count_is_refused_at_once(tmp_path):
    """``seeds=100000000`` used to expand for minutes, printing nothing, while memory grew."""
    proc = _launch(["seeds=100000000", "dry_run=true", f"output_dir={tmp_path}/runs"], tmp_path, timeout=60)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "seeds=100000000: the sweep would have 100,000,000 cells" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("overrides", [["output_dir="], ["output_dir= "]], ids=["empty", "blank"])
def test_an_empty_output_dir_is_refused_and_nothing_is_written_here(capsys, tmp_path, monkeypatch, overrides):
    monkeypatch.chdir(tmp_path)  # an empty path would be the current directory
    res = _launch_in_process([*overrides, "+sweep=smoke", "dry_run=false", "workers=1", "progress=false"], capsys)
    msg = res.err + res.out
    assert res.code == 1, msg
    assert "output_dir is empty" in msg and "Traceback" not in msg, msg
    assert list(tmp_path.iterdir()) == []


def test_an_empty_output_dir_is_refused_by_the_run_config():
    from fp8rl.backends.mini.config import MiniRunConfig

    with pytest.raises(ValueError, match="output_dir is empty"):
        MiniRunConfig(output_dir="")


# --- YAML errors in the config files a launch reads ------------------------------------------

_BROKEN = "# @package _global_\nsweep_name: mine\nsteps: 2\nhydra:\n  sweeper:\n    params:\n      fp8: [bf16,\n"


@pytest.mark.parametrize("where", ["sweep-file", "option-its-grid-names"])
def test_a_yaml_error_in_a_sweep_file_is_one_line_with_file_line_and_column(tmp_path, where):
    conf = tmp_path / "conf"
    (conf / "sweep").mkdir(parents=True)
    if where == "sweep-file":
        bad = conf / "sweep" / "mine.yaml"
        bad.write_text(_BROKEN)
        line, column = 8, 1
    else:  # the sweep parses; an fp8 option its grid names does not
        (conf / "sweep" / "mine.yaml").write_text(
            "# @package _global_\nsweep_name: mine\nhydra:\n  sweeper:\n    params:\n      fp8: bf16,myfp8\n")
        (conf / "fp8").mkdir()
        bad = conf / "fp8" / "myfp8.yaml"
        bad.write_text("# @package fp8\nname: tensorwise\n  emulate: true\n")
        line, column = 3, 10
    proc = _launch(["--config-dir", str(conf), "+sweep=mine", "dry_run=true", f"output_dir={tmp_path}/runs"],
                   tmp_path)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"Error: {bad}, line {line}, column {column}: "), lines[0]
    assert not (tmp_path / "runs").exists()


# --- cluster profiles -----------------------------------------------------------------------

_STRING_FIELDS = ("partition", "account", "qos", "constraint", "exclude", "container",
                  "container_mounts", "python")
_CONTROL = {"newline": "\n#SBATCH --x=1", "cr": "\r", "nul": "\x00", "escape": "\x1b[2J", "tab": "\t"}


def _profile_raw(**extra) -> dict:
    return {"partition": "gpu", "resources": {"default": {"nodes": 1, "time_min": 5}}, **extra}


@pytest.mark.parametrize("kind", sorted(_CONTROL))
@pytest.mark.parametrize("where", [*_STRING_FIELDS, "setup[1]", "additional_parameters.comment",
                                   "additional_parameters key"])
def test_profile_control_characters_refused(where, kind):
    from fp8rl.launch.profiles import ProfileError, parse_profile

    bad = "x" + _CONTROL[kind]
    if where == "setup[1]":
        raw = _profile_raw(setup=["module load cuda", bad])
    elif where == "additional_parameters.comment":
        raw = _profile_raw(additional_parameters={"comment": bad})
    elif where == "additional_parameters key":
        raw = _profile_raw(additional_parameters={bad: "1"})
    else:
        raw = _profile_raw(**{where: bad})
    with pytest.raises(ProfileError) as e:
        parse_profile(raw, name="mine", path="/p/mine.yaml")
    msg = str(e.value)
    assert "control character" in msg and "/p/mine.yaml" in msg, msg
    field = where.split(" ")[0].split("[")[0]
    assert field in msg, msg


@pytest.fixture
def _slurm_env():
    mod = _conftest("slurm")
    cluster, reason = mod.find_cluster()
    if cluster is None:
        if mod.slurm_required():
            pytest.fail(f"FP8RL_REQUIRE_SLURM is set and no local Slurm cluster: {reason}", pytrace=False)
        pytest.skip(f"no local Slurm cluster: {reason}")
    return cluster


def _sbatch_script(prof: Path, tmp_path: Path, capsys, monkeypatch, *, test_only: bool) -> str:
    """Launch the smoke sweep with profile ``prof`` through the launcher's real submitit path and
    return the sbatch script submitit wrote; nothing is queued (``test_only``: the local Slurm
    checks the script with ``sbatch --test-only``)."""
    import subprocess

    from submitit.slurm.slurm import SlurmExecutor

    scripts: list[str] = []

    def submit(self, path):  # fake the job id; Slurm only checks the script
        scripts.append(Path(path).read_text())
        if test_only:
            chk = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True, text=True, timeout=30)
            assert chk.returncode == 0, chk.stderr + scripts[-1]
        return ["echo", "Submitted batch job 424242"]

    monkeypatch.setattr(SlurmExecutor, "_make_submission_command", submit)
    res = _launch_in_process(["+sweep=smoke", "fp8=bf16", "launcher=slurm", f"cluster={prof}",
                              f"output_dir={tmp_path}/runs"], capsys)
    assert res.code == 0, res.err + res.out
    (script,) = scripts
    return script


@pytest.mark.slurm
def test_every_profile_field_reaches_a_valid_sbatch_script(_slurm_env, tmp_path, capsys, monkeypatch):
    """A profile using every field goes through the launcher's real submitit path; the sbatch
    script submitit writes carries each field, and the local Slurm accepts it (``sbatch
    --test-only``: checked, not queued)."""

    import yaml

    part = _slurm_env.partition
    prof = tmp_path / "every.yaml"
    prof.write_text(yaml.safe_dump({
        "partition": part, "account": None, "qos": None, "constraint": None, "exclude": None,  # one node here: no real value to exclude or constrain
        "array_parallelism": 1, "setup": ["export FP8RL_FAULTS_SETUP=1", "echo set up"],
        "container": "nvcr.io/nvidia/pytorch:24.05-py3", "container_mounts": "/data:/data",
        "python": "python3 -X faulthandler", "signal_delay_s": 45, "max_num_timeout": 2,
        "additional_parameters": {"comment": "fp8rl_faults"},
        "resources": {"default": {"nodes": 1, "gpus_per_node": 0, "cpus_per_task": 1, "mem_gb": None,
                                  "time_min": 7}},
    }))
    script = _sbatch_script(prof, tmp_path, capsys, monkeypatch, test_only=True)
    for line in (f"#SBATCH --partition={part}", "#SBATCH --array=0-1%1",
                 "#SBATCH --signal=USR2@45", "#SBATCH --comment=fp8rl_faults", "#SBATCH --time=7",
                 "#SBATCH --cpus-per-task=1", "export FP8RL_FAULTS_SETUP=1",
                 "--container-image=nvcr.io/nvidia/pytorch:24.05-py3", "--container-mounts=/data:/data",
                 "python3 -X faulthandler -u -m submitit.core._submit"):
        assert line in script, f"{line!r} not in the sbatch script:\n{script}"


@pytest.mark.slurm
def test_profile_fields_this_cluster_cannot_honour_still_reach_the_script(_slurm_env, tmp_path, capsys,
                                                                         monkeypatch):
    """``account``, ``qos``, ``constraint`` and ``exclude`` name things the one-node local cluster
    does not have (``sbatch --test-only`` would refuse them there), so this checks the script
    submitit writes through the launcher's real path carries each one, unsubmitted. Memory: a mini
    cell asks for its own (``MINI_MEM_GB``), not the profile's ``mem_gb`` (sized for paper cells)."""
    import yaml

    from fp8rl.backends.mini.run import MINI_MEM_GB

    prof = tmp_path / "site.yaml"
    prof.write_text(yaml.safe_dump({
        "partition": _slurm_env.partition, "account": "proj-fp8", "qos": "high", "constraint": "h100",
        "exclude": "node[01-02]", "array_parallelism": 1,
        "resources": {"default": {"nodes": 1, "gpus_per_node": 0, "cpus_per_task": 1, "mem_gb": 12,
                                  "time_min": 7}},
    }))
    script = _sbatch_script(prof, tmp_path, capsys, monkeypatch, test_only=False)
    for line in ("#SBATCH --account=proj-fp8", "#SBATCH --qos=high", "#SBATCH --constraint=h100",
                 "#SBATCH --exclude='node[01-02]'", f"#SBATCH --mem={MINI_MEM_GB}GB"):
        assert line in script, f"{line!r} not in the sbatch script:\n{script}"


@pytest.mark.slurm
def test_an_array_sbatch_refuses_is_one_clear_error(_slurm_env, tmp_path, capsys):
    """A request the cluster cannot satisfy (a GPU on the local cluster, which has none) is refused
    by the real sbatch: the launcher says what was asked and sbatch's reason in one error, with no
    traceback, and nothing is queued."""
    import yaml

    prof = tmp_path / "gpu.yaml"
    prof.write_text(yaml.safe_dump({
        "partition": _slurm_env.partition,
        "resources": {"default": {"nodes": 1, "gpus_per_node": 1, "cpus_per_task": 1, "time_min": 5}},
    }))
    # a CUDA mini cell asks the profile's nodes for one GPU; the expand-time device check is for
    # this machine's launchers, not Slurm nodes
    res = _launch_in_process(["+sweep=smoke", "fp8=bf16", "clip=vanilla", "mini.device=cuda", "launcher=slurm",
                              f"cluster={prof}", f"output_dir={tmp_path}/runs"], capsys)
    assert res.code == 1, res.out + res.err
    text = res.out + res.err
    assert "sbatch refused the array of 1 cell(s) asking for 1 node(s) x 1 GPU(s)" in text, text
    assert "gres" in text.lower() and "nothing was submitted" in text, text
    assert "Traceback" not in text, text
