"""The ``jaxrec`` command dispatches to its sub-commands."""

from __future__ import annotations

import json

import pytest

from jaxrec.__main__ import main


def test_info_and_demo(capsys):
    assert main(["info"]) == 0
    assert json.loads(capsys.readouterr().out)["cpu"] is True
    assert main(["demo"]) == 0
    assert "Pooled embeddings" in capsys.readouterr().out


def test_sub_command_arguments_reach_the_sub_command(capsys, tmp_path):
    assert main(["train", "--data", "nowhere", "--out-dir", str(tmp_path)]) == 2
    assert "data must be 'synthetic'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["info", "--steps", "3"])
    with pytest.raises(SystemExit):
        main(["fly"])


@pytest.mark.parametrize("command, option", [("train", "--table-lr"), ("bench", "--quick")])
def test_sub_command_help_shows_its_own_options(capsys, command, option):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: jaxrec {command}" in out and option in out


def test_top_level_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(f"jaxrec {c}" in out for c in ("train", "bench", "demo", "info"))
