"""Paper datasets -> OpenRLHF prompt JSONL: ``python -m fp8rl.backends.openrlhf.data``.

Each dataset (Hugging Face ids in ``sweeps/data/paper.yaml``, ``openrlhf.datasets``) has a
*format* here: its split and how to read the problem and the answer from a row. Every output
row is ``{"input": <prompt>, "label": <answer>, "datasource": <name>}`` (OpenRLHF 0.11.2:
``--data.input_key input --data.label_key label``; ``datasource`` names the eval metric
``eval_<datasource>_pass1``). One file per dataset: ``<data_dir>/<name>.jsonl``.

==================  ==========  ====================================================================
name                split       row schema (as published)
==================  ==========  ====================================================================
``deepscaler``      train       ``problem``, ``answer``, ``solution``
``dapo_math_17k``   train       ``prompt`` (chat list, DAPO's instruction around the problem),
                                ``reward_model.ground_truth``; rows repeat: deduplicated by prompt
``aime24``          train       ``problem``, ``answer`` (HuggingFaceH4/aime_2024)
``aime25``          train       ``problem``, ``answer``
``amc23``           test        ``question``, ``answer`` (float-valued: ``27.0`` -> ``27``)
``math500``         test        ``problem``, ``answer``
``minerva_math``    test        ``question``, ``answer`` (math-ai/minervamath, 272 problems; LaTeX or
                                numeric answers, many in e-notation ``4.5e33``, one ``np.arcsin(..)``)
``olympiadbench``   train       config ``OE_TO_maths_en_COMP`` (Hothan/OlympiadBench: open-ended,
                                text-only, English, competition maths); ``question`` (after
                                ``context`` when one is given), ``final_answer`` (a list of LaTeX
                                strings such as ``["$\\frac{1}{2}$"]``)
==================  ==========  ====================================================================

Labels are normalised to one string that ``fp8rl.rewards.math_grader`` grades (it wraps a label in
``\\boxed{}``): ``$...$`` delimiters are dropped; an OlympiadBench list of several answers becomes
one comma-separated label (``"1, 2"``), which math-verify reads as a set (order-insensitive, as
OlympiadBench's multiple-answer problems mean); Minerva's Python-style ``np.arcsin(10/13)``
becomes ``\\arcsin(10/13)``. E-notation (``4.5e33``) is left as published: the grader reads it as
``4.5 \\times 10^{33}`` on both sides. Units stay out of labels (OlympiadBench keeps them in a
separate ``unit`` field; math-verify drops ``\\mathrm{~cm}``-style units from responses).

Which Hugging Face ids and schemas (checked against public code that loads these sets, not
against a download: this machine has no hub access): ``math-ai/minervamath`` (split ``test``,
``question``/``answer``, 272 problems) is the Minerva-Math (OCW courses) set common in math-RL
evaluations; its answers (``1.6``, ``4.5e33``, ...) are the ``\\boxed{}`` contents of the published
solutions, as in Qwen2.5-Math's copy. ``Hothan/OlympiadBench`` is the OlympiadBench authors' own
upload (linked from their repository); it has only a ``train`` split and one config per subset,
and ``OE_TO_maths_en_COMP`` (674 problems) is the text-only English maths subset that math-RL
papers report as "OlympiadBench". The FP8 paper does not say which copies it used (**a guess**).

Prompt template (**a guess**: the paper's template is not known): the problem followed by
``"Let's think step by step and output the final answer within \\boxed{}."`` (DeepScaleR's
instruction, matching the boxed-answer reward). For DAPO-Math-17k the problem is recovered from
DAPO's own instruction wrapper (``Solve the following math problem step by step. ...
Remember to put your answer on its own line after "Answer:"``) so that every set shares one
template. The chat template is applied by OpenRLHF (``--data.apply_chat_template``).

Rows are read with ``datasets.load_dataset`` (needs network or a local HF cache) or, for tests
and offline machines, from local JSON/JSONL/Parquet files with the same schema
(``--source name=path``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fp8rl.backends.openrlhf.prompts import TEMPLATE

_DAPO_PREFIX = re.compile(r"^\s*Solve the following math problem step by step\..*?\n\n", re.S)
_DAPO_SUFFIX = re.compile(r"\n\nRemember to put your answer on its own line after \"Answer:\"\.?\s*$", re.S)


def _answer_text(x) -> str:
    """Labels as text; integral floats (AMC's ``27.0``) lose their ``.0``."""
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return str(x).strip()


def _unmath(text: str) -> str:
    """A LaTeX answer without its ``$`` delimiters."""
    return text.replace("$", "").strip()


_NP_FUNC = re.compile(r"\bnp\.([A-Za-z]+)")


def _minerva_answer(row: dict) -> str:
    """Minerva's answer; Python's ``np.arcsin(x)`` (one published label) as LaTeX ``\\arcsin(x)``."""
    return _NP_FUNC.sub(lambda m: "\\" + m.group(1), _unmath(_answer_text(row["answer"])))


def _olympiad_problem(row: dict) -> str:
    context = (row.get("context") or "").strip()
    return f"{context}\n\n{row['question'].strip()}" if context else row["question"]


def _olympiad_answer(row: dict) -> str:
    """OlympiadBench's ``final_answer`` list as one label: ``["$1$", "$2$"]`` -> ``"1, 2"``."""
    answers = row["final_answer"]
    if isinstance(answers, str):
        answers = [answers]
    return ", ".join(a for a in (_unmath(str(x)) for x in answers) if a)


def _dapo_problem(row: dict) -> str:
    prompt = row["prompt"]
    text = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)
    return _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", text)).strip()


