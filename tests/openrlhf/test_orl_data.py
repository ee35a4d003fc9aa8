"""Data preparation on small fixtures in the published schemas (no downloads)."""

import json

import pytest
from orl_helpers import FIXTURES

from fp8rl.backends.openrlhf.data import FORMATS, TEMPLATE, convert_rows, main, prepare, read_local


def test_every_format_converts_its_fixture(tmp_path):
    sources = {n: str(FIXTURES / f"{n}.jsonl") for n in FORMATS if (FIXTURES / f"{n}.jsonl").exists()}
    assert set(sources) == set(FORMATS) - {"aime25"}  # aime25 shares aime24's schema
    sources["aime25"] = sources["aime24"]
    paths = prepare(FORMATS, tmp_path, {}, sources=sources)
    rows = {n: [json.loads(ln) for ln in p.read_text().splitlines()] for n, p in paths.items()}
    assert rows["deepscaler"][1] == {"input": TEMPLATE.format(problem="Simplify $\\frac{2}{4}$."),
                                     "label": "\\frac{1}{2}", "datasource": "deepscaler"}
    assert len(rows["dapo_math_17k"]) == 2  # duplicate prompt dropped
    assert rows["dapo_math_17k"][0]["input"].startswith("How many primes are below 10?\n\nLet's think")
    assert rows["dapo_math_17k"][0]["label"] == "4"
    assert rows["amc23"][0]["label"] == "27"  # 27.0 -> 27
    assert rows["math500"][0]["datasource"] == "math500"
    assert all("\\boxed{}" in r["input"] for rs in rows.values() for r in rs)


def test_existing_files_are_kept_and_limits(tmp_path):
    src = {"deepscaler": str(FIXTURES / "deepscaler.jsonl")}
    p = prepare(["deepscaler"], tmp_path, {}, sources=src, limit=1)["deepscaler"]
    assert len(p.read_text().splitlines()) == 1
    prepare(["deepscaler"], tmp_path, {}, sources=src)
    assert len(p.read_text().splitlines()) == 1  # kept
    prepare(["deepscaler"], tmp_path, {}, sources=src, force=True)
    assert len(p.read_text().splitlines()) == 2


def test_cli_and_bad_input(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--names", "amc23", "--source", f"amc23={FIXTURES / 'amc23.jsonl'}"]) == 0
    assert "amc23" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown dataset"):
        list(convert_rows("gsm8k", []))
    with pytest.raises(ValueError, match="no Hugging Face id"):
        prepare(["aime24"], tmp_path / "x", {})
    with pytest.raises(ValueError, match="without problem or answer"):
        list(convert_rows("deepscaler", [{"problem": "", "answer": "1"}]))
    with pytest.raises(ValueError, match="unsupported file type"):
        read_local(tmp_path / "a.csv")
