"""Bad inputs that used to be accepted and then hung or broke a run: each is refused at expand
time (exit status 1, nothing run, submitted or written) with a message naming the key, the bad
value and the valid values; their neighbours (negative, zero, huge, wrong type, unknown choice)
too. Cluster profiles: control characters in any string field are refused naming the field.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest


@dataclass
class _Result:
    code: int
    out: str
    err: str


def _launch_in_process(args: list[str], capsys) -> _Result:
    """``python -m experiments.launch ARGS`` in this process (Hydra speed, no torch import)."""
    import experiments.launch as launch

    old = sys.argv
    sys.argv = ["experiments/launch.py", *args]
    code = 0
    try:
        launch.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old
    cap = capsys.readouterr()
    return _Result(code, cap.out, cap.err)


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
