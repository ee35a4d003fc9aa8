import json

import pytest

from fp8rl.runs.manifest import AXES, Cell, read_manifest, write_manifest

AX = {"algorithm": "grpo", "model": "8b", "fp8": "bf16", "clip": "vanilla", "seed": 0,
      "scale": "mini"}


def cell(i=0, **kw):
    d = dict(name=f"grpo-8b-bf16-vanilla-s{i}", hash="0123abcd",
             run_dir=f"grpo-8b-bf16-vanilla-s{i}-0123abcd", axes={**AX, "seed": i},
             overrides=["fp8=bf16"])
    d.update(kw)
    return Cell(**d)


def test_roundtrip(tmp_path):
    cells = [cell(0), cell(1, job_id=1234)]
    path = write_manifest(tmp_path, "fig1", cells)
    raw = json.loads(path.read_text())
    assert raw["sweep"] == "fig1" and raw["created"].endswith("Z")
    assert raw["cells"][1]["job_id"] == "1234"
    m = read_manifest(tmp_path)
    assert m.sweep == "fig1" and len(m.cells) == 2
    assert m.cells[0] == cells[0]
    assert m.cells[1].job_id == "1234"
    assert m.run_path(m.cells[0]) == tmp_path / "grpo-8b-bf16-vanilla-s0-0123abcd"
    assert tuple(AXES) == ("algorithm", "model", "fp8", "clip", "seed", "scale")


def test_rewrite_keeps_created(tmp_path):
    write_manifest(tmp_path, "fig1", [cell(0)])
    created = json.loads((tmp_path / "manifest.json").read_text())["created"]
    (tmp_path / "manifest.json").write_text(
        json.dumps({**json.loads((tmp_path / "manifest.json").read_text()), "created": "then"}))
    write_manifest(tmp_path, "fig1", [cell(0, job_id="9_1")])
    m = read_manifest(tmp_path)
    assert m.created == "then" and created
    assert m.cells[0].job_id == "9_1"
    # dict cells are accepted
    write_manifest(tmp_path, "fig1", [cell(2).to_dict()])
    assert read_manifest(tmp_path).cells[0].axes["seed"] == 2


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"run_dir": "/abs/run"}, "relative"),
        ({"run_dir": "../x"}, "relative"),
        ({"axes": {"algorithm": "grpo"}}, "axes lack"),
        ({"name": ""}, "name"),
        ({"overrides": "a=1"}, "list of strings"),
    ],
)
def test_bad_cells(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        cell(0, **kw)


def test_duplicate_run_dirs_and_missing(tmp_path):
    with pytest.raises(ValueError, match="share"):
        write_manifest(tmp_path, "s", [cell(0), cell(0)])
    with pytest.raises(FileNotFoundError, match=r"manifest\.json"):
        read_manifest(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="unknown keys"):
        Cell.from_dict({**cell(0).to_dict(), "extra": 1})
