"""One CLI vocabulary: what a user sees in --help, and the options every command shares.

Every test runs the command as a user would (typer's runner) and checks what the user sees.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
from typer.testing import CliRunner

from coordinator.cli import app

runner = CliRunner()

# Every command, as a user types it.
COMMANDS = [
    ["simulate"],
    ["demo"],
    ["coordinator"],
    ["client"],
    ["export"],
    ["split"],
    ["zoo"],
    ["settings"],
    ["broker-acl"],
    ["bench", "onnx"],
]
# The options that mean the same thing on every command that has them.
LOGGING = ["-v", "--verbose", "-q", "--quiet", "--log-level", "--log-format", "--log-file"]
PLUGIN_COMMANDS = [
    "simulate",
    "demo",
    "coordinator",
    "client",
    "export",
    "split",
    "zoo",
    "settings",
]


def _help(args: list[str]) -> str:
    res = runner.invoke(app, [*args, "-h"])
    assert res.exit_code == 0, res.output
    return res.output


def _option_line(text: str, flag: str) -> str:
    """The help text of `flag`, its wrapped lines joined."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"\s+(-\w, )?{re.escape(flag)}[ ,\n]", line + "\n"):
            out = [line.strip()]
            for more in lines[i + 1 :]:
                if re.match(r"\s+-", more) or not more.startswith("     "):
                    break
                if out[-1].endswith("-"):  # click wraps after a hyphen: edgefl-|state
                    out[-1] += more.strip()
                else:
                    out.append(more.strip())
            return re.sub(r"\s+", " ", " ".join(out))
    raise AssertionError(f"{flag} is not in the help:\n{text}")


def test_version_and_short_help_flag():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0
    assert re.fullmatch(r"edgefl \d+\.\d+\.\d+\S*\n", res.output)
    assert "[OPTIONS] COMMAND" in _help([]) and "-h, --help" in _help([])


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_takes_h_and_the_same_logging_options(command):
    text = _help(command)
    for flag in LOGGING:
        assert re.search(rf"(^|\s|, ){re.escape(flag)}[\s,]", text), f"{flag} missing"
    assert "more log output: -v INFO, -vv DEBUG" in text
    assert ("--plugin" in text) == (command[0] in PLUGIN_COMMANDS)


def test_command_summaries_are_whole_sentences():
    # Before: the listing cut summaries mid-sentence ("client INDEX of" / "the split").
    for group in ([], ["bench"]):
        listing = _help(group).split("Commands:")[1]
        lines = [ln.strip() for ln in listing.splitlines() if ln.strip()]
        assert lines
        for line in lines:
            assert line.endswith(".") and not line.endswith("..."), line


@pytest.mark.parametrize(
    ("command", "flag", "shown"),
    [
        (["simulate"], "--rounds", "[rounds; default: 5]"),
        (["simulate"], "--clients", "[clients; default: 10]"),
        (["simulate"], "--dataset", "[data.dataset; default: digits]"),
        (["simulate"], "--lr", "default: the algorithm's own: `edgefl settings fml.lr`]"),
        (["simulate"], "--threads", "[threads; default: the cores this process may use]"),
        (["simulate"], "--out", "default: runs/<algorithm>-<date>-<time>]"),
        (["coordinator"], "--register-timeout", "[round.register_timeout_s; default: 600]"),
        (["coordinator"], "--deadline", "[round.deadline_s; default: 120]"),
        (["coordinator"], "--run-id", "[run_id; default: sim]"),
        (["client"], "--state-dir", "[client.state_dir; default: edgefl-state]"),
        (["client"], "--threads", "[threads; default: one per core]"),
        (["client"], "--device", "[device; default: auto]"),
        (["client"], "--connect-timeout", "[broker.connect_timeout_s; default: 30]"),
        (["coordinator"], "--connect-timeout", "(inf: no limit)"),
        (["demo"], "--device", "[default: cpu]"),
    ],
)
def test_help_shows_each_setting_with_its_key_and_default(command, flag, shown):
    assert shown in _option_line(_help(command), flag)