@dataclass(frozen=True)
class Format:
    """How to read one dataset: its split, the problem and the answer of a row."""

    split: str
    problem: Callable[[dict], str]
    answer: Callable[[dict], str]
    dedup: bool = False
    #: The Hugging Face config (subset) to load, if the dataset has several.
    config: str | None = None


FORMATS: dict[str, Format] = {
    "deepscaler": Format("train", lambda r: r["problem"], lambda r: _answer_text(r["answer"])),
    "dapo_math_17k": Format("train", _dapo_problem, lambda r: _answer_text(r["reward_model"]["ground_truth"]),
                            dedup=True),
    "aime24": Format("train", lambda r: r["problem"], lambda r: _answer_text(r["answer"])),
    "aime25": Format("train", lambda r: r["problem"], lambda r: _answer_text(r["answer"])),
    "amc23": Format("test", lambda r: r["question"], lambda r: _answer_text(r["answer"])),
    "math500": Format("test", lambda r: r["problem"], lambda r: _answer_text(r["answer"])),
    # the CPU smoke job's a+b problems (fp8rl.backends.openrlhf.smoke; ids fp8rl-smoke:<seed>:<count>)
    "smoke_train": Format("train", lambda r: r["problem"], lambda r: r["answer"]),
    "smoke_eval": Format("test", lambda r: r["problem"], lambda r: r["answer"]),
    "smoke_dapo": Format("train", lambda r: r["problem"], lambda r: r["answer"]),
    "minerva_math": Format("test", lambda r: r["question"], _minerva_answer),
    "olympiadbench": Format("train", _olympiad_problem, _olympiad_answer, config="OE_TO_maths_en_COMP"),
}


def convert_rows(name: str, rows: Iterable[dict], *, limit: int | None = None) -> Iterator[dict]:
    """Rows of dataset ``name`` -> OpenRLHF rows (deduplicated where the format says so)."""
    if name not in FORMATS:
        raise ValueError(f"unknown dataset {name!r}; known formats: {sorted(FORMATS)}")
    fmt, seen, n = FORMATS[name], set(), 0
    for row in rows:
        problem, answer = fmt.problem(row).strip(), fmt.answer(row)
        if not problem or not answer:
            raise ValueError(f"{name}: a row without problem or answer: {row!r:.200}")
        if fmt.dedup:
            if problem in seen:
                continue
            seen.add(problem)
        yield {"input": TEMPLATE.format(problem=problem), "label": answer, "datasource": name}
        n += 1
        if limit is not None and n >= limit:
            return


