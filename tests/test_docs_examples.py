"""The examples in the user docs stay true: every `pelt` command line in their shell blocks parses against
the real CLI (its commands, options, choices and required arguments), every import in their Python blocks
resolves, every call of the client or of pelt's own API in them (and in their inline code) binds to the
real signature, and the examples that run on what a user has — `pelt example-data`, `pelt train` and the
Python training example on the packaged all-MiniLM-L6-v2 — run."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest

from services.cli import main
from services.client import PeltClient

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    ROOT / "ARCHITECTURE.md",
    ROOT / "deploy" / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE_CALL = re.compile(r"`((?:PeltClient|client)\.\w+\([^`]*\))`")
SEPARATORS = {";", "&", "&&", "|", "||"}


def blocks(path: Path, *languages: str) -> list[tuple[int, str]]:
    """(first line number, text) of each fenced block in one of `languages`."""
    text = path.read_text()
    return [
        (text.count("\n", 0, m.start()) + 2, m.group(2))
        for m in FENCE.finditer(text)
        if m.group(1) in languages
    ]


def pelt_command_lines(text: str) -> list[list[str]]:
    """The argument lists of every `pelt …` command in a shell block: continuation lines joined, comments,
    environment assignments before the command and what follows `;`, `&`, `&&` or `|` dropped."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split, lexer.commenters = True, "#"
        words: list[str] = []
        for word in [*lexer, ";"]:
            if word not in SEPARATORS:
                words.append(word)
                continue
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words.pop(0)
            if words[:1] == ["pelt"]:
                commands.append(words[1:])
            words = []
    return commands


def parse_command_line(args: list[str]) -> click.Command:
    """Parse `pelt ARGS` as the CLI would, down to its leaf command, without running it (UsageError and
    BadParameter name what is wrong); returns that command."""
    command, context = main, main.make_context("pelt", list(args))
    while isinstance(command, click.Group):
        rest = [*getattr(context, "_protected_args", []), *context.args]
        name, command, rest = command.resolve_command(context, rest)
        context = command.make_context(name, rest, parent=context)
    return command


def shell_examples() -> list[Any]:
    found = []
    for path in DOCS:
        for line, text in blocks(path, "bash", "sh"):
            for args in pelt_command_lines(text):
                if {"...", "…"} & set(args):  # an elided sketch (`pelt task add ...`), not a command line
                    continue
                label = f"{path.relative_to(ROOT)}:{line}: pelt {' '.join(args)}"
                found.append(pytest.param(args, id=label[:150]))
    return found


def test_the_docs_hold_pelt_command_examples_from_every_part_of_the_cli():
    used = {tuple(p.values[0][:1]) for p in shell_examples()}
    for command in ("train", "serve", "task", "sweep", "submit", "pull", "compose", "study", "example-data"):
        assert (command,) in used, f"no example of `pelt {command}` in the docs"


@pytest.mark.parametrize("args", shell_examples())
def test_every_pelt_command_line_in_the_docs_parses_against_the_cli(args, example_folder, monkeypatch):
    """In a folder where `pelt example-data data` ran: the files the examples name exist there."""
    monkeypatch.chdir(example_folder)
    parse_command_line(args)


def test_a_command_line_the_cli_does_not_have_is_caught():
    """The check above can fail: a renamed option, a bad choice and a missing argument are each caught."""
    with pytest.raises(click.NoSuchOption):
        parse_command_line(["sweep", "sst2", "--method", "lora"])
    with pytest.raises(click.BadParameter):
        parse_command_line(["serve", "--access-log", "loud"])
    with pytest.raises(click.MissingParameter):
        parse_command_line(["pull", "sst2"])
    assert pelt_command_lines("A=1 pelt jobs --task x # comment\nls && pelt watch 7 &") == [
        ["jobs", "--task", "x"],
        ["watch", "7"],
    ]


# --- Python ----------------------------------------------------------------------------------------------


def python_examples() -> list[Any]:
    return [
        pytest.param(text, id=f"{path.relative_to(ROOT)}:{line}")
        for path in DOCS
        for line, text in blocks(path, "python")
    ]


def inline_calls() -> list[Any]:
    return [
        pytest.param(call, id=f"{path.relative_to(ROOT)}: {call}"[:150])
        for path in DOCS
        for call in INLINE_CALL.findall(path.read_text())
    ]