def test_device_and_threads_are_offered_where_they_mean_something():
    for command in (["simulate"], ["client"], ["demo"], ["bench", "onnx"]):
        assert "auto (CUDA if there is one), cpu, cuda" in _option_line(_help(command), "--device")
    for command in (["simulate"], ["client"]):
        assert "CPU threads to train with" in _option_line(_help(command), "--threads")
    # The coordinator computes nothing a device flag would move, and trains nothing.
    assert "--threads" not in _help(["coordinator"])


def test_settings_lists_every_key_with_its_default():
    res = runner.invoke(app, ["settings", "fml"])
    assert res.exit_code == 0, res.output
    listing = res.output.split("\n\n")[0]
    lines = dict(ln.split(" = ", 1) for ln in listing.splitlines())
    assert lines["fml.alpha"] == "0.5" and lines["fml.lr"] == "0.01"
    assert all(k.startswith("fml") for k in lines)
    res = runner.invoke(app, ["settings", "nope"])
    assert res.exit_code == 2 and "no setting starts with 'nope'" in res.output


def test_zoo_lists_families_datasets_partitions_and_algorithms():
    res = runner.invoke(app, ["zoo"])
    assert res.exit_code == 0
    rows = dict(ln.split(":", 1) for ln in res.output.splitlines())
    assert "lenet5" in rows["families"] and "fashion_mnist" in rows["datasets"]
    assert "dirichlet" in rows["partitions"] and "pfml" in rows["algorithms"]


def test_json_logs_to_a_file(tmp_path):
    log = tmp_path / "logs" / "split.log"
    res = runner.invoke(
        app,
        [
            "split",
            "--dataset",
            "digits",
            "--clients",
            "3",
            "-v",
            "--log-format",
            "json",
            "--log-file",
            str(log),
            "--set",
            "data.max_samples=300",
        ],
    )
    assert res.exit_code == 0, res.output
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records, "nothing was logged at INFO"
    assert {"time", "level", "logger", "message", "process"} <= set(records[0])
    assert all(r["level"] in ("INFO", "WARNING") for r in records)
    assert " INFO " not in res.output  # the records went to the file, not the terminal


def test_log_level_wins_over_verbose_and_bad_values_are_refused(tmp_path):
    log = tmp_path / "x.log"
    args = ["split", "--dataset", "digits", "--clients", "3", "--set", "data.max_samples=300"]
    res = runner.invoke(app, [*args, "-v", "--log-level", "ERROR", "--log-file", str(log)])
    assert res.exit_code == 0, res.output
    assert not log.exists() or log.read_text() == ""
    res = runner.invoke(app, [*args, "--log-format", "yaml"])
    assert res.exit_code == 2 and "'yaml' is not one of text, json" in res.output


