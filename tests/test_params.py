"""params.yaml errors: one line naming the file and the problem, exit 2 from the CLI, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from facepipe.cli import main
from facepipe.config import ParamsError, load_section

BAD_FILES = {
    "invalid_yaml": ("split:\n  seed: [1, 2\n", "not valid YAML"),
    "top_level_list": ("- split\n- train\n", "top level must be a mapping of stage sections"),
    "top_level_scalar": ("just a string\n", "top level must be a mapping of stage sections"),
    "section_scalar": ("split: 3\n", "section 'split' must be a mapping, got int"),
    "section_list": ("split:\n  - seed\n", "section 'split' must be a mapping, got list"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_params_file_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    text, message = BAD_FILES[case]
    params = tmp_path / "params.yaml"
    params.write_text(text)
    # The inputs do not exist either: the params file is read first, and its problem is the one named.
    argv = ["split", str(tmp_path / "prepared"), str(tmp_path / "out"), "--params", str(params)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"facepipe split: error: {params}: ") and message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


# Five fields of the right count but out of range, a zero step, a day-of-week of 8, Prefect's unsupported
# random field: a field count alone accepts all of these, and Prefect would refuse them only at serve time.
BAD_CRONS = ["every night", "0 3 * *", "", "61 * * * *", "0 24 * * *", "0 3 32 * *", "0 3 * 13 *", "0 3 * * 8",
             "*/0 * * * *", "0 3 * * * 61", "R 3 * * *"]
GOOD_CRONS = ["0 3 * * *", "*/15 2 * * 1-5", "59 23 31 12 7", "0 3 * * MON-FRI", "0 0 1 jan,jul *", "@daily"]


@pytest.mark.parametrize("cron", BAD_CRONS)
def test_bad_cron_is_a_one_line_params_error(tmp_path: Path, cron: str) -> None:
    params = tmp_path / "params.yaml"
    params.write_text(f"pipeline:\n  cron: {cron!r}\n")
    with pytest.raises(ParamsError) as caught:
        load_section(params, "pipeline")
    message = str(caught.value)
    assert message.startswith(f"{params}: pipeline.cron: ") and "not a cron expression" in message
    assert "\n" not in message


@pytest.mark.parametrize("cron", GOOD_CRONS)
def test_valid_crons_at_the_edges_of_each_field_are_accepted(tmp_path: Path, cron: str) -> None:
    params = tmp_path / "params.yaml"
    params.write_text(f"pipeline:\n  cron: {cron!r}\n")
    assert load_section(params, "pipeline").cron == cron


def test_a_valid_cron_and_other_sections_do_not_matter(tmp_path: Path) -> None:
    """Only the section asked for is validated: a broken other section is not this stage's problem."""
    params = tmp_path / "params.yaml"
    params.write_text("pipeline:\n  cron: '*/15 2 * * 1-5'\ntrain: 3\n")
    assert load_section(params, "pipeline").cron == "*/15 2 * * 1-5"
