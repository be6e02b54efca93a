"""The documentation: the site builds with --strict, its front page renders in headless Chromium,
and the code it shows cannot drift from the code that runs. The tutorials include their Python
from examples/ (tests/coordinator/test_examples.py runs those files), the README shows the same
files, and every `edgefl` command line in the docs and the README parses against the CLI."""

from __future__ import annotations

import functools
import http.server
import os
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from chromium import chromium_path, load_page

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _build(config: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    res = _build(ROOT / "mkdocs.yml", out)
    assert res.returncode == 0, res.stdout + res.stderr
    return out


def test_the_site_builds_strict_with_the_generated_pages(site: Path) -> None:
    # The API pages come from the docstrings (mkdocstrings), the settings and every command's
    # help from the code (tools/docs_hooks.py).
    api = (site / "api" / "edge_sdk" / "index.html").read_text()
    assert "edge_sdk.client.EdgeClient" in api and "One client: a" in api
    # What a plugin author subclassing FedAvg needs: its model attribute and the model names.
    assert "<code>self.model</code> is the client" in api
    assert 'sends it back as <code>"model"</code>' in api
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "<code>fml.alpha</code>" in cli and "EDGEFL_ROUND__QUORUM" in cli
    assert "Run one client of a federation over MQTT" in cli  # `edgefl client --help`
    tutorial = (site / "tutorials" / "client-app" / "index.html").read_text()
    assert "EdgeClient(node, broker" in tutorial  # examples/client_app.py, included


def test_a_broken_link_fails_the_strict_build(tmp_path: Path) -> None:
    # The site's own settings (strict, every link and anchor validated), on a one-page site:
    # a link to a page that is not there fails the build.
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# edgefl\n\n[a page that is not there](tutorials/nowhere.md)\n")
    config = (ROOT / "mkdocs.yml").read_text().split("\nnav:")[0]  # no pages besides index
    config = config.replace("docs_dir: docs", f"docs_dir: {docs}")
    hooks = str(ROOT / "tools" / "docs_hooks.py")
    (tmp_path / "mkdocs.yml").write_text(config.replace("tools/docs_hooks.py", hooks))

    res = _build(tmp_path / "mkdocs.yml", tmp_path / "site")

    assert res.returncode != 0
    assert "'tutorials/nowhere.md', but the target is not found" in res.stdout + res.stderr
    fixed = (docs / "index.md").read_text().replace("tutorials/nowhere.md", "#edgefl")
    (docs / "index.md").write_text(fixed)
    assert _build(tmp_path / "mkdocs.yml", tmp_path / "site").returncode == 0


@pytest.fixture
def served(site: Path) -> Iterator[str]:
    """The built site over HTTP on a free local port, as `make docs` serves it."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.skipif(
    chromium_path() is None,
    reason="chromium is not installed (make test installs it as root: apt-get install chromium)",
)
def test_the_front_page_renders_in_headless_chromium(served: str, tmp_path: Path) -> None:
    # Execute: what a person's browser shows of the front page.
    shot = tmp_path / "front.png"
    page = load_page(
        served,
        evaluate={
            "heading": "document.querySelector('article h1').textContent",
            "nav": "Array.from(document.querySelectorAll('nav.md-nav--primary > ul > li > "
            "label, nav.md-nav--primary > ul > li > a')).map(e => e.textContent.trim())",
            "rows": "document.querySelectorAll('article table tbody tr').length",
            "styled": "getComputedStyle(document.querySelector('header')).position",
            "width": "document.querySelector('article').getBoundingClientRect().width",
        },
        screenshot=shot,
    )

    # Assert: the page, its theme and its navigation rendered, with nothing failing.
    assert page["title"].startswith("edgefl")
    assert page["heading"].rstrip("¶").strip() == "edgefl"  # ¶: the heading's permalink
    assert {"Home", "Tutorials", "Reference", "Benchmarks"} <= set(page["nav"])
    assert page["rows"] >= 5 + 7  # the tutorials' table and the measured one
    assert page["styled"] == "sticky" and page["width"] > 400  # material's stylesheet applied
    assert page["exceptions"] == [] and page["console_errors"] == [], page
    assert page["failed_requests"] == []
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 20_000


def _fences(path: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text())]


def _doc_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_the_docs_python_is_included_from_files_the_tests_run() -> None:
    # A Python block in the docs is a file of examples/, included when the site is built:
    # tests/coordinator/test_examples.py runs those files, so the docs run as shown.
    for page in _doc_pages():
        for lang, body in _fences(page):
            if lang != "python":
                continue
            included = re.fullmatch(r'--8<-- "(examples/[\w/.-]+\.py)"\n', body)
            assert included, f"{page.relative_to(ROOT)}: a Python block not from examples/"
            assert (ROOT / included.group(1)).is_file()


def test_the_readme_is_a_short_page_whose_code_is_the_examples() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert "edgefl demo" in text and "make demo" in text and "make test" in text
    blocks = [body for lang, body in _fences(README) if lang == "python"]
    assert len(blocks) == 2
    for body, example in zip(blocks, ["first_simulation.py", "client_app.py"], strict=True):
        assert body == (ROOT / "examples" / example).read_text(), example


def _command_lines() -> Iterator[tuple[str, list[str]]]:
    """Every `edgefl ...` line of a shell block in the docs and the README, as arguments."""
    for path in [README, *_doc_pages()]:
        for lang, body in _fences(path):
            if lang != "sh":
                continue
            for line in body.replace("\\\n", " ").splitlines():
                line = line.split("#")[0].strip().rstrip("&").strip()
                words = shlex.split(line) if "edgefl " in line else []
                while words and "=" in words[0]:  # VAR=value before the command
                    words.pop(0)
                if words and words[0].endswith("edgefl") and "..." not in line:
                    yield f"{path.name}: {line}", words[1:]


def test_every_edgefl_command_line_in_the_docs_parses() -> None:
    import typer

    from coordinator.cli import app

    checked = 0
    for where, args in _command_lines():
        command, ctx = typer.main.get_command(app), None
        rest = args
        # Walk down the groups to the command, then parse its options as the CLI would.
        while hasattr(command, "commands") and rest and rest[0] in command.commands:
            ctx = command.make_context(command.name or "edgefl", [rest[0]], parent=ctx)
            command, rest = command.commands[rest[0]], rest[1:]
        assert not hasattr(command, "commands"), f"{where}: no such command"
        try:
            command.make_context(command.name or "edgefl", list(rest), parent=ctx)
        except Exception as exc:  # click's usage errors: a flag the command does not have
            raise AssertionError(f"{where}: {exc}") from exc
        checked += 1
    assert checked >= 15


def test_the_bridge_config_shown_is_the_one_bridge_config_writes() -> None:
    # What tests/coordinator/test_bridges.py runs, with the docs' address and credentials.
    from coordinator.broker import bridge_config

    tested = bridge_config("site-a", "central.lan:8883")
    full = bridge_config(
        "site-a",
        "central.lan:8883",
        username="site-a",
        password="<the bridge user's password>",
        cafile="/etc/mosquitto/certs/ca.pem",
    )
    shown = {
        path.name: [body for _, body in _fences(path) if body.startswith("connection ")]
        for path in (README, DOCS / "tutorials" / "deploy.md")
    }
    assert shown == {"README.md": [tested], "deploy.md": [full]}
