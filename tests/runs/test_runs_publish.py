"""fp8rl.runs.publish: a published copy drops checkpoints and machine paths, and the report is
the same on the copy as on the original."""

import json

import pytest

from experiments.publish import main as publish_main
from fp8rl.runs.publish import publish_sweep
from fp8rl.runs.synthetic import RunSpec, make_sweep


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "checkout"
    src = root / "runs" / "demo"
    specs = [RunSpec(fp8=f, clip=c, seed=s, steps=30, eval={"arith": 0.25 + 0.1 * s}, eval_every=10)
             for f, c in (("bf16", "vanilla"), ("tensorwise", "calibrated")) for s in (0, 1)]
    make_sweep(src, specs, sweep="demo", fast=True)
    for run in (p for p in src.iterdir() if p.is_dir()):
        (run / "checkpoint").mkdir()
        (run / "checkpoint" / "state.pt").write_bytes(b"x" * 1000)
        (run / "samples").mkdir(exist_ok=True)
        (run / "samples" / "step_000010.jsonl").write_text('{"text": "A:3"}\n')
        with open(run / "config.yaml", "a") as f:
            f.write(f"output_dir: {src}\nmini:\n  cache_dir: {root}/runs/.cache/sft\n")
        (run / "provenance.json").write_text(json.dumps({"argv": [f"{root}/experiments/launch.py", "+sweep=x"]}))
    (src / ".cache").mkdir()
    (src / ".cache" / "junk").write_text("cache")
    return root, src


def test_copy_keeps_what_analysis_reads_and_drops_the_rest(sweep, tmp_path):
    root, src = sweep
    dest = tmp_path / "pub" / "demo"
    res = publish_sweep(src, dest, root=root)
    assert res.runs == 4 and res.rewritten == 8  # config.yaml + provenance.json of each run
    assert (dest / "manifest.json").read_bytes() == (src / "manifest.json").read_bytes()
    assert not (dest / ".cache").exists()
    for run in (p for p in src.iterdir() if p.is_dir() and not p.name.startswith(".")):
        out = dest / run.name
        assert not (out / "checkpoint").exists()
        assert not (out / "samples").exists()  # decoded samples are not published
        for f in ("metrics.jsonl", "eval.jsonl", "status.json", "summary.json"):
            assert (out / f).read_bytes() == (run / f).read_bytes(), f
        cfg = (out / "config.yaml").read_text()
        assert "output_dir: ./runs/demo" in cfg and "cache_dir: ./runs/.cache/sft" in cfg
        assert json.loads((out / "provenance.json").read_text())["argv"][0] == "./experiments/launch.py"
        for f in out.rglob("*"):
            if f.is_file():
                assert str(root) not in f.read_text(), f
    # the original is untouched
    assert str(root) in next(src.glob("*/config.yaml")).read_text()


def test_report_tables_are_the_same_on_the_copy(sweep, tmp_path):
    from analysis.report import main as report_main

    root, src = sweep
    dest = tmp_path / "pub" / "demo"
    publish_sweep(src, dest, root=root)
    for d in (src, dest):
        assert report_main([str(d), "--out", str(d.parent / f"rep-{d.parent.name}"), "--no-progress",
                            "--no-cache", "--figures", "entropy"]) == 0
    a, b = src.parent / "rep-runs" / "tables", dest.parent / "rep-pub" / "tables"
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and "mechanism.csv" in names
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def test_bad_input_is_refused_before_anything_is_written(sweep, tmp_path, capsys):
    root, src = sweep
    with pytest.raises(ValueError, match="not a sweep directory"):
        publish_sweep(root, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="inside the sweep"):
        publish_sweep(src, src / "pub")
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.md").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        publish_sweep(src, other)
    with pytest.raises(FileExistsError, match="refusing to delete"):
        publish_sweep(src, other, replace=True)
    assert (other / "keep.md").read_text() == "mine"
    # a sweep run from another checkout: refused, naming it, unless that checkout is the root
    with pytest.raises(ValueError, match=r"another checkout.*--root"):
        publish_sweep(src, tmp_path / "elsewhere", root=tmp_path / "not_the_checkout")
    assert not (tmp_path / "elsewhere").exists()
    # an earlier published copy is replaced only when asked
    dest = tmp_path / "pub"
    publish_sweep(src, dest, root=root)
    (dest / "stale").mkdir()
    assert publish_main([str(src), str(dest)]) == 2
    assert "--replace" in capsys.readouterr().err
    assert publish_main([str(src), str(dest), "--replace", "--root", str(root)]) == 0
    assert not (dest / "stale").exists() and (dest / "manifest.json").exists()


def test_a_sweep_written_outside_its_checkout_is_published_with_both_roots(sweep, tmp_path):
    """``output_dir`` on another disk: its path and the checkout's (in ``argv``) both go."""
    root, src = sweep
    out_root = tmp_path / "scratch"
    moved = out_root / "runs" / "demo"
    moved.parent.mkdir(parents=True)
    src.rename(moved)
    for run in (p for p in moved.iterdir() if p.is_dir() and not p.name.startswith(".")):
        cfg = run / "config.yaml"
        cfg.write_text(cfg.read_text().replace(f"output_dir: {src}", f"output_dir: {moved}"))
    with pytest.raises(ValueError, match=r"outside .*once more"):  # only the checkout given
        publish_sweep(moved, tmp_path / "a", root=root)
    assert not (tmp_path / "a").exists()
    dest = tmp_path / "b"
    assert publish_main([str(moved), str(dest), "--root", str(out_root), "--root", str(root)]) == 0
    for run in (p for p in dest.iterdir() if p.is_dir()):
        for f in ("config.yaml", "provenance.json"):
            text = (run / f).read_text()
            assert str(tmp_path) not in text, (run.name, f)
        assert json.loads((run / "provenance.json").read_text())["argv"][0] == "./experiments/launch.py"
        assert "output_dir: ./runs/demo" in (run / "config.yaml").read_text()
    with pytest.raises(ValueError, match="at least one"):
        publish_sweep(moved, tmp_path / "c", root=[])
