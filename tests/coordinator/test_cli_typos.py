"""Typos do not pass: unknown settings are refused (or, in the environment, warned about) with the
valid keys nearest to them, in messages free of pydantic's internals."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from coordinator.cli import app

runner = CliRunner()
SPLIT = ["split", "--dataset", "digits", "--clients", "3", "--set", "data.max_samples=300"]


def test_an_environment_variable_that_names_no_setting_is_warned_about():
    res = runner.invoke(app, SPLIT, env={"EDGEFL_ROUNDZ": "1", "EDGEFL_FML__ALPAH": "0.3"})
    assert res.exit_code == 0, res.output
    assert "EDGEFL_ROUNDZ is not a setting and is ignored; did you mean EDGEFL_ROUNDS" in res.output
    assert "EDGEFL_FML__ALPAH is not a setting and is ignored; did you mean EDGEFL_FML__ALPHA" in (
        res.output
    )


def test_settings_in_the_environment_and_its_other_variables_raise_no_warning():
    env = {"EDGEFL_ROUNDS": "2", "EDGEFL_DATA__OPTIONS": '{"size": 8}', "EDGEFL_PLUGINS": ""}
    res = runner.invoke(app, SPLIT, env=env)
    assert res.exit_code == 0, res.output
    assert "is not a setting" not in res.output


def test_a_mistyped_set_names_the_nearest_keys():
    res = runner.invoke(app, [*SPLIT, "--set", "fml.alpah=0.3"])
    assert res.exit_code == 2
    assert "fml.alpah: unknown setting; did you mean fml.alpha" in res.output
    assert "Extra inputs are not permitted" not in res.output


def test_a_key_far_from_any_lists_the_keys_valid_there():
    res = runner.invoke(app, [*SPLIT, "--set", "round.zzzzzz=1"])
    assert res.exit_code == 2
    assert (
        "round.zzzzzz: unknown setting; valid keys in round: client_history, deadline_s, "
        in res.output
    )


def test_a_setting_in_the_wrong_section_is_pointed_to_its_own():
    res = runner.invoke(app, [*SPLIT, "--set", "alpha=0.3"])
    assert res.exit_code == 2
    assert "alpha: unknown setting; did you mean fml.alpha?" in res.output


def test_a_typo_in_a_toml_file_names_the_nearest_key(tmp_path: Path):
    cfg = tmp_path / "run.toml"
    cfg.write_text("rounds = 2\n[data]\npartiton = 'iid'\n")
    res = runner.invoke(app, ["split", "--config", str(cfg)])
    assert res.exit_code == 2
    assert "data.partiton: unknown setting; did you mean data.partition" in res.output


def test_more_clients_per_round_than_clients_is_refused():
    res = runner.invoke(
        app, ["simulate", "--clients-per-round", "5", "--clients", "2", "--dataset", "digits"]
    )
    assert res.exit_code == 2
    assert "clients_per_round (5) is more than clients (2)" in res.output


def test_errors_carry_no_pydantic_noise():
    res = runner.invoke(app, ["simulate", "--rounds", "0"])
    assert res.exit_code == 2
    assert "error: invalid config: rounds: Input should be greater than or equal to 1" in res.output
    res = runner.invoke(app, ["simulate", "--models", "resnet"])
    assert res.exit_code == 2
    assert "<root>" not in res.output and "Value error," not in res.output
    assert "error: invalid config: unknown architecture family 'resnet'; known: " in res.output


def test_set_without_equals_says_set_takes_key_value():
    # A user's `--set fml.alpha 0.3`: before, "Got unexpected extra argument(s) (0.3)".
    res = runner.invoke(app, [*SPLIT, "--set", "fml.alpha", "0.3"])
    assert res.exit_code == 2
    assert "'fml.alpha' is not key=value: write --set fml.alpha=VALUE" in res.output
    assert "unexpected extra argument" not in res.output


def test_a_wrong_type_in_a_toml_file_names_the_file_and_the_field(tmp_path: Path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('rounds = "five"\n[data]\nmax_samples = 300\n')
    res = runner.invoke(app, ["split", "--config", str(cfg)])
    assert res.exit_code == 2
    assert f"{cfg}: rounds: Input should be a valid integer" in res.output.replace("\n", "")
    # The same bad value from a flag is the flag's, not the file's.
    res = runner.invoke(app, ["split", "--set", "rounds=five"])
    assert res.exit_code == 2 and "invalid config: rounds: Input should be" in res.output
