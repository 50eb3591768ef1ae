"""The README and the docs site show what the code takes: the commands on the pages are the
ones the code parses, and the examples the README repeats are the files the site includes.

How, cheaply (in process, no engine, no Ray, a few seconds): the first-request examples live
once, in ``docs/snippets/``; the site includes them (pymdownx.snippets) and the README, which
GitHub renders without includes, repeats them verbatim, which this file checks, and
``tests/serve/test_cli_serve.py`` runs the README's ``RBLNClient`` one against the embedded
default. Every command in a ``bash`` block of the README or a page is checked against what it
names: an ``rbln-ray`` command is parsed by the CLI's own argparse parser (subcommand, flags,
choices, types; placeholders such as ``HF_DIR`` stand where a path goes), a ``make`` target
must be a Makefile target, a ``python -m`` module or a script must exist and define every
``--flag`` shown, and a repository path must exist. A ``yaml`` block with ``models:`` must
validate as rbln-ray's Serve config (its model paths, which are examples, replaced by the demo
model). What this cannot tell is whether a command does what the prose says; the tests of each
feature do that. ``mkdocs build --strict`` in ``make lint`` checks the links and anchors.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SNIPPETS = DOCS / "snippets"
README = ROOT / "README.md"
# Pages that only include BENCHMARKS.md / RELIABILITY.md, where measured figures (with their
# dates and commits) belong.
MEASUREMENT_PAGES = {DOCS / "benchmarks.md", DOCS / "reliability.md"}
PAGES = sorted(p for p in DOCS.rglob("*.md") if p not in MEASUREMENT_PAGES)
# A command's first word, after `.venv/bin/` and `VAR=value` prefixes.
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
# 7 to 40 hex digits with at least one digit and one letter: a commit hash, not a word.
COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def fenced_blocks(text: str, lang: str) -> list[str]:
    """The bodies of ```lang fences, indented ones (inside tabs, lists) dedented."""
    blocks = []
    for m in re.finditer(rf"^([ \t]*)```{lang}[ \t]*\n(.*?)^\1```", text, flags=re.S | re.M):
        indent = len(m.group(1))
        blocks.append("".join(line[indent:] for line in m.group(2).splitlines(keepends=True)))
    return blocks


def commands(path: Path) -> list[list[str]]:
    """Each command line of the file's bash blocks as words (continuations joined, comments
    and `VAR=value` prefixes dropped; `a && b` is two commands, `cmd &` one)."""
    found = []
    for block in fenced_blocks(path.read_text(), "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.lstrip().startswith("--8<--"):  # an included snippet: checked as a file
                continue
            words = shlex.split(line, comments=True)
            command: list[str] = []
            for word in [*words, "&&"]:
                if word in ("&&", "||", ";", "&", "|"):
                    while command and ENV_ASSIGNMENT.match(command[0]):
                        command.pop(0)
                    if command:
                        found.append(command)
                    command = []
                elif not (word.startswith(">") or command[-1:] == [">"]):
                    command.append(word)
    return found


def program(words: list[str]) -> str:
    return words[0].removeprefix(".venv/bin/")


ALL_FILES = [README, *PAGES]
ALL_COMMANDS = [(f, c) for f in ALL_FILES for c in commands(f)]
SNIPPET_FILES = sorted(SNIPPETS.iterdir())


def test_readme_is_a_newcomers_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail into docs/"


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_dates_or_commit_hashes(path: Path) -> None:
    """Dated, per-commit facts (measured figures, test runs) belong to BENCHMARKS.md and
    RELIABILITY.md with their run; the README and the guides link there instead."""
    text = path.read_text()
    assert not DATE.findall(text), DATE.findall(text)
    assert not COMMIT.findall(text), COMMIT.findall(text)


@pytest.mark.parametrize("snippet", SNIPPET_FILES, ids=lambda p: p.name)
def test_readme_repeats_the_snippets_the_site_includes(snippet: Path) -> None:
    lang = {".py": "python", ".sh": "bash"}[snippet.suffix]
    assert snippet.read_text() in fenced_blocks(README.read_text(), lang), (
        f"README.md must show {snippet.relative_to(ROOT)} verbatim (GitHub renders no includes)"
    )
    include = f'--8<-- "{snippet.relative_to(ROOT)}"'
    assert any(include in page.read_text() for page in PAGES), f"no page includes {snippet}"


def test_first_requests_target_the_embedded_default() -> None:
    """The examples talk to what ``rbln-ray serve`` without a config serves."""
    from rbln_ray.serve.config import embedded_default

    config = embedded_default()
    url = f"http://{config.host}:{config.port}/v1"
    names = [m.name for m in config.models]
    for name in ("first_request.sh", "first_request_openai.py", "first_request_client.py"):
        text = (SNIPPETS / name).read_text()
        if name.endswith(".py"):
            compile(text, name, "exec")
        else:
            assert url in text, (name, url)
        assert re.search(r"""["']demo["']""", text) and names == ["demo"], (name, names)
    assert url in (SNIPPETS / "first_request_openai.py").read_text()


RBLN_RAY = [(f, c) for f, c in ALL_COMMANDS if program(c) == "rbln-ray"]


@pytest.mark.parametrize(
    "path,words", RBLN_RAY, ids=[f"{f.name}:{' '.join(c[1:3])}" for f, c in RBLN_RAY]
)
def test_rbln_ray_commands_parse(path: Path, words: list[str]) -> None:
    from rbln_ray.cli.main import parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parser().parse_args(words[1:])
        except SystemExit:  # argparse's way of refusing
            pytest.fail(f"{path.name}: `{shlex.join(words)}` does not parse: {err.getvalue()}")


def makefile_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-$() ]+):(?!=)", line)
        if m:
            targets.update(m.group(1).split())
    return targets


MAKE = [(f, c) for f, c in ALL_COMMANDS if program(c) == "make"]


@pytest.mark.parametrize("path,words", MAKE, ids=[f"{f.name}:{shlex.join(c)}" for f, c in MAKE])
def test_make_targets_exist(path: Path, words: list[str]) -> None:
    targets = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
    missing = set(targets) - makefile_targets()
    assert not missing, f"{path.name}: `{shlex.join(words)}`: no Makefile target {missing}"


def python_target(words: list[str]) -> tuple[Path, list[str]] | None:
    """The source file a `python -m mod` / `python script.py` command runs, and its words."""
    if not program(words).startswith("python") or len(words) < 2:
        return None
    if words[1] == "-m":
        module = ROOT.joinpath(*words[2].split("."))
        if not (module.with_suffix(".py").is_file() or (module / "__main__.py").is_file()):
            return None  # not ours (vLLM's server): nothing to check here
        source = module.with_suffix(".py")
        return (source if source.is_file() else module / "__main__.py"), words[3:]
    return ROOT / words[1], words[2:]


PYTHON = [(f, c) for f, c in ALL_COMMANDS if python_target(c)]


@pytest.mark.parametrize(
    "path,words", PYTHON, ids=[f"{f.name}:{' '.join(c[1:3])}" for f, c in PYTHON]
)
def test_python_entry_points_exist_and_take_the_flags_shown(path: Path, words: list[str]) -> None:
    source, args = python_target(words)
    assert source.is_file(), f"{path.name}: `{shlex.join(words)}`: no {source}"
    # the flags may be declared by a sibling module the entry point imports (a shared parser)
    text = source.read_text()
    for imported in re.findall(r"^from (benchmarks|scripts)\.(\w+) import", text, flags=re.M):
        sibling = ROOT / imported[0] / f"{imported[1]}.py"
        text += sibling.read_text() if sibling.is_file() else ""
    # (a quoted value of another flag, "--max-model-len 1024", is one word with a space)
    for flag in (a.split("=")[0] for a in args if a.startswith("--") and " " not in a):
        assert f'"{flag}"' in text, f"{path.name}: {source.relative_to(ROOT)} has no {flag}"


REPO_DIRS = ("cluster_configs/", "scripts/", "docs/", "benchmarks/", "tests/", "rbln_ray/")


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_repository_paths_in_commands_exist(path: Path) -> None:
    for words in commands(path):
        for word in words:
            for part in word.split("="):
                if part.startswith(REPO_DIRS) and "<" not in part:
                    assert (ROOT / part).exists(), f"{path.name}: `{shlex.join(words)}`: {part}"


def config_examples() -> list[tuple[Path, dict]]:
    examples = []
    for page in ALL_FILES:
        for block in fenced_blocks(page.read_text(), "yaml"):
            data = yaml.safe_load(block)
            if isinstance(data, dict) and "models" in data:
                examples.append((page, data))
    return examples


CONFIGS = config_examples()


@pytest.mark.parametrize(
    "page,data", CONFIGS, ids=[f"{p.name}:{i}" for i, (p, _) in enumerate(CONFIGS)]
)
def test_config_examples_validate(page: Path, data: dict) -> None:
    from rbln_ray.serve.config import AppConfig

    data = {**data, "models": [{**m, "model": "demo"} for m in data["models"]]}
    AppConfig.model_validate(data)


def test_lora_and_quantization_families_are_the_registry() -> None:
    from rbln_ray.families.registry import DECODERS

    text = (DOCS / "guides" / "lora-quantization.md").read_text()
    for row, flag in (("LoRA adapters", "lora"), ("quantized checkpoints", "quantization")):
        m = re.search(rf"^\| {row}[^|]* \| ([^|]+) \|", text, flags=re.M)
        assert m, row
        listed = {name.strip() for name in m.group(1).split(",")}
        assert listed == {f.name for f in DECODERS.values() if getattr(f, flag)}, (row, listed)


def test_readme_links_resolve() -> None:
    """GitHub renders the README on its own (the site does not build it)."""
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text()):
        if "://" not in target:
            assert (ROOT / target).exists(), target


def test_every_page_section_is_reachable_from_the_commands_checked() -> None:
    """The checks above see what they should: the pages do contain each kind of command."""
    kinds = {program(c) for _, c in ALL_COMMANDS}
    assert {"rbln-ray", "make", "python", "ray", "serve", "curl"} <= kinds, kinds
    assert RBLN_RAY and MAKE and PYTHON and CONFIGS
