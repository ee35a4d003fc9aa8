"""The noise audit on the tiny model: controls, the FP8 effect, CSV, CLI."""

import csv
import math

import pytest
import torch

from experiments.audit import main, parse_args
from fp8rl.quant.audit import (
    AuditConfig,
    build_tiny_qwen3,
    format_table,
    run_audit,
    sample_sequences,
)

FAST = {"num_seqs": 8, "prompt_len": 4, "response_len": 12}


@pytest.fixture(scope="module")
def rows():
    cfg = AuditConfig(recipes=("bf16", "tensorwise", "blockwise"), lr=1e-6, **FAST)
    return {r.recipe: r for r in run_audit(cfg, model=build_tiny_qwen3(layers=1))}


def test_bf16_row_is_the_control(rows):
    r = rows["bf16"]
    assert r.n_tokens == 8 * 12
    assert r.lp_absdiff_mean == 0 and r.lp_diff_std == 0 and r.k3_kl == 0
    assert r.fp8_ratio_std == r.hp_ratio_std and r.noise_x == 1.0


def test_fp8_ratio_noise_exceeds_high_precision(rows):
    for name in ("tensorwise", "blockwise"):
        r = rows[name]
        assert r.lp_diff_std > 0 and r.k3_kl > 0
        # a tiny step (lr 1e-6): the high-precision ratio barely moves, FP8 rounding flips do
        assert r.noise_x > 3
        assert r.hp_ratio_std == rows["bf16"].hp_ratio_std


def test_k3_matches_its_formula():
    cfg = AuditConfig(recipes=("tensorwise",), **FAST)
    model = build_tiny_qwen3(layers=1)
    (row,) = run_audit(cfg, model=model)
    assert row.k3_kl >= 0 and math.isfinite(row.k3_kl)
    # same seed, same samples: the audit is deterministic
    (again,) = run_audit(cfg, model=model)
    assert again.lp_diff_std == row.lp_diff_std and again.fp8_ratio_std == row.fp8_ratio_std
    assert torch.equal(sample_sequences(model, cfg), sample_sequences(model, cfg))


def test_table_csv_and_cli(tmp_path, capsys):
    out = tmp_path / "audit.csv"
    main(["--recipes", "bf16", "rowwise", "--num-seqs", "4", "--prompt-len", "4",
          "--response-len", "6", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| recipe |" in printed and "| rowwise |" in printed
    with out.open() as fh:
        got = list(csv.DictReader(fh))
    assert [r["recipe"] for r in got] == ["bf16", "rowwise"]
    assert got[0]["cfg_recipes"] == "bf16;rowwise" and float(got[1]["lp_diff_std"]) > 0
    assert format_table([]).count("\n") == 1


def test_csv_goes_to_the_sweep_directory_not_the_current_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    tiny = ["--recipes", "bf16", "--num-seqs", "2", "--prompt-len", "4", "--response-len", "4"]
    main(tiny)
    assert not (tmp_path / "audit.csv").exists()
    assert (tmp_path / "runs" / "audit" / "audit.csv").is_file()
    main([*tiny, "--sweep-dir", str(tmp_path / "runs" / "main_table")])
    assert (tmp_path / "runs" / "main_table" / "audit.csv").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert "wrote " in capsys.readouterr().out


def test_bad_config_raises():
    with pytest.raises(KeyError, match="valid names"):
        AuditConfig(recipes=("tensorwize",))
    with pytest.raises(ValueError, match="clip_low"):
        AuditConfig(clip_low=1.2)
    with pytest.raises(ValueError, match="lr"):
        AuditConfig(lr=0)
    cfg, out = parse_args(["--no-emulate", "--hybrid"])
    assert cfg.emulate is False and cfg.hybrid is True and out == "runs/audit/audit.csv"
    assert parse_args(["--sweep-dir", "runs/main_table"])[1] == "runs/main_table/audit.csv"
    with pytest.raises(SystemExit):  # one place for the CSV
        parse_args(["--sweep-dir", "a", "--out", "b.csv"])


def test_the_reference_is_bf16_mixed_precision_by_default():
    """BF16 compute on fp32 masters is the reference: its own rounding moves the ratio more
    than fp32's does, and FP8 still moves it several times more."""
    assert AuditConfig().dtype == "bfloat16"
    model = build_tiny_qwen3(layers=1)
    bf16 = {r.recipe: r for r in run_audit(AuditConfig(recipes=("bf16", "tensorwise"), **FAST), model=model)}
    fp32 = {r.recipe: r for r in run_audit(AuditConfig(recipes=("bf16", "tensorwise"), dtype="float32", **FAST),
                                           model=model)}
    assert bf16["bf16"].hp_ratio_std > fp32["bf16"].hp_ratio_std  # BF16 rounding moves the ratio too
    assert bf16["tensorwise"].noise_x > 3 and fp32["tensorwise"].noise_x > 3
