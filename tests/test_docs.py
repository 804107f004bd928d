"""Every command block of the README and ``docs/*.md`` (and ``bench/README.md``) against the CLI: each ``sdnpu ...``
command parses with the CLI's own argparse parser (every flag exists for its verb, every choice named is a valid
one, a value a flag converts converts), each ``make ...`` names a target and variables the Makefile has (and valid
choices for the ones that map to a flag); and the ``sdnpu report`` / ``sdnpu lora show`` commands run, on the tiny
conversion, as written but for the folder.

A command is written as a synopsis: ``[...]`` marks what is optional (checked as if given), ``a|b`` the choices
(each checked), words with capitals or ``<...>`` are placeholders (DIR, FILE[:SCALE], WxH), and ``...`` elides
arguments (then the flags are checked one by one, not the whole command).
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from sdnpu.cli import build_parser, main
from sdnpu.components import COMPONENTS

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
# make variables whose values the CLI checks: the flag each becomes
MAKE_FLAGS = {"PRECISION": "--precision", "TARGET": "--target", "EXPORTER": "--exporter", "HTP_ARCH": "--htp-arch",
              "HTP_OPT": "--htp-optimization"}


@dataclass(frozen=True)
class Command:
    page: str
    line: str
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}: {self.line}"


def _commands(page: Path) -> list[Command]:
    """The ``sdnpu`` and ``make`` commands of a page's code blocks, continuation lines joined, comments and
    ``&&`` chains split off."""
    out: list[Command] = []
    for block in FENCE.findall(page.read_text()):
        lines: list[str] = []
        for raw in block.splitlines():
            stripped = raw.strip()
            if raw[:1].isspace() and lines and stripped and not stripped.startswith(("#", "sdnpu ", "make ")):
                lines[-1] += " " + stripped
            elif stripped.startswith(("sdnpu ", "make ")) or stripped in ("sdnpu", "make"):
                lines.append(stripped)
        for line in lines:
            line = re.sub(r"\s#.*$", "", line)
            for part in line.split("&&"):
                words = tuple(w for w in (t.replace("[", "").replace("]", "") for t in shlex.split(part)) if w)
                out.append(Command(page.relative_to(ROOT).as_posix(), part.strip(), words))
    return out


COMMANDS = [c for page in PAGES for c in _commands(page)]


def placeholder(value: str) -> bool:
    return bool(re.search(r"[A-Z<]", value)) or "..." in value


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _check_value(cmd: Command, action: argparse.Action, value: str) -> str:
    """Each alternative of ``value`` that is not a placeholder must be a valid value of ``action``; returns one
    that parses. ``<a|b>`` names the choices too."""
    if value.startswith("<") and value.endswith(">") and "|" in value:
        value = value[1:-1]
    alternatives = value.split("|") if action.choices is not None or "|" in value else [value]
    for alt in alternatives:
        if placeholder(alt):
            continue
        if action.choices is not None:
            assert alt in action.choices, f"{cmd}: {alt!r} is not a choice of {action.option_strings[0]}: {action.choices}"
        if action.type in (int, float):
            action.type(alt)  # raises on a value the flag would refuse
    real = [a for a in alternatives if not placeholder(a)]
    if real:
        return real[0]
    if action.choices is not None:
        return str(next(iter(action.choices)))
    return {int: "1", float: "0.5"}.get(action.type, "x")  # type: ignore[arg-type]


def _sdnpu_argv(cmd: Command) -> list[str]:
    """Check the command's verb, flags and choices; returns it with every placeholder given a value."""
    parser = build_parser()
    verbs = _subparsers(parser)
    words = list(cmd.words[1:])
    argv: list[str] = []
    while words and words[0].startswith("-"):  # the global flags (-q) before the verb
        assert words[0] in parser._option_string_actions, f"{cmd}: no global flag {words[0]}"
        argv.append(words.pop(0))
    assert words and words[0] in verbs, f"{cmd}: no verb {words[:1]} (sdnpu has {', '.join(verbs)})"
    verb = verbs[words[0]]
    argv.append(words.pop(0))
    positionals = [a for a in verb._actions if not a.option_strings and not isinstance(a, argparse._HelpAction)]
    while words:
        word = words.pop(0)
        if word == "...":
            continue
        if word.startswith("-"):
            flag, _, inline = word.partition("=")
            assert flag in verb._option_string_actions, f"{cmd}: `sdnpu {argv[0]}` has no flag {flag}"
            action = verb._option_string_actions[flag]
            argv.append(flag)
            if action.nargs != 0:
                value = inline or (words.pop(0) if words else "")
                assert value and value != "...", f"{cmd}: {flag} takes a value"
                argv.append(_check_value(cmd, action, value))
            continue
        action = positionals[0] if positionals else None
        assert action is not None, f"{cmd}: `sdnpu {argv[0]}` takes no more positional arguments than these ({word!r})"
        if action.nargs not in ("+", "*"):
            positionals.pop(0)
        argv.append(_check_value(cmd, action, word) if action.choices is not None else
                    ("x" if placeholder(word) else word))
    return argv


