"""Every code block of README.md and docs/*.md runs as pasted.

How each fenced block is tested:

- ```python blocks are **executed**, each as a program of its own in a fresh Python
  process (a reader may paste any one of them alone, so each must import and define
  what it uses), in a temporary directory, with this checkout first on PYTHONPATH.
  They must exit 0 and print nothing on stderr.
- ```bash blocks are split into commands (backslash continuations joined, comments
  dropped).  None is both cheap and safe to run here (the benchmark takes minutes,
  the test suite would run itself, pip would change the environment, the char-LM
  commands train for an hour or need the checkpoint that training writes, the GPU
  script needs a GPU), so every command is **checked** instead, as far as it can be
  without running it:
    * ``python -m MODULE ...``, ``python SCRIPT.py ...`` and console scripts such as
      ``torchrun``: their arguments are **parsed by the program's own argparse parser**
      (the program is started, and stopped as soon as its parser returns: bad flags,
      values or choices fail), and for ``torchrun`` the launched script's arguments too;
    * ``python -m pytest ...``: ``--collect-only`` (the suite is found and imports);
    * ``./run bench ARGS``: ARGS parsed by the benchmark's parser; ``./run test ARGS``: pytest
      ``--collect-only`` on ARGS; ``./run setup``: the script's syntax (``bash -n``);
    * ``python setup.py CMD ARGS``: ``CMD --help`` runs and lists every flag of ARGS;
    * ``VAR=value`` assignments before a command are kept for its check;
    * ``pip install ...``: every flag is one ``pip install --help`` lists, requirement
      files and the source directory exist;
    * ``bash SCRIPT.sh ...``: ``bash -n`` (syntax), the script exists.
  A command no rule covers fails the test: add a rule here, or run it.
- Unlabelled blocks and those labelled as data or output (TEXT_KINDS) are not run:
  program output, the source layout, a JSON example.  Any other label fails the test,
  so that no block of code goes untested by accident.

A block is left out only with a marker comment on the line right before its fence,
giving the reason: ``<!-- readme-test: skip: REASON -->`` (none today).
"""
from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import List, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SKIP_MARKER = re.compile(r"^<!--\s*readme-test:\s*skip\b:?\s*(?P<reason>.*?)\s*-->$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
PYTHON_KINDS = ("python", "py", "python3")
SHELL_KINDS = ("bash", "sh", "shell")
TEXT_KINDS = ("", "text", "console", "output", "json")


@dataclass
class Block:
    lang: str               # the fence's label: "python", "bash", "" (text), ...
    code: str
    line: int               # 1-based line of the opening fence in its page
    skip: Optional[str]     # the reason given by a skip marker, if any
    page: str = "README.md"  # the page, relative to the checkout

    @property
    def id(self) -> str:
        page = "" if self.page == "README.md" else self.page.replace("/", "-").removesuffix(".md") + "-"
        return f"{page}{self.lang or 'text'}-line{self.line}"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def readme_blocks(text: str, page: str = "README.md") -> List[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        assert end is not None, f"{page}:{i + 1}: code block never closed"
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = SKIP_MARKER.match(before)
        assert not marker or len(marker["reason"].split()) >= 3, \
            f"{page}:{i + 1}: a skip marker must give its reason (a few words)"
        blocks.append(Block(opening["lang"], "\n".join(lines[i + 1:end]) + "\n", i + 1,
                            marker["reason"] if marker else None, page))
        i = end + 1
    return blocks


BLOCKS = [b for page in PAGES
          for b in readme_blocks(page.read_text(encoding="utf-8"), str(page.relative_to(ROOT)))]
RUN = [b for b in BLOCKS if b.skip is None]


def bash_commands(code: str) -> List[List[str]]:
    """The block's commands as argv lists: continuations joined, comments and blank
    lines dropped."""
    joined = re.sub(r"\\\n", " ", code)
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def env_with_checkout() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run(argv: List[str], cwd: Path = ROOT, timeout: float = 300, env: Optional[dict] = None) \
        -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env={**env_with_checkout(), **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


# ------------------------------------------------------- parse, do not run ----

#: Runs each (kind, target, argv) up to the moment its argparse parser returns, then
#: stops it and prints what was parsed.  kind: "module" (python -m) or "script".
PARSE_ONLY = r"""
import argparse, json, os, runpy, sys

class Parsed(BaseException):
    pass

original = argparse.ArgumentParser.parse_known_args

def parse_then_stop(self, args=None, namespace=None):
    namespace, extras = original(self, args, namespace)
    raise Parsed({"prog": self.prog, "args": vars(namespace), "unrecognized": extras})

argparse.ArgumentParser.parse_known_args = parse_then_stop
results = []
for kind, target, argv in json.loads(sys.argv[1]):
    sys.argv = [target, *argv]
    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
        results.append({"error": "ran to the end without parsing its arguments with argparse"})
    except Parsed as parsed:
        results.append(parsed.args[0])
    except SystemExit as exit_:
        results.append({"error": f"exited with {exit_.code} while parsing {argv}"})
print("\nPARSED " + json.dumps(results, default=str))
"""


def parse_results(commands: List[tuple]) -> tuple:
    """What PARSE_ONLY made of each command (one process for all), and its stderr."""
    done = run([sys.executable, "-c", PARSE_ONLY, json.dumps(commands)])
    assert done.returncode == 0 and "\nPARSED " in done.stdout, done.stderr[-3000:]
    return json.loads(done.stdout.rsplit("\nPARSED ", 1)[1]), done.stderr


def parse_only(commands: List[tuple]) -> List[dict]:
    """Each command's parsed arguments; fails on any that its parser rejects."""
    results, stderr = parse_results(commands)
    for (kind, target, argv), result in zip(commands, results):
        assert "error" not in result, f"{target} {shlex.join(argv)}: {result['error']}\n{stderr[-2000:]}"
        assert not result["unrecognized"], f"{target} {shlex.join(argv)}: unrecognized {result['unrecognized']}"
    return results


def console_script_module(name: str) -> Optional[str]:
    """The module behind an installed console script (e.g. torchrun)."""
    found = metadata.entry_points(group="console_scripts", name=name)
    return next((ep.module for ep in found), None)


def python_target(argv: List[str]) -> tuple:
    """("module", name, args) for ``python -m name args``, ("script", path, args) for
    ``python path args``."""
    assert argv[0] == "python" and len(argv) > 1, argv
    if argv[1] == "-m":
        return ("module", argv[2], argv[3:])
    assert not argv[1].startswith("-"), f"python option {argv[1]!r}: add a rule for it"
    assert (ROOT / argv[1]).is_file(), f"{argv[1]}: no such script"
    return ("script", argv[1], argv[2:])


# ----------------------------------------------------------------- checks ----

@functools.lru_cache(maxsize=None)
def pip_install_help() -> str:
    return run([sys.executable, "-m", "pip", "install", "--help"]).stdout


def check_pip_install(argv: List[str]) -> None:
    from packaging.requirements import Requirement

    assert argv[:2] == ["pip", "install"], argv
    help_text = pip_install_help()
    args = iter(argv[2:])
    for arg in args:
        if arg.startswith("-"):
            flag = arg.split("=", 1)[0]
            assert re.search(rf"(^|[\s,]){re.escape(flag)}([\s,=<]|$)", help_text, re.M), \
                f"pip install has no option {flag}"
            if flag in ("-r", "--requirement"):
                assert (ROOT / next(args)).is_file(), f"{shlex.join(argv)}: no such requirements file"
            elif flag in ("-e", "--editable"):
                path = next(args)
                assert (ROOT / path / "pyproject.toml").is_file(), f"{path}: not a source directory"
        elif arg == "." or arg.startswith(("./", "/")):
            assert (ROOT / arg / "pyproject.toml").is_file(), f"{arg}: not a source directory"
        else:
            Requirement(arg)  # raises on a malformed requirement


def check_pytest(argv: List[str]) -> None:
    """Running the suite from inside the suite would recurse: collect it instead."""
    args = [a for a in argv[3:] if a not in ("-q", "--quiet")]  # -qq lists counts per file
    collect(tuple(args))


@functools.lru_cache(maxsize=None)
def collect(args: tuple) -> None:
    """Collecting the whole suite takes most of a minute: once per arguments and process
    (the README's `./run test` and `python -m pytest tests` both collect `tests`)."""
    done = run([sys.executable, "-m", "pytest", *args, "--collect-only", "-q"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert re.search(r"^\d+ tests? collected", done.stdout, re.M), done.stdout[-2000:]


def check_bash_script(argv: List[str]) -> None:
    script = ROOT / argv[1]
    assert script.is_file(), f"{argv[1]}: no such script"
    done = run(["bash", "-n", str(script)])
    assert done.returncode == 0, done.stderr


def check_setup_py(argv: List[str], env: dict) -> None:
    """``python setup.py CMD ARGS``: CMD's help runs (nothing is built) and lists each flag."""
    assert len(argv) > 2 and not argv[2].startswith("-"), f"{shlex.join(argv)}: name a setup.py command"
    done = run([sys.executable, "setup.py", argv[2], "--help"], env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for arg in argv[3:]:
        assert not arg.startswith("-") or re.search(rf"(^|[\s,]){re.escape(arg.split('=', 1)[0])}\b",
                                                     done.stdout, re.M), f"setup.py {argv[2]} has no option {arg}"


def check_run_script(argv: List[str]) -> Optional[tuple]:
    """``./run bench|test|setup ARGS``: the script parses; bench's ARGS go to the benchmark's
    parser (returned, to be parsed with the block's others), test's to pytest --collect-only."""
    assert (ROOT / "run").is_file() and os.access(ROOT / "run", os.X_OK), "./run: missing or not executable"
    done = run(["bash", "-n", str(ROOT / "run")])
    assert done.returncode == 0, done.stderr
    assert len(argv) > 1 and argv[1] in ("bench", "test", "setup"), f"{shlex.join(argv)}: no such ./run command"
    if argv[1] == "bench":
        return ("module", "bench", argv[2:])
    if argv[1] == "test":
        check_pytest(["python", "-m", "pytest", *(argv[2:] or ["tests"])])
    else:
        assert argv[2:] == [], f"{shlex.join(argv)}: ./run setup takes no arguments"
    return None


def check_commands(commands: List[List[str]]) -> None:
    """Every command by its rule (see the module docstring); the argparse programs of
    the block are parsed together, in one process."""
    to_parse, launchers = [], []
    for argv in commands:
        env = {}
        while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
            key, _, value = argv[0].partition("=")
            env[key], argv = value, argv[1:]
        argv = {"python3": ["python"], "pytest": ["python", "-m", "pytest"]}.get(argv[0], argv[:1]) + argv[1:]
        if argv[:2] == ["pip", "install"]:
            check_pip_install(argv)
        elif argv[0] == "./run":
            if (parse := check_run_script(argv)):
                to_parse.append(parse)
        elif argv[:2] == ["python", "setup.py"]:
            check_setup_py(argv, env)
        elif argv[:3] == ["python", "-m", "pytest"]:
            check_pytest(argv)
        elif argv[0] == "bash" and len(argv) > 1 and argv[1].endswith(".sh"):
            check_bash_script(argv)
        elif argv[0] == "python":
            to_parse.append(python_target(argv))
        elif console_script_module(argv[0]):
            to_parse.append(("module", console_script_module(argv[0]), argv[1:]))
            if argv[0] == "torchrun":
                launchers.append(len(to_parse) - 1)
        else:
            pytest.fail(f"no rule checks {shlex.join(argv)!r}: add one to tests/test_readme.py")
    parsed = parse_only(to_parse) if to_parse else []
    launched = [("script", parsed[i]["args"]["training_script"], parsed[i]["args"]["training_script_args"])
                for i in launchers]
    for kind, script, _ in launched:
        assert (ROOT / script).is_file(), f"torchrun launches {script}: no such script"
    if launched:
        parse_only(launched)


# ------------------------------------------------------------------ tests ----

def test_every_block_has_a_known_kind():
    assert [b for b in BLOCKS if b.lang in PYTHON_KINDS], "the README has no python block"
    unknown = [b.id for b in BLOCKS if b.lang not in PYTHON_KINDS + SHELL_KINDS + TEXT_KINDS]
    assert not unknown, f"blocks of a kind no rule covers: {unknown}"


def test_a_skip_marker_needs_a_reason():
    text = "intro\n\n<!-- readme-test: skip: needs a GPU and ten minutes -->\n```bash\nrun it\n```\n" \
           "```python\nprint(1)\n```\n"
    skipped, kept = readme_blocks(text)
    assert (skipped.skip, skipped.line, skipped.code) == ("needs a GPU and ten minutes", 4, "run it\n")
    assert (kept.skip, kept.lang, kept.line) == (None, "python", 7)
    for marker in ("<!-- readme-test: skip -->", "<!-- readme-test: skip: slow -->"):
        with pytest.raises(AssertionError, match="must give its reason"):
            readme_blocks(f"{marker}\n```bash\nrun it\n```\n")


@pytest.mark.parametrize("block", [b for b in RUN if b.lang in PYTHON_KINDS], ids=lambda b: b.id)
def test_python_block_runs_as_pasted(block, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(block.code)
    done = run([sys.executable, str(script)], cwd=tmp_path)
    assert done.returncode == 0, f"{block.where}:\n{block.code}\n{done.stderr[-3000:]}"
    assert done.stderr == "", f"{block.where} printed on stderr:\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("block", [b for b in RUN if b.lang in SHELL_KINDS], ids=lambda b: b.id)
def test_bash_block_commands_check(block):
    commands = bash_commands(block.code)
    assert commands, f"{block.where}: empty bash block"
    check_commands(commands)


def test_the_checks_catch_a_bad_flag_a_bad_choice_and_an_unknown_command():
    """The rules fail on what they are meant to catch (their negative controls)."""
    bad_flag, bad_choice, good = parse_results([
        ("script", "examples/char_lm.py", ["--epochs", "1", "--no-such-flag"]),
        ("module", "bench", ["--families", "no-such-family"]),
        ("script", "examples/char_lm.py", ["--cell", "gru", "--epochs", "0"])])[0]
    assert bad_flag["unrecognized"] == ["--no-such-flag"]
    assert bad_choice["error"].startswith("exited with 2")
    assert good["args"]["cell"] == "gru" and good["args"]["epochs"] == 0 and not good["unrecognized"]
    with pytest.raises(AssertionError, match="no option --no-such-option"):
        check_pip_install(["pip", "install", "--no-such-option", "-e", "."])
    with pytest.raises(pytest.fail.Exception, match="no rule checks"):
        check_commands([["make", "everything"]])
    with pytest.raises(AssertionError, match="no such ./run command"):
        check_commands([["./run", "everything"]])
    with pytest.raises(AssertionError, match="unrecognized"):
        check_commands([["./run", "bench", "--no-such-flag"]])
    with pytest.raises(AssertionError, match="has no option --no-such-option"):
        check_setup_py(["python", "setup.py", "build_ext", "--no-such-option"], {"RNNKERN_SKIP_CUDA": "1"})
