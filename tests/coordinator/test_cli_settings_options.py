"""The options that set settings come from the settings (`cli_settings.settings_options`): each
flag's help is its field's description with the key and default, its type the field's, and
its value reaches the config. Nothing here trains: the commands stop once their config is
built."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from coordinator import cli
from coordinator.cli_common import CSV
from coordinator.cli_settings import (
    ALGORITHM,
    NONE,
    TRAINING,
    Flag,
    SettingOption,
    settings_options,
)
from coordinator.config import RunConfig, setting_field, setting_keys

runner = CliRunner()

# Every command whose options come (partly) from the settings, with its function.
COMMANDS = {
    "simulate": cli.simulate,
    "demo": cli.demo,
    "coordinator": cli.coordinator,
    "client": cli.client,
    "split": cli._tools.split,
}


def _params(command: str) -> dict[str, Any]:
    """The command's options as typer made them, by parameter name."""
    group: Any = typer.main.get_command(cli.app)
    return {p.name: p for p in group.commands[command].params if p.name}


def _help(args: list[str]) -> str:
    res = runner.invoke(cli.app, [*args, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    return res.output


def _default(key: str) -> Any:
    node: Any = RunConfig.model_construct()
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _expected_help(option: SettingOption, flag_none: str | None) -> str:
    """What the help of `option` must read, worked out from its field here."""
    if option.key.startswith(ALGORITHM + "."):
        leaf = option.key.partition(".")[2]
        return (
            f"{TRAINING[leaf][1]}, for the algorithm and every baseline that has it "
            f"[{option.key}; default: the algorithm's own: `edgefl settings fml.{leaf}`]"
        )
    description = setting_field(option.key).description
    assert description, option.key
    text, _, means = description.partition(NONE)
    text += f" ({CSV})" if option.csv else ""
    none = flag_none or means or "none"
    if option.own:
        return f"{text} [default: {none}]" if option.default is None and none != "none" else text
    value = _default(option.key)
    if value is None:
        shown = none
    elif isinstance(value, bool):
        shown = "on" if value else "off"
    elif isinstance(value, list | tuple):
        shown = ",".join(value) or "none"
    elif isinstance(value, float) and value.is_integer():
        shown = str(int(value))
    else:
        shown = str(value)
    return f"{text} [{option.key}; default: {shown}]"


def _declared(command: str) -> dict[str, Flag]:
    flags = {"simulate": cli.SIMULATE, "demo": cli.DEMO, "coordinator": cli.COORDINATOR}
    flags |= {"client": cli.CLIENT, "split": (*cli.DATA, "clients", "seed")}
    return {(f.key if isinstance(f, Flag) else f): f for f in flags[command]}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_settings_flag_helps_with_its_fields_description_key_and_default(command):
    options: tuple[SettingOption, ...] = COMMANDS[command].settings_options
    declared = _declared(command)
    params = _params(command)
    assert [o.key for o in options] == list(declared)
    for option in options:
        flag = declared[option.key]
        param = params[option.param]
        assert param.help == _expected_help(option, flag.none if isinstance(flag, Flag) else None)
        assert set(param.opts) == set(option.names)
        assert not param.secondary_opts  # an on/off setting is `--late`, never `--no-late`


def test_each_flag_has_the_type_of_its_field():
    text = _help(["simulate"]) + _help(["client"])
    for flag, metavar in [
        ("--rounds", "<int>"),
        ("--lr", "<float>"),
        ("--connect-timeout", "<float>"),
        ("--device", "<str>"),  # Literal["auto", "cpu", "cuda"]
        ("--models", "<str>"),  # a list, comma-separated
        ("-o, --out", "<path>"),  # (Flag.type: a path the setting holds as a string)
    ]:
        assert f"  {flag} {metavar} " in text, flag
    assert re.search(r"\n  --late +join a finished run", text)  # on/off: a flag, no value
    # The demo's own defaults: the option checks the field's bounds (rounds >= 1) itself.
    demo = _help(["demo"])
    assert "--rounds <int range>" in demo and "[default: 10; x>=1]" in demo


def test_a_setting_added_to_a_declaration_is_a_flag_of_its_type():
    seen: dict[str, Any] = {}
    app = typer.Typer(rich_markup_mode=None)

    @app.command()
    @settings_options("round.quorum", "robust.rollback", "models", Flag("data.root", short="-r"))
    def run(*, flags: dict[str, Any]) -> None:
        seen.update(flags)

    res = runner.invoke(app, ["--help"])
    assert "--quorum" in res.output and "[round.quorum; default: 0.5]" in res.output
    assert "-r, --root" in res.output

    res = runner.invoke(app, ["--quorum", "0.7", "--rollback", "--models", "mlp, lenet5,"])
    assert res.exit_code == 0, res.output
    assert seen == {
        "round.quorum": 0.7,
        "robust.rollback": True,
        "models": ["mlp", "lenet5"],
        "data.root": None,  # not given: the config file, the environment or the default decide
    }
    res = runner.invoke(app, ["--quorum", "most"])
    assert res.exit_code == 2 and "Invalid value for '--quorum'" in res.output


def test_a_declaration_that_names_no_setting_fails_when_it_is_made():
    with pytest.raises(KeyError, match="roundz is not a setting"):
        settings_options("roundz")
    with pytest.raises(KeyError, match="rounds is not a section"):
        settings_options("rounds.deadline_s")
    with pytest.raises(KeyError, match="the training flags are local_epochs"):
        settings_options(f"{ALGORITHM}.momentum")
    with pytest.raises(TypeError, match=r"data\.options .* cannot be a flag"):
        settings_options("data.options")  # a dict: --set takes it
    with pytest.raises(TypeError, match=r"broker\.password .* cannot be a flag"):
        settings_options("broker.password")  # a secret never goes on a command line
    with pytest.raises(ValueError, match=r"--seed is the flag of both seed and data\.seed"):
        settings_options("seed", "data.seed")


def test_every_setting_outside_the_algorithms_has_a_description():
    # Every one can be a flag, and the settings reference shows what each means.
    keys = [k for k in setting_keys() if k.split(".")[0] in RunConfig.model_fields]
    assert len(keys) > 60
    assert [k for k in keys if not setting_field(k).description] == []


class _Built(Exception):
    pass


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The configs the commands load; each command stops there."""
    configs: list[Any] = []
    real = cli.load

    def load(*args: Any) -> Any:
        configs.append(real(*args))
        raise _Built

    monkeypatch.setattr(cli, "load", load)
    return configs


def test_simulate_flags_reach_the_config(built, tmp_path):
    res = runner.invoke(
        cli.app,
        [
            "simulate", "--rounds", "2", "--models", "mlr,mlp", "--baselines", "local,fedavg",
            "--lr", "0.05", "--data-root", str(tmp_path), "-o", str(tmp_path / "run"),
            "--onnx-int8", "static", "--deploy", "own,mixture", "--seed", "3",
        ],
    )  # fmt: skip
    assert isinstance(res.exception, _Built), res.output
    cfg = built[0]
    assert cfg.rounds == 2 and cfg.seed == 3
    assert cfg.models == ["mlr", "mlp"] and cfg.baselines == ["local", "fedavg"]
    assert cfg.fml.lr == cfg.local.lr == cfg.fedavg.lr == 0.05  # the algorithm and baselines
    assert cfg.data.root == str(tmp_path) and cfg.out == str(tmp_path / "run")
    assert cfg.export_onnx is True  # --onnx-int8 implies it
    assert cfg.deploy.allow == ("own", "mixture")


def test_flags_not_given_leave_the_config_file_to_decide(built, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("rounds = 7\nexport_onnx = true\n[client]\nlate = true\n")
    res = runner.invoke(cli.app, ["client", "-c", str(toml), "--index", "3"])
    assert isinstance(res.exception, _Built), res.output
    cfg = built[0]
    assert cfg.rounds == 7 and cfg.export_onnx and cfg.client.late  # (no --late: the file's)
    assert cfg.client.index == 3 and cfg.client.state_dir == "edgefl-state"


def test_coordinator_and_client_flags_reach_the_config(built, tmp_path):
    res = runner.invoke(
        cli.app,
        [
            "coordinator", "--broker", "mqtt://h:1883", "--allow", "c0,c2", "--deadline", "9",
            "--connect-timeout", "inf", "--min-clients", "2", "--batch-size", "16",
        ],
    )  # fmt: skip
    assert isinstance(res.exception, _Built), res.output
    cfg = built[0]
    assert cfg.broker.url == "mqtt://h:1883" and cfg.allow == ["c0", "c2"]
    assert cfg.round.deadline_s == 9 and cfg.broker.connect_timeout_s == float("inf")
    assert cfg.round.min_clients == 2 and cfg.fml.batch_size == 16

    state = tmp_path / "state"
    res = runner.invoke(
        cli.app,
        ["client", "--index", "1", "--id", "phone", "--state-dir", str(state), "--late",
         "--deploy-max-params", "5000", "--threads", "2"],
    )  # fmt: skip
    assert isinstance(res.exception, _Built), res.output
    cfg = built[1]
    assert (cfg.client.index, cfg.client.id, cfg.client.late) == (1, "phone", True)
    assert cfg.client.state_dir == str(state) and isinstance(cfg.client.state_dir, str)
    assert cfg.deploy.max_params == 5000 and cfg.threads == 2


def test_the_demo_takes_its_own_defaults_and_checks_the_settings_bounds(monkeypatch):
    import coordinator.demo

    seen = []

    def run_demo(opts: Any, echo: Any) -> Any:
        seen.append(opts)
        raise _Built

    monkeypatch.setattr(coordinator.demo, "run_demo", run_demo)
    res = runner.invoke(cli.app, ["demo", "--clients", "3", "--broker", "mqtt://h"])
    assert isinstance(res.exception, _Built), res.output
    opts = seen[0]
    assert (opts.algorithm, opts.rounds, opts.clients, opts.device) == ("fml", 10, 3, "cpu")
    assert (opts.dataset, opts.broker, opts.out) == (None, "mqtt://h", Path("runs/demo"))
    res = runner.invoke(cli.app, ["demo", "--rounds", "0"])
    assert res.exit_code == 2 and "Invalid value for '--rounds'" in res.output
