"""``provenance.json`` read back is checked field by field: a damaged one is named with the field
and the fix (delete it and relaunch), and marking a run FAILED does not fail on it again."""

from __future__ import annotations

import json

import pytest

from fp8rl.runs import RunDir
from fp8rl.runs.jsonl import RunDirDamaged
from fp8rl.runs.provenance import PROVENANCE_FIELDS, provenance_problem


@pytest.fixture
def rd(tmp_path):
    rd = RunDir(tmp_path / "run").init({"steps": 4})
    rd.write_provenance({"backend": "mini"}, device="cpu x1")
    rd.write_provenance({"backend": "mini"}, device="cpu x1")  # a resume: one earlier attempt
    return rd


def test_a_written_record_passes_and_every_field_is_known(rd):
    prov = rd.provenance()
    assert provenance_problem(prov) is None and len(prov["previous_attempts"]) == 1
    assert set(prov) == set(PROVENANCE_FIELDS)


@pytest.mark.parametrize(("edit", "why"), [
    (lambda p: [], "it holds a list, not an object of provenance fields"),
    (lambda p: "text", "it holds a string"),
    (lambda p: {**p, "argv": "python"}, "its field argv holds a string, not a list"),
    (lambda p: {**p, "extra": None}, "its field extra holds null, not an object"),
    (lambda p: {**p, "time_ended": 3}, "its field time_ended holds a number, not a string or null"),
    (lambda p: {**p, "previous_attempts": {}}, "its field previous_attempts holds an object, not a list"),
    (lambda p: {**p, "previous_attempts": [1]}, "its field previous_attempts[0] holds a number, not an object"),
    (lambda p: {**p, "previous_attempts": [{"host": 3}]}, "its field previous_attempts[0].host holds a number"),
], ids=["a-list", "a-string", "argv", "extra", "time_ended", "attempts-a-mapping", "attempt-a-number",
        "attempt-field"])
def test_a_damaged_record_is_named_with_its_field_and_the_fix(rd, edit, why):
    rd.provenance_path.write_text(json.dumps(edit(rd.provenance())))
    for read in (rd.provenance, lambda: rd.write_provenance({})):
        with pytest.raises(RunDirDamaged) as e:
            read()
        msg = str(e.value)
        assert msg.startswith(f"{rd.provenance_path} is damaged (not a provenance record: ") and why in msg, msg
        assert "delete it and relaunch: the relaunch writes it again" in msg and "run directory to" not in msg
    rd.set_status("FAILED", 2, "refused")  # a terminal state stamps provenance: not with a damaged one
    assert rd.status()["state"] == "FAILED"


def test_a_record_without_later_fields_still_reads(rd):
    """Records written before a field existed (``cpu``, say) lack it: that is not damage."""
    old = {k: v for k, v in rd.provenance().items() if k not in ("cpu", "slurm")}
    rd.provenance_path.write_text(json.dumps(old))
    assert rd.provenance() == old