def read_local(path: Path) -> list[dict]:
    """Rows of a local ``.json`` (list), ``.jsonl`` or ``.parquet`` file."""
    if path.suffix == ".jsonl":
        return [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, list) else data["data"]
    if path.suffix == ".parquet":
        import pandas as pd

        return pd.read_parquet(path).to_dict("records")
    raise ValueError(f"{path}: unsupported file type (use .json, .jsonl or .parquet)")


def read_hf(hf_id: str, split: str, config: str | None = None) -> Iterable[dict]:
    from datasets import load_dataset  # lazy: the cluster extra brings it

    return load_dataset(hf_id, config, split=split) if config else load_dataset(hf_id, split=split)


def output_file(data_dir: str | Path, name: str) -> Path:
    return Path(data_dir) / f"{name}.jsonl"


def prepare(names: Iterable[str], data_dir: str | Path, hf_ids: dict[str, str], *,
            sources: dict[str, str] | None = None, limit: int | None = None, force: bool = False) -> dict[str, Path]:
    """Write ``<data_dir>/<name>.jsonl`` for each name; returns name -> path (existing files kept,
    but a smoke set, ``fp8rl-smoke:...``, is generated from its id each time and rewritten when its
    rows differ: a changed id in the sweep never trains on the rows of the old one)."""
    out: dict[str, Path] = {}
    sources = sources or {}
    for name in names:
        path = output_file(data_dir, name)
        out[name] = path
        smoke = str(hf_ids.get(name, "")).startswith("fp8rl-smoke:") and name not in sources
        if path.exists() and not force and not smoke:
            continue
        if name in sources:
            rows: Iterable[dict] = read_local(Path(sources[name]))
        elif str(hf_ids.get(name, "")).startswith("fp8rl-smoke:"):  # the CPU smoke job's problems
            from fp8rl.backends.openrlhf.smoke import dataset_rows

            rows = dataset_rows(hf_ids[name])
        elif name in hf_ids:
            rows = read_hf(hf_ids[name], FORMATS[name].split, FORMATS[name].config)
        else:
            raise ValueError(f"no Hugging Face id for dataset {name!r}: add it to openrlhf.datasets "
                             "(sweeps/data/paper.yaml) or pass --source NAME=PATH")
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in convert_rows(name, rows, limit=limit))
        if smoke and path.exists() and path.read_text(encoding="utf-8") == text:
            continue  # a smoke set is generated from its id every time: rewritten only when the id changed
        tmp = path.with_suffix(f".jsonl.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    return out


def main(argv: list[str] | None = None) -> int:
    import yaml

    p = argparse.ArgumentParser(prog="python -m fp8rl.backends.openrlhf.data",
                                description="Write the paper's datasets as OpenRLHF prompt JSONL.")
    p.add_argument("--out", required=True, help="output directory (openrlhf.data_dir)")
    p.add_argument("--names", nargs="*", default=sorted(FORMATS), help="datasets to write (default: all)")
    p.add_argument("--config", default=str(Path(__file__).resolve().parents[3] / "sweeps" / "data" / "paper.yaml"),
                   help="YAML with openrlhf.datasets (HF ids); default sweeps/data/paper.yaml")
    p.add_argument("--source", action="append", default=[], help="NAME=PATH: read a local file instead")
    p.add_argument("--limit", type=int, default=None, help="at most this many rows per dataset")
    p.add_argument("--force", action="store_true", help="rewrite existing files")
    args = p.parse_args(argv)
    hf_ids = (yaml.safe_load(Path(args.config).read_text()) or {}).get("openrlhf", {}).get("datasets", {})
    sources = dict(s.split("=", 1) for s in args.source)
    for name, path in prepare(args.names, args.out, hf_ids, sources=sources, limit=args.limit, force=args.force).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
