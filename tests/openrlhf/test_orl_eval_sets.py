"""Minerva Math and OlympiadBench (the paper's fifth and sixth evaluation sets): loading from the
published schemas (sample rows written for these tests, not downloaded), preparation through
``--source name=path``, and grading of their labels (LaTeX, units, e-notation, answer lists)."""

import json
import sys
import types

import pytest
import yaml
from orl_grading import InlinePool
from orl_helpers import FIXTURES, REPO

from fp8rl.backends.openrlhf.config import OpenRLHFSettings
from fp8rl.backends.openrlhf.data import FORMATS, TEMPLATE, main, prepare
from fp8rl.backends.openrlhf.reward_func import score
from fp8rl.rewards.math_grader import sci_notation

NEW = ("minerva_math", "olympiadbench")


@pytest.fixture
def prepared(tmp_path, capsys):
    args = ["--out", str(tmp_path), "--names", *NEW]
    for n in NEW:
        args += ["--source", f"{n}={FIXTURES / f'{n}.jsonl'}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert all(f"{n}: " in out for n in NEW)
    return {n: [json.loads(ln) for ln in (tmp_path / f"{n}.jsonl").read_text().splitlines()] for n in NEW}


def test_paper_data_evaluates_on_the_six_sets():
    data = yaml.safe_load((REPO / "sweeps" / "data" / "paper.yaml").read_text())["openrlhf"]
    six = ["aime24", "aime25", "amc23", "math500", "minerva_math", "olympiadbench"]
    assert data["eval_sets"] == six and OpenRLHFSettings().eval_sets == six
    assert data["datasets"]["minerva_math"] == "math-ai/minervamath"
    assert data["datasets"]["olympiadbench"] == "Hothan/OlympiadBench"
    assert set(six) <= set(FORMATS)


def test_labels_and_prompts_from_the_published_schemas(prepared):
    minerva, olympiad = prepared["minerva_math"], prepared["olympiadbench"]
    assert [r["label"] for r in minerva] == ["0.48", "3.9e33", "e^{-2t}", "\\arcsin(2/3)", "\\frac{1}{s+a}"]
    assert [r["label"] for r in olympiad] == ["38", "\\frac{9}{10}", "-1,2", "(1,6), (2,3)", "48", "10"]
    assert minerva[2] == {"input": TEMPLATE.format(problem="Solve $\\dot{x}+2 x=0$ with $x(0)=1$."),
                          "label": "e^{-2t}", "datasource": "minerva_math"}
    assert olympiad[4]["input"] == TEMPLATE.format(problem="Let $T=7$.\n\nCompute $T^{2}-1$.")  # context first
    assert all(r["datasource"] == "olympiadbench" for r in olympiad)


def test_hub_reads_use_the_formats_split_and_config(tmp_path, monkeypatch):
    calls = []

    def load_dataset(hf_id, *args, split):
        calls.append((hf_id, args, split))
        return [{"question": "q", "answer": "1", "final_answer": ["$1$"]}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    prepare(NEW, tmp_path, {"minerva_math": "math-ai/minervamath", "olympiadbench": "Hothan/OlympiadBench"})
    assert calls == [("math-ai/minervamath", (), "test"), ("Hothan/OlympiadBench", ("OE_TO_maths_en_COMP",), "train")]


#: Per prepared row (fixture order): (boxed response, correct?) -- right answers in other
#: spellings (units, e-notation, LaTeX forms, permuted answer lists) and wrong ones.
GRADED = {
    "minerva_math": [
        [("0.48", True), ("0.48 \\mathrm{~cm}", True), ("0.49", False)],
        [("3.9 \\times 10^{33}", True), ("3.9e33", True), ("3.9\\times10^{33} \\mathrm{ergs} \\mathrm{s}^{-1}", True),
         ("3.9 \\times 10^{32}", False), ("4.0e33", False)],
        [("e^{-2t}", True), ("x(t)=e^{-2t}", True), ("e^{2t}", False)],
        [("\\arcsin{\\left(\\frac{2}{3}\\right)}", True), ("\\sin^{-1}(2/3)", True), ("\\arccos(2/3)", False)],
        [("\\frac{1}{s+a}", True), ("\\frac{1}{s-a}", False)],
    ],
    "olympiadbench": [
        [("38", True), ("62", False)],
        [("\\frac{9}{10}", True), ("0.9", True), ("\\frac{10}{11}", False)],
        [("2, -1", True), ("-1, 2", True), ("-1", False)],
        [("(2,3), (1,6)", True), ("(1,6)", False), ("(1,6),(2,3),(3,2)", False)],
        [("48", True), ("49", False)],
        [("10 \\text{ cm}", True), ("10", True), ("5\\sqrt{2}", False)],
    ],
}


@pytest.mark.parametrize("name", NEW)
def test_new_set_labels_grade_right_and_wrong_answers(prepared, name):
    rows, pool = prepared[name], InlinePool()
    assert len(rows) == len(GRADED[name])
    got = [[(resp, score(f"so \\boxed{{{resp}}}", "", row["label"], pool)["correct"]) for resp, _ in cases]
           for row, cases in zip(rows, GRADED[name], strict=True)]
    assert got == GRADED[name]


def test_sci_notation_rewrites_numbers_only():
    assert sci_notation("\\boxed{4.5e33}") == "\\boxed{4.5\\times10^{33}}"
    assert sci_notation("1.04e-3 and 2E+5") == "1.04\\times10^{-3} and 2\\times10^{5}"
    for untouched in ("3e^{-2t}", "C_{1}e^{t}", "x2e5", "e5", "\\frac{e^{-2t}}{15}"):
        assert sci_notation(untouched) == untouched
