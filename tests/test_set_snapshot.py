"""The shard-set code writes the same bytes as before issue 20's move (``tests/set_snapshot.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from set_snapshot import snapshot

REFERENCE = Path(__file__).with_name("set_snapshot.json")


def test_prepare_update_compact_and_import_write_the_bytes_they_wrote_before(tmp_path: Path) -> None:
    """prepare, two updates, compact, import of aligned crops and of a RecordIO pack: every output
    file (report.json less timings) hashes as the code before the move wrote it (092ec68; main at
    eb5c6a8 for an import's report.json, which issue 19 gave a ``validation_sets`` key). A change
    meant to alter the output rewrites the reference (``python tests/set_snapshot.py``) and says why."""
    expected = json.loads(REFERENCE.read_text())
    got = snapshot(tmp_path)
    assert got.keys() == expected.keys()
    for step, files in expected.items():
        changed = sorted(name for name in {*files, *got[step]} if files.get(name) != got[step].get(name))
        assert not changed, f"{step}: {changed} differ from {REFERENCE.name}"