def _makefile() -> tuple[set[str], set[str]]:
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", text, re.M))
    variables = set(re.findall(r"^([A-Z_]+)\s*\?=", text, re.M)) | set(re.findall(r"\$\(([A-Z_]+)\)", text))
    return targets, variables


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.words[0] == "sdnpu"], ids=str)
def test_every_sdnpu_command_parses(cmd):
    argv = _sdnpu_argv(cmd)
    if "..." in cmd.words:
        return  # elided arguments: the flags were checked one by one
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"{cmd}: the CLI's parser refuses it (as {argv})") from e


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.words[0] == "make"], ids=str)
def test_every_make_command_names_a_target_and_its_variables(cmd):
    targets, variables = _makefile()
    convert = _subparsers(build_parser())["convert"]
    assert len(cmd.words) > 1, f"{cmd}: name the target"
    for word in cmd.words[1:]:
        name, eq, value = word.partition("=")
        if not eq:
            assert word in targets, f"{cmd}: the Makefile has no target {word!r}"
            continue
        assert name in variables, f"{cmd}: the Makefile has no variable {name}"
        if name in MAKE_FLAGS:
            _check_value(cmd, convert._option_string_actions[MAKE_FLAGS[name]], value)
        if name == "MODEL" and not placeholder(value):
            for comp in value.split(","):
                assert comp in (*COMPONENTS, "all"), f"{cmd}: {comp!r} is not a component"


def test_the_pages_have_commands_to_check():
    """The parser above finds the commands (a change to how the pages write them would otherwise pass silently)."""
    pages = {c.page for c in COMMANDS}
    assert {"README.md", "docs/cli.md", "docs/lora.md", "docs/report.md"} <= pages
    assert sum(c.words[0] == "sdnpu" for c in COMMANDS) >= 30 and sum(c.words[0] == "make" for c in COMMANDS) >= 10
    with pytest.raises(AssertionError, match="has no flag --no-such-flag"):
        _sdnpu_argv(Command("test", "sdnpu convert --no-such-flag", ("sdnpu", "convert", "--no-such-flag")))
    with pytest.raises(AssertionError, match="is not a choice of --precision"):
        _sdnpu_argv(Command("test", "sdnpu compile m.onnx --precision fp8",
                            ("sdnpu", "compile", "m.onnx", "--precision", "fp8")))


def _on(folder: Path, word: str, tmp: Path) -> str:
    """A word of a report command with the docs' folder (``models/<name>``) as the tiny conversion."""
    if word.startswith("models/"):
        rest = word.split("/", 2)[2:]  # models/<name>/<component>...
        return str(folder.joinpath(*rest))
    return {"OLD": str(folder / "unet" / "dd" / "report.json"), "NEW": str(folder / "vae_decoder"),
            "PERCENT": "1", "FILE": str(tmp / "offload.svg")}.get(word, str(tmp / word) if word.endswith(".svg") else word)


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.words[:2] in (("sdnpu", "report"), ("sdnpu", "lora"))
                                 and (c.words[1] != "lora" or c.words[2] == "show")], ids=str)
def test_the_report_commands_run_on_the_tiny_conversion(cmd, tiny_conversion, tmp_path, capsys):
    argv = [_on(tiny_conversion.out, w, tmp_path) for w in cmd.words[1:]]
    code = main(argv)
    out = capsys.readouterr()
    assert code == 0 or (code == 1 and "--fail-under" in argv and "below the gate" in out.err), (cmd, argv, out.err)
    assert out.out.strip()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    """Links between the pages (and to files of the repository) point at files that exist, and an anchor at a
    heading of the page it names."""
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: {target} does not exist"
        if anchor and dest.suffix == ".md":
            headings = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                        for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}
            assert anchor in headings, f"{page.name}: {target}: no heading #{anchor} in {dest.name}"


MAPPED = ("sdnpu", "sdnpu/formats", "sdnpu/backends", "convert", "convert/blockwise", "passes", "passes/canonical",
          "passes/htp", "passes/rules", "reports", "runtime", "ops", "lora")


def test_the_module_map_names_every_module():
    """docs/design.md's module map: each module of these folders (``__init__.py`` aside) is named in a row whose
    first column names its folder (the folder itself, or a module in it)."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    folders = [{t.rstrip("/") if t.endswith("/") else t.rpartition("/")[0]
                for t in re.findall(r"`([\w/.]+)`", row.split(" | ", 1)[0])} for row in rows]
    missing = [f"{folder}/{path.name}" for folder in MAPPED for path in sorted((ROOT / folder).glob("*.py"))
               if path.name != "__init__.py" and not any(
                   folder in fs and any(f"`{n}`" in row for n in (path.stem, path.name, f"{folder}/{path.name}"))
                   for fs, row in zip(folders, rows))]
    assert not missing, f"docs/design.md's module map leaves out {missing}"
