"""README.md and docs/*.md: links resolve, code blocks run or parse, commands exist.

The conventions (``<!-- runs -->``, ``<!-- illustrative -->``, which languages are checked how)
are documented in docs/index.md.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
README_LIMIT = 12 * 1024
RUNS_MARK = "<!-- runs -->"
ILLUSTRATIVE_MARK = "<!-- illustrative -->"


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


@dataclasses.dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    mark: str  # the HTML comment on the line before the fence, or ""
    code: str

    @property
    def where(self) -> str:
        return f"{_rel(self.path)}:{self.line}"


_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


def parse_blocks(path: Path, text: str | None = None) -> list[Block]:
    lines = (path.read_text(encoding="utf-8") if text is None else text).split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3).lower(), i
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = prev if prev.startswith("<!--") else ""
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        blocks.append(Block(path, start + 1, lang, mark, textwrap.dedent("\n".join(body)) + "\n"))
        i += 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for p in doc_files() for b in parse_blocks(p)]


def checked_blocks(*langs: str) -> list[Block]:
    return [b for b in all_blocks() if b.lang in langs and b.mark != ILLUSTRATIVE_MARK]


def _ids(block: Block) -> str:
    return block.where


# ---------------------------------------------------------------- links


def strip_code(text: str) -> str:
    """Markdown without fenced blocks and inline code spans (links there are not links)."""
    out, in_fence, fence = [], False, ""
    for line in text.split("\n"):
        m = _FENCE.match(line)
        if m and (not in_fence or line.strip().startswith(fence)):
            in_fence, fence = (not in_fence), m.group(2)
            out.append("")
            continue
        out.append("" if in_fence else re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    raw_lines = path.read_text(encoding="utf-8").split("\n")
    in_fence, fence = False, ""
    for line in raw_lines:
        m = _FENCE.match(line)
        if m and (not in_fence or line.strip().startswith(fence)):
            in_fence, fence = (not in_fence), m.group(2)
            continue
        h = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if in_fence or not h:
            continue
        slug = github_slug(h.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        result.add(slug if n == 0 else f"{slug}-{n}")
    return result


_LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def link_problems(path: Path) -> list[str]:
    problems = []
    for target in _LINK.findall(strip_code(path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{_rel(path)}: link {target!r}: {file_part} does not exist")
            continue
        if fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            problems.append(
                f"{_rel(path)}: link {target!r}: no heading with anchor #{fragment} in "
                f"{_rel(dest)} (anchors: {sorted(anchors(dest))})"
            )
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=_rel)
def test_links_resolve(path):
    assert link_problems(path) == []


def test_readme_size():
    size = (REPO / "README.md").stat().st_size
    assert size <= README_LIMIT, f"README.md is {size} bytes; the front page stays <= {README_LIMIT}"


def test_every_config_option_is_documented():
    from distckpt import CheckpointConfig

    def leaves(cls) -> set[str]:
        names = set()
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            names |= leaves(type(default)) if dataclasses.is_dataclass(default) else {f.name}
        return names

    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    missing = sorted(n for n in leaves(CheckpointConfig) if f"`{n}`" not in text)
    assert missing == [], f"options not named in docs/configuration.md: {missing}"


# ---------------------------------------------------------------- python


@pytest.mark.parametrize("block", checked_blocks("python", "py"), ids=_ids)
def test_python_blocks_compile(block):
    compile(block.code, block.where, "exec")


@pytest.mark.multiprocess
def test_runnable_blocks_run(tmp_path):
    """``<!-- runs -->`` blocks run in a subprocess; the README loop twice, resuming the second time."""
    runnable = [b for b in checked_blocks("python", "py") if b.mark == RUNS_MARK]
    assert any(b.path.name == "README.md" for b in runnable), "the README's training loop lost its <!-- runs -->"
    for block in runnable:
        code = block.code
        first = code
        if "total_steps = 0, 1, 8, 20" in code:  # the README loop: stop early, then resume to the end
            first = code.replace("total_steps = 0, 1, 8, 20", "total_steps = 0, 1, 8, 12")
        script = tmp_path / "blocks.py"
        script.write_text(
            f"exec(compile({first!r}, 'first', 'exec'), {{'__name__': '__main__'}})\n"
            f"exec(compile({code!r}, 'second', 'exec'), {{'__name__': '__main__'}})\n"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        run = subprocess.run(
            [sys.executable, "-W", "ignore", str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, f"{block.where} failed:\n{run.stdout}\n{run.stderr}"
        if first is not code:
            assert run.stdout.split("\n")[:2] == [
                "trained to step 12; resumed from nothing",
                "trained to step 20; resumed from 12",
            ], run.stdout


# ---------------------------------------------------------------- shell


def shell_commands(block: Block) -> list[list[str]]:
    """Each simple command of a shell block as argv (continuations joined, comments dropped)."""
    lines = block.code.split("\n")
    if block.lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    commands = []
    for line in text.split("\n"):
        tokens = shlex.split(line, comments=True)
        current: list[str] = []
        for tok in tokens + [";"]:
            if tok in ("&&", "||", ";", "|"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(tok)
    return commands


def makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    return {m.group(1) for m in re.finditer(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.M)}


def module_source(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin)
    files = sorted(origin.parent.glob("*.py")) if origin.name == "__init__.py" else [origin]
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


def check_command(argv: list[str]) -> str | None:
    """A problem with one documented command, or None."""
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):  # VAR=value cmd
        argv = argv[1:]
    if not argv:
        return None
    prog = Path(argv[0]).name
    if prog in ("export", "cd", "source", "aws", "pip", "echo"):
        return None
    if prog == "make":
        unknown = [t for t in argv[1:] if not t.startswith("-") and "=" not in t and t not in makefile_targets()]
        return f"no Makefile target {unknown}" if unknown else None
    if prog == "distckpt":
        from distckpt._cli.main import build_parser

        try:
            build_parser().parse_args(argv[1:])
        except SystemExit as e:
            return f"the distckpt CLI rejects {argv[1:]} (exit {e.code})"
        return None
    if prog.startswith("python") and argv[1:2] == ["-m"]:
        module = argv[2]
        source = module_source(module)
        if source is None:
            return f"no module {module}"
        bad = [
            t.split("=")[0]
            for t in argv[3:]
            if t.startswith("--") and f'"{t.split("=")[0]}"' not in source and f"'{t.split('=')[0]}'" not in source
        ]
        return f"{module} defines no {bad}" if bad else None
    if prog == "torchrun":
        script = next((i for i, t in enumerate(argv) if t.endswith(".py")), None)
        if script is None:
            return "torchrun without a script"
        if not (REPO / argv[script]).exists():
            return f"no script {argv[script]}"
        args = argv[script + 1 :]
        if argv[script] == "launch/train.py":
            from launch.config import load_job_config

            if "--config" not in args:
                return "launch/train.py needs --config"
            i = args.index("--config")
            overrides = args[:i] + args[i + 2 :]
            try:
                load_job_config(REPO / args[i + 1], overrides)
            except Exception as e:  # noqa: BLE001 - any failure is the doc's problem
                return f"launch/train.py {args}: {e}"
        return None
    return f"unchecked command {argv[0]!r}: add a check or mark the block {ILLUSTRATIVE_MARK}"


@pytest.mark.parametrize("block", checked_blocks("bash", "sh", "shell", "console"), ids=_ids)
def test_shell_commands_exist(block):
    problems = [f"{shlex.join(c)}: {p}" for c in shell_commands(block) if (p := check_command(c))]
    assert problems == [], block.where


def synopsis_problems(block: Block) -> list[str]:
    """A plain block of ``distckpt SUB ARGS  description`` lines: each SUB and ``--flag`` exists."""
    import argparse

    from distckpt._cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    problems = []
    for line in filter(str.strip, block.code.split("\n")):
        words = line.split()
        parser = sub.choices.get(words[1]) if len(words) > 1 else None
        if parser is None:
            problems.append(f"{line}: no subcommand {words[1:2]}")
            continue
        start = 2
        nested = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if nested is not None and len(words) > 2 and words[2] in nested.choices:  # distckpt memory clean ...
            parser, start = nested.choices[words[2]], 3
        args = words[start : words.index("--")] if "--" in words else words[start:]  # after "--": passed through
        flags = {m.group(0) for w in args if (m := re.match(r"--[a-z][\w-]*", w.strip("[];")))}
        known = set(parser._option_string_actions)
        problems += [f"{line}: distckpt {words[1]} has no {f}" for f in sorted(flags - known)]
    return problems


def synopsis_blocks() -> list[Block]:
    return [b for b in checked_blocks("") if all(line.startswith("distckpt ") for line in b.code.strip().split("\n"))]


@pytest.mark.parametrize("block", synopsis_blocks(), ids=_ids)
def test_cli_synopsis(block):
    assert synopsis_problems(block) == []


# ---------------------------------------------------------------- yaml


@pytest.mark.parametrize("block", checked_blocks("yaml", "yml"), ids=_ids)
def test_yaml_blocks_load(block):
    from distckpt import CheckpointConfig

    data = yaml.safe_load(block.code)
    if isinstance(data, dict) and isinstance(data.get("checkpoint"), dict):
        CheckpointConfig.from_dict({"root": "runs/docs-check/ckpt", **data["checkpoint"]})


# ---------------------------------------------------------------- the checks themselves


def test_checks_catch_breakage(tmp_path):
    """A broken link, a bad anchor, a bad flag and an unknown target are each reported."""
    (tmp_path / "other.md").write_text("# Real heading\n")
    page = tmp_path / "page.md"
    page.write_text("[a](missing.md) [b](other.md#no-such) [c](other.md#real-heading) `[d](gone.md)`\n")
    problems = link_problems(page)
    assert len(problems) == 2 and "missing.md" in problems[0] and "#no-such" in problems[1], problems
    assert check_command(["distckpt", "ls", "ROOT", "--no-such-flag"]) is not None
    assert check_command(["distckpt", "ls", "ROOT", "--json"]) is None
    assert check_command(["python", "-m", "launch.demo", "--no-such-flag"]) is not None
    assert check_command(["python", "-m", "launch.demo", "--storage", "s3"]) is None
    assert check_command(["make", "no-such-target"]) is not None
    assert (
        check_command(["torchrun", "launch/train.py", "--config", "launch/configs/ddp.yaml", "train.no_such_key=1"])
        is not None
    )
    blocks = parse_blocks(
        page,
        "<!-- illustrative -->\n```python\n...x...\n```\n```\ndistckpt ls ROOT --jsn   list\ndistckpt lss ROOT\n```\n",
    )
    assert blocks[0].mark == ILLUSTRATIVE_MARK
    assert len(synopsis_problems(blocks[1])) == 2
