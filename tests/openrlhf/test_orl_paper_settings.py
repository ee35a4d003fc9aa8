"""The table of paper-scale settings in docs/cluster.md equals what the dry run emits.

The dry run of ``python -m experiments.launch +sweep=main_table scale=paper cluster=example
dry_run=true`` is rebuilt here with its own functions: Hydra's composition and the sweep's
validation (``fp8rl.launch.grid.plan_sweep``), the cell's typed config (``launch.job.build_config``),
the OpenRLHF flags (``command.build_args`` on the profile's layout and the run's paths, as
``run.describe`` prints them) and the plugin spec (``PluginSpec.from_config``). Every row of the
table ("Paper-scale settings and their sources") must hold for each of the 90 cells, and every
key the cells emit must have a row (the few left out are listed in :data:`LEFT_OUT`, as the doc
says), so neither a changed value nor a new flag can leave the table behind.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "cluster.md"
SECTION = "## Paper-scale settings and their sources"
ARGS = ["+sweep=main_table", "scale=paper", "cluster=example", "dry_run=true"]

#: Emitted keys the table leaves out, each with why (the doc names them too).
LEFT_OUT = {
    "--logger.tensorboard_dir": "a run-specific path",
    "--logger.wandb.run_name": "a run-specific name",
    "--ckpt.path": "a run-specific path",
    "--ckpt.output_dir": "a run-specific path",
    "spec.eps_low": "a copy of --actor.eps_clip_low_high",
    "spec.eps_high": "a copy of --actor.eps_clip_low_high",
    "spec.seed": "a copy of --train.seed",
}
#: Flags whose values are files: compared by the files' names without folder and suffix.
FILE_FLAGS = ("--data.prompt_dataset", "--eval.dataset", "--reward.remote_url")
#: A flag (or spec option) that a cell does not emit.
ABSENT = "off"


def _text(v) -> str:
    """A spec value as the table writes it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)):
        return " ".join(_text(x) for x in v)
    return str(v)


def emitted(cfg, resources, run_dir) -> dict[str, str]:
    """``{key: value text}`` of one cell: its OpenRLHF flags and its plugin spec."""
    from fp8rl.backends.openrlhf.command import build_args, layout_for, parse_flags
    from fp8rl.backends.openrlhf.plugin.spec import PluginSpec
    from fp8rl.backends.openrlhf.run import paths_for

    args = build_args(cfg, layout_for(cfg, resources.nodes, resources.gpus_per_node), paths_for(cfg, run_dir))
    out: dict[str, str] = {}
    for flag, values in parse_flags(args).items():
        key = f"--{flag}"
        if key in FILE_FLAGS:
            values = [",".join(Path(p).stem for p in v.split(",")) for v in values]
        out[key] = " ".join(values) if values else "on"
    spec = PluginSpec.from_config(cfg, run_dir).to_dict()
    for name, value in spec.items():
        if name == "clip_options":
            out.update({f"spec.clip_options.{k}": _text(v) for k, v in (value or {}).items()})
        else:
            out[f"spec.{name}"] = _text(value)
    return out


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    """``[(axes, emitted)]`` of every main-table cell, through the dry run's own functions."""
    from fp8rl.launch.grid import plan_command
    from fp8rl.launch.job import build_config

    plan = plan_command([*ARGS, f"output_dir={tmp_path_factory.mktemp('runs')}"])
    out = []
    for c in plan.cells:
        axes = {k: c.axes[k] for k in ("algorithm", "model", "fp8", "clip")}
        out.append((axes, emitted(build_config(c.payload()), c.resources, c.run_dir)))
    return out


# --- the table ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    line: int
    setting: str
    keys: tuple[str, ...]
    #: ``[(scope, values)]``: scope = the axis values it holds for (empty: every cell); one value
    #: per key (a row that gives one value for several keys means it for each).
    segments: tuple[tuple[frozenset[str], tuple[str, ...]], ...]

    def expected(self, axes: dict[str, str]) -> tuple[str, ...]:
        cell = {v.lower() for v in axes.values()}
        hits = [vals for scope, vals in self.segments if not scope or scope & cell]
        if len(hits) != 1:
            raise AssertionError(f"docs/cluster.md:{self.line} ({self.setting}): {len(hits)} value(s) apply to "
                                 f"cell {axes}; give exactly one")
        return hits[0]


_SEGMENT = re.compile(r"^(?P<scope>[\w ,]*?)\s*(?P<vals>`[^`]*`(?:\s*,\s*`[^`]*`)*)\s*$")


def parse_value(cell: str, n_keys: int, where: str) -> tuple[tuple[frozenset[str], tuple[str, ...]], ...]:
    """``"GRPO `0.2 0.2`; DAPO `0.2 0.28`"`` -> ``((frozenset({"grpo"}), ("0.2 0.2",)), ...)``."""
    out = []
    for part in cell.split(";"):
        m = _SEGMENT.match(part.strip())
        if m is None:
            raise AssertionError(f"{where}: value segment {part.strip()!r} is not '[scope] `value`[, `value`]'")
        scope = frozenset(s.strip().lower() for s in m.group("scope").split(",") if s.strip())
        vals = tuple(re.findall(r"`([^`]*)`", m.group("vals")))
        if len(vals) == 1:  # one value for every key of the row
            vals = vals * n_keys
        if len(vals) != n_keys:
            raise AssertionError(f"{where}: {len(vals)} value(s) for {n_keys} key(s) in {part.strip()!r}")
        out.append((scope, vals))
    return tuple(out)