def test_simulate_without_out_keeps_its_results_and_says_where(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(
        app,
        [
            "simulate",
            "--algorithm",
            "local",
            "--dataset",
            "digits",
            "--clients",
            "2",
            "--rounds",
            "1",
            "-q",
            "--set",
            'data.options={"size": 8}',
            "--set",
            "data.max_samples=200",
            "--models",
            "mlr",
            "--local-epochs",
            "1",
        ],
    )
    assert res.exit_code == 0, res.output
    match = re.search(r"results go to (runs/local-\d{8}-\d{6}) \(--out DIR to choose\)", res.output)
    assert match, res.output
    saved = json.loads((tmp_path / match.group(1) / "results.json").read_text())
    assert saved["algorithm"] == "local" and len(saved["clients"]) == 2
    assert f"results: {match.group(1)}/results.json" in res.output


def test_quiet_hides_the_progress_bars_which_say_when_the_clients_finalize(tmp_path):
    args = [
        "simulate",
        "--algorithm",
        "fml",
        "--baselines",
        "local",
        "--dataset",
        "digits",
        "--clients",
        "2",
        "--rounds",
        "1",
        "--models",
        "mlr",
        "--local-epochs",
        "1",
        "-o",
        str(tmp_path),
        "--set",
        'data.options={"size": 8}',
        "--set",
        "data.max_samples=200",
    ]
    loud = runner.invoke(app, args)
    quiet = runner.invoke(app, [*args, "-q"])
    assert loud.exit_code == quiet.exit_code == 0, loud.output + quiet.output
    assert quiet.stderr == ""
    # tqdm's bar: after the last round it says the clients are finalizing, and how many have
    # (the clients' jobs of the rounds not counted), and once they have, its last state no
    # longer says so.
    states = [s.strip() for s in loud.stderr.replace("\r", "\n").splitlines() if s.strip()]
    fml = [s for s in states if s.startswith("fml:")]
    assert "1/1" in fml[-1] and any("finalizing each client's model" in s for s in fml)
    counted = [re.search(r"finalizing each client's model, (\d+) of 2", s) for s in fml]
    said = [int(m[1]) for m in counted if m]  # (two jobs, or one stack of both)
    assert said in ([1, 2], [2])
    assert "finalizing" not in fml[-1]
    # The summary's metrics, to 3 decimals: those of results.json.
    kept = json.loads((tmp_path / "results.json").read_text())["summary"]["metrics"]
    line = next(s for s in loud.stdout.splitlines() if s.startswith("metrics: "))
    shown = json.loads(line.removeprefix("metrics: "))
    expected = {k: kept[k] and round(kept[k], 3) for k in ("PUI", "PUD", "API", "APD", "JI")}
    assert shown == expected and shown["API"] not in (None, kept["API"])


def test_the_demo_hands_its_log_options_and_plugins_to_every_process():
    from coordinator.cli_common import CommonOptions

    opts = CommonOptions(verbose=2, log_format="json", plugins=["mine.py"])
    assert opts.child_args() == ["-vv", "--log-format", "json", "--plugin", "mine.py"]
    assert CommonOptions(quiet=True, log_level="debug").child_args()[:2] == ["--log-level", "DEBUG"]
    assert CommonOptions(quiet=True).child_args()[:2] == ["--log-level", "ERROR"]


@pytest.mark.parametrize(("flag", "theirs"), [("-vv", False), ("-vvv", True)])
def test_vv_logs_edgefls_debug_and_other_libraries_info_and_vvv_everyones_debug(
    flag, theirs, tmp_path
):
    # Prepare: a plugin that logs at DEBUG as edgefl's packages and as another library would
    plugin = tmp_path / "chatty_plugin_vv.py"
    plugin.write_text(
        "import logging\n"
        "logging.getLogger('model_zoo.chatty').debug('ours at debug')\n"
        "logging.getLogger('somelib.fonts').debug('theirs at debug')\n"
        "logging.getLogger('somelib.fonts').info('theirs at info')\n"
    )

    # Execute
    try:
        res = CliRunner().invoke(app, ["zoo", flag, "--plugin", str(plugin)])
    finally:  # the levels the CLI set, for the tests after this one
        logging.getLogger().setLevel(logging.WARNING)
        logging.getLogger("model_zoo").setLevel(logging.NOTSET)

    # Assert: edgefl's DEBUG, the other library's INFO, its DEBUG only from -vvv
    assert res.exit_code == 0, res.output
    assert "ours at debug" in res.output and "theirs at info" in res.output
    assert ("theirs at debug" in res.output) is theirs


@pytest.mark.parametrize("command", [[], *COMMANDS, ["keys"]], ids=" ".join)
def test_help_calls_the_participant_a_client_and_device_only_where_it_computes(command):
    # One vocabulary: a client takes part in the federation; a device is where it computes
    # (--device cpu|cuda) or the hardware it runs on (an edge device). Before, `edgefl client`
    # was "Run one edge device" and the demo's --clients were "devices".
    text = _help(command)
    if "--device" in text:
        text = text.replace(_option_line(text, "--device"), "")
        text = re.sub(r"\s+--device\s[^\n]*(\n {20,}[^\n]*)*", "", text)
    words = " ".join(text.split()).replace("edge devices", "").replace("edge device", "")
    assert "device" not in words.lower(), command


def test_the_old_names_still_work_and_say_they_are_deprecated():
    import coordinator.config as config
    import coordinator.deploy as deploy

    with pytest.warns(DeprecationWarning, match="DeviceConfig is deprecated: it is ClientConfig"):
        assert config.DeviceConfig is config.ClientConfig
    with (
        pytest.warns(DeprecationWarning, match="run_device is deprecated: use run_client"),
        pytest.raises(Exception, match="which client is this"),
    ):
        deploy.run_device(config.load_config(flags={"broker.url": "mqtt://h", "auth.open": True}))