def imported_names(tree: ast.Module) -> dict[str, Any]:
    """What the block's `from X import Y` lines bind, imported for real (an import that fails, fails)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
                names[alias.asname or alias.name] = getattr(module, alias.name)
    return names


def callee(call: ast.Call, names: dict[str, Any]) -> Any:
    """The function a call in an example means, where the example says which: a name it imported, a method
    of the client (`client.x`, `PeltClient.x`) or of a class it imported (`Backbone.load`)."""
    function = call.func
    if isinstance(function, ast.Name):
        return names.get(function.id)
    if isinstance(function, ast.Attribute) and isinstance(function.value, ast.Name):
        owner = function.value.id
        if owner in ("client", "PeltClient"):
            assert hasattr(PeltClient, function.attr), f"PeltClient has no method {function.attr}"
            return getattr(PeltClient, function.attr)
        if inspect.isclass(names.get(owner)):
            assert hasattr(names[owner], function.attr), f"{owner} has no {function.attr}"
            return getattr(names[owner], function.attr)
    return None


def check_calls(tree: ast.AST, names: dict[str, Any]) -> int:
    """Bind every call the example makes of a known function to its signature; returns how many."""
    checked = 0
    for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
        function = callee(call, names)
        if function is None or not callable(function):
            continue
        signature = inspect.signature(function)
        arguments = [None] * len(call.args)
        keywords = {k.arg: None for k in call.keywords if k.arg}
        if inspect.isfunction(function) and next(iter(signature.parameters), None) == "self":
            arguments.insert(0, None)  # a method taken from its class: the example calls it on an instance
        try:
            signature.bind(*arguments, **keywords)
        except TypeError as exc:
            raise AssertionError(f"{ast.unparse(call)}: {exc}") from None
        checked += 1
    return checked


@pytest.mark.parametrize("text", python_examples())
def test_every_python_example_imports_what_exists_and_calls_with_arguments_the_api_takes(text):
    tree = ast.parse(text)
    names = imported_names(tree)
    assert check_calls(tree, names) > 0


@pytest.mark.parametrize("call", inline_calls())
def test_every_client_call_in_the_docs_inline_code_binds_to_the_client(call):
    tree = ast.parse(call.replace("…", "..."))
    assert check_calls(tree, {}) == 1


def test_a_call_the_client_does_not_take_is_caught():
    with pytest.raises(AssertionError, match="submit"):
        check_calls(ast.parse('client.submit("sst2", "lora", "minilm")'), {})
    with pytest.raises(AssertionError, match="no method"):
        check_calls(ast.parse('client.pull_delta("sst2")'), {})


# --- the examples that run on what a user has ------------------------------------------------------------


def readme_block(containing: str, *languages: str) -> str:
    (text,) = [t for _, t in blocks(ROOT / "README.md", *languages) if containing in t]
    return text


def run_pelt(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-c", "from services.cli import main; main()", *args],
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PELT_DATA_DIR": str(cwd / "pelt")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"pelt {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def example_folder(tmp_path_factory) -> Path:
    """A folder where the README's `pelt example-data data` has run."""
    folder = tmp_path_factory.mktemp("readme")
    (args,) = [
        a for a in pelt_command_lines(readme_block("pelt example-data", "bash")) if a[0] == "example-data"
    ]
    run_pelt(args, folder)
    return folder


def test_the_example_data_come_from_scattertexts_corpus_without_importing_the_package(tmp_path):
    """`pelt example-data` reads the corpus file inside the installed package: importing scattertext
    would add seconds to every `pelt example-data` and `pelt demo`."""
    script = (
        "import sys; from pathlib import Path; from services.demo import write_rotten_tomatoes; "
        "train, validation = write_rotten_tomatoes(Path(sys.argv[1]), validation_size=5); "
        "print(len(train.read_text().splitlines()), len(validation.read_text().splitlines()), "
        "'scattertext' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, check=True
    )
    train_rows, validation_rows, imported = done.stdout.split()
    assert int(train_rows) > 1000 and int(validation_rows) == 5
    assert imported == "False"


def test_without_scattertext_the_example_data_say_which_package_to_install(monkeypatch, tmp_path):
    from services import demo

    find_spec = demo.importlib.util.find_spec  # hide scattertext only
    monkeypatch.setattr(
        demo.importlib.util,
        "find_spec",
        lambda name, *rest: None if name == "scattertext" else find_spec(name, *rest),
    )
    with pytest.raises(click.ClickException, match="pip install scattertext"):
        demo.write_rotten_tomatoes(tmp_path)
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.slow
def test_the_readmes_local_training_example_runs_on_the_example_data(example_folder):
    """The README's `pelt train` as written, capped at two steps (`--set max_steps=2`) to stay quick."""
    (args,) = [a for a in pelt_command_lines(readme_block("pelt example-data", "bash")) if a[0] == "train"]
    done = run_pelt([*args, "--set", "max_steps=2"], example_folder)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and "accuracy" in summary["metrics"]
    out = example_folder / args[args.index("--out") + 1]
    assert (out / "delta.safetensors").is_file() and (out / "manifest.json").is_file()


@pytest.mark.slow
def test_the_readmes_python_training_example_runs_and_predicts_the_example_datas_labels(
    example_folder, monkeypatch, capsys
):
    monkeypatch.chdir(example_folder)
    exec(compile(readme_block("from pelt_core.train import train", "python"), "README.md", "exec"), {})
    predictions = capsys.readouterr().out.strip().splitlines()[-1]
    assert "'label': 'positive'" in predictions or "'label': 'negative'" in predictions
