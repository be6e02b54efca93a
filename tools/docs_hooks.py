"""mkdocs hooks: the generated parts of the reference (mkdocs.yml names this file).

`<!-- edgefl:settings -->` becomes the table of every setting with its default and its
description, from `RunConfig` (the same as `edgefl settings`, and as the flags' help);
`<!-- edgefl:help -->` becomes every command's `--help`, from the command line itself. So the
reference cannot drift from the code.
"""

from __future__ import annotations

import json
from typing import Any

SETTINGS = "<!-- edgefl:settings -->"
HELP = "<!-- edgefl:help -->"


def _settings_table() -> str:
    from coordinator.config_keys import ENV_PREFIX, setting_field, setting_keys
    from coordinator.run_config import run_config_model

    defaults = run_config_model()()
    rows = [
        "| key | default | environment variable | meaning |",
        "|---|---|---|---|",
    ]
    for key in setting_keys():
        node: Any = defaults
        for part in key.split("."):
            node = getattr(node, part)
        value = json.dumps(node.model_dump() if hasattr(node, "model_dump") else node)
        env = ENV_PREFIX + key.upper().replace(".", "__")
        try:  # the same words as the flag's --help (an algorithm's section has none yet)
            meaning = setting_field(key).description or ""
        except KeyError:
            meaning = ""
        meaning = meaning.replace("|", "\\|").replace("<", "&lt;")
        rows.append(f"| `{key}` | `{value}` | `{env}` | {meaning} |".replace("|`", "| `"))
    return "\n".join(rows)


def _helps() -> str:
    from typer.testing import CliRunner

    from coordinator.cli import app, command_paths

    out = []
    runner = CliRunner()
    for args in command_paths():
        text = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "100"}, prog_name="edgefl")
        title = " ".join(["edgefl", *args])
        out += [f"### `{title}`", "", "```text", text.output.rstrip(), "```", ""]
    return "\n".join(out)


def on_page_markdown(markdown: str, **_: Any) -> str:
    if SETTINGS in markdown:
        markdown = markdown.replace(SETTINGS, _settings_table())
    if HELP in markdown:
        markdown = markdown.replace(HELP, _helps())
    return markdown