def table_rows(text: str | None = None) -> list[Row]:
    """The rows of the settings table in docs/cluster.md (or in ``text``)."""
    lines = (text if text is not None else DOC.read_text(encoding="utf-8")).splitlines()
    start = lines.index(SECTION)
    header = next(i for i in range(start, len(lines)) if lines[i].startswith("| setting | key | value |"))
    rows = []
    for i in range(header + 2, len(lines)):
        ln = lines[i]
        if not ln.startswith("|"):
            break
        cols = [c.strip() for c in ln.strip().strip("|").split(" | ")]
        assert len(cols) == 4, f"docs/cluster.md:{i + 1}: a row needs 4 columns, got {len(cols)}"
        keys = tuple(re.findall(r"`([^`]+)`", cols[1]))
        assert keys, f"docs/cluster.md:{i + 1}: no key in {cols[1]!r}"
        rows.append(Row(i + 1, cols[0], keys, parse_value(cols[2], len(keys), f"docs/cluster.md:{i + 1}")))
    return rows


def same(doc: str, emitted_value: str) -> bool:
    """Equal as text, or token by token as numbers (``1e-6`` == ``1e-06``)."""
    a, b = doc.split(), emitted_value.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x == y:
            continue
        try:
            if float(x) != float(y):
                return False
        except ValueError:
            return False
    return True


def mismatches(rows: list[Row], cells) -> list[str]:
    out = []
    for row in rows:
        for axes, got in cells:
            for key, want in zip(row.keys, row.expected(axes), strict=True):
                have = got.get(key, ABSENT)
                if not same(want, have):
                    out.append(f"docs/cluster.md:{row.line} {key}: the table says {want!r} for "
                               f"{'-'.join(axes.values())}, the dry run emits {have!r}")
    return out


# --- tests ----------------------------------------------------------------------------------


def test_every_row_equals_what_the_dry_run_emits(cells):
    assert len(cells) == 90
    bad = mismatches(table_rows(), cells)
    assert not bad, "\n".join(bad[:20]) + (f"\n... and {len(bad) - 20} more" if len(bad) > 20 else "")


def test_every_emitted_key_has_a_row(cells):
    documented = {k for r in table_rows() for k in r.keys}
    keys = {k for _, got in cells for k in got}
    missing = sorted(keys - documented - set(LEFT_OUT))
    assert not missing, f"emitted but not in the table of docs/cluster.md: {missing}"
    stale = sorted(documented - keys)
    assert not stale, f"in the table of docs/cluster.md but emitted by no cell: {stale}"
    assert not documented & set(LEFT_OUT), "a key is both in the table and left out"
    assert set(LEFT_OUT) <= keys, f"left out but not emitted: {sorted(set(LEFT_OUT) - keys)}"
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index(SECTION):]
    assert all(f"`{k}`" in section for k in LEFT_OUT), "the doc names every key it leaves out"


def test_a_changed_value_or_scope_is_caught(cells):
    """The comparison itself: a table that drifted from the emitted values fails, naming the row."""
    rows = table_rows()
    lr = next(r for r in rows if r.keys == ("--actor.adam.lr",))
    drifted = dataclasses.replace(lr, segments=((frozenset(), ("2e-6",)),))
    assert any("--actor.adam.lr" in m and "'2e-06'" not in m for m in mismatches([drifted], cells))
    cap = next(r for r in rows if r.keys == ("--rollout.max_new_tokens",))
    swapped = dataclasses.replace(cap, segments=((frozenset({"grpo"}), ("20480",)), (frozenset({"dapo"}), ("16384",))))
    assert len(mismatches([swapped], cells)) == 90
    with pytest.raises(AssertionError, match="apply to cell"):
        dataclasses.replace(cap, segments=((frozenset({"grpo"}), ("16384",)),)).expected(
            {"algorithm": "dapo", "model": "8b", "fp8": "bf16", "clip": "vanilla"})


def test_table_parser_refuses_malformed_rows():
    text = "\n".join([SECTION, "", "| setting | key | value | source |", "|---|---|---|---|",
                      "| lr | `--actor.adam.lr` | 1e-6 without backticks | x |"])
    with pytest.raises(AssertionError, match="is not"):
        table_rows(text)
    text = text.replace("1e-6 without backticks", "`1e-6`, `2`, `3`")
    with pytest.raises(AssertionError, match="3 value"):
        table_rows(text)
    assert same("1e-6", "1e-06") and same("0.9 0.999", "0.9 0.999") and not same("0.2 0.2", "0.2 0.28")
    assert not same("on", "off") and not same("1", "1 2")
