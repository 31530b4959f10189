"""README.md and docs/ stay true to the tree: README is the short front door (≤ 350 lines, with a table of
contents), every relative link and image points at a file (and heading) that exists, and every command in a
```bash block that runs a repo file or picks a config option names one that exists. Fast: reads text only."""

from __future__ import annotations

import functools
import glob
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 350
# one file per topic (issue 23 item 6); README links every page of docs/
TOPICS = ("architecture", "model", "cache", "engine", "sampling", "dspark", "yoco", "parallel", "hopper-kernels",
          "serving", "failure-behaviour", "benchmarks", "status")
PARETO_PNG = "benchmarks/results/decode_gpu_h200.png"

FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
# [text](target "title") and ![alt](target); link text may hold one level of brackets
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# a path that is an example or made at run time, not a file of the repo
PLACEHOLDER = ("$", "outputs/", "/tmp", "...", "<", "~", "/", "..")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def split_blocks(text: str):
    """(prose lines with their numbers, [(info string, first line number, lines)] of fenced blocks)."""
    prose, blocks, fence, info, start, body = [], [], None, "", 0, []
    for n, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line.lstrip())
        if fence is None and m:
            fence, info, start, body = m.group(1), m.group(2).lower(), n + 1, []
        elif fence is not None and line.lstrip().startswith(fence[0] * len(fence)) and not line.strip(fence[0]).strip():
            blocks.append((info, start, body))
            fence = None
        elif fence is not None:
            body.append(line)
        else:
            prose.append((n, line))
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not - or _), spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    prose, _ = split_blocks(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose:
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.add(base if k == 0 else f"{base}-{k}")
    return frozenset(out)


def links(path: Path, text: str | None = None):
    """(line number, target) of every Markdown link, image and reference definition outside code."""
    prose, _ = split_blocks(path.read_text() if text is None else text)
    for n, line in prose:
        bare = CODE_SPAN.sub("", line)
        for m in LINK.finditer(bare):
            yield n, m.group(1)
        m = REF_DEF.match(bare)
        if m:
            yield n, m.group(1)


def link_problems(path: Path, text: str | None = None) -> list[str]:
    problems = []
    for n, target in links(path, text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{rel(path)}:{n}: link '{target}'"
        if not dest.exists():
            problems.append(f"{where} -> no such file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where} -> no heading with anchor #{anchor} in {rel(dest)}")
    return problems


def bash_commands(path: Path, text: str | None = None):
    """(line number, argv) of every simple command in the file's ```bash blocks (comments dropped)."""
    _, blocks = split_blocks(path.read_text() if text is None else text)
    for info, start, body in blocks:
        if info not in ("bash", "sh", "shell"):
            continue
        joined, first = "", None
        for i, line in enumerate(body):
            if first is None:
                first = start + i
            if line.rstrip().endswith("\\"):
                joined += line.rstrip()[:-1] + " "
                continue
            joined += line
            lexer = shlex.shlex(joined, posix=True, punctuation_chars=";&|()")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            try:
                tokens = list(lexer)
            except ValueError as e:  # an unclosed quote: a multi-line argument (curl -d '{...}') goes on
                if "quotation" in str(e):
                    joined += "\n"
                    continue
                raise
            cmd: list[str] = []
            for tok in tokens + [";"]:
                if tok and set(tok) <= set(";&|()"):
                    if cmd:
                        yield first, cmd
                    cmd = []
                else:
                    cmd.append(tok)
            joined, first = "", None


def is_placeholder(p: str) -> bool:
    return p.startswith(PLACEHOLDER) or "$" in p


def missing_path(p: str) -> bool:
    p = p.split("::", 1)[0]
    if any(ch in p for ch in "*?["):
        return not glob.glob(str(ROOT / p))
    return not (ROOT / p).exists()


def command_problems(path: Path, text: str | None = None) -> list[str]:
    groups = {d.name for d in (ROOT / "conf").iterdir() if d.is_dir() and not d.name.startswith("_")}
    problems = []
    for n, argv in bash_commands(path, text):
        where = f"{rel(path)}:{n}: `{' '.join(argv)}`"
        while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):  # VAR=value cmd
            argv = argv[1:]
        if not argv:
            continue
        prog, args = argv[0], argv[1:]
        files: list[str] = []
        if re.fullmatch(r"python(3(\.\d+)?)?", prog) and args:
            if args[0] == "-m" and len(args) > 1 and args[1] == "pytest":
                files = [a for a in args[2:] if not a.startswith("-") and ("/" in a or a.endswith(".py"))]
            elif not args[0].startswith("-"):
                files = [args[0]]
        elif prog in ("bash", "sh", "source", ".") and args and not args[0].startswith("-"):
            files = [args[0]]
        elif "/" in prog:  # runs a file directly: .ci/run
            files = [prog]
        for f in files:
            if not is_placeholder(f) and missing_path(f):
                problems.append(f"{where} runs {f}, which does not exist")
        # python -m deepinfer / torchrun ... -m deepinfer: every group=option must name a config file
        if "-m" in argv and argv.index("-m") + 1 < len(argv) and argv[argv.index("-m") + 1] == "deepinfer":
            overrides = argv[argv.index("-m") + 2:]
            own_search_path = any(a == "--config-dir" or a.startswith(("--config-dir=", "hydra.searchpath="))
                                  for a in overrides)
            for a in overrides:
                if a.startswith("-") or "=" not in a:
                    continue
                key, value = a.split("=", 1)
                plus = key.startswith("+")
                key = key.lstrip("+~")
                if key == "recipe" and plus:
                    for opt in value.split(","):
                        if not (ROOT / "recipes" / f"{opt}.yaml").exists() and not own_search_path:
                            problems.append(f"{where}: +recipe={opt} has no recipes/{opt}.yaml")
                elif key in groups:
                    for opt in value.split(","):
                        if not (ROOT / "conf" / key / f"{opt}.yaml").exists():
                            problems.append(f"{where}: {key}={opt} has no conf/{key}/{opt}.yaml")
    return problems


def test_readme_is_short_and_has_a_table_of_contents():
    text = README.read_text()
    lines = text.rstrip("\n").split("\n")
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines; at most {MAX_README_LINES}: move the detail to a docs/ page")
    prose, _ = split_blocks(text)
    h2 = [(n, m.group(2)) for n, line in prose if (m := HEADING.match(line)) and len(m.group(1)) == 2]
    toc = [(n, t) for n, t in h2 if t.strip().lower() in ("contents", "table of contents")]
    assert toc, "README.md has no '## Contents' (table of contents) section"
    toc_line = toc[0][0]
    end = next((n for n, _ in h2 if n > toc_line), len(lines) + 1)
    toc_targets = {t for n, t in links(README) if toc_line < n < end}
    missing = [t for _, t in h2 if t.strip().lower() not in ("contents", "table of contents")
               and f"#{slug(t)}" not in toc_targets]
    assert not missing, f"README.md's table of contents does not link these sections: {missing}"


def test_docs_has_one_page_per_topic_and_readme_links_every_page():
    missing = [t for t in TOPICS if not (DOCS / f"{t}.md").exists()]
    assert not missing, f"docs/ lacks the topic pages {missing}"
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in links(README)}
    orphans = [rel(p) for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not orphans, f"README.md does not link {orphans}"


def test_decode_pareto_plot_is_embedded():
    """Where a reader looks for performance: README, or docs/benchmarks.md, shows the decode Pareto plot."""
    image = re.compile(r"!\[[^\]]*\]\((?:\.\./)?" + re.escape(PARETO_PNG) + r"\)")
    shown = [rel(p) for p in (README, DOCS / "benchmarks.md") if image.search(CODE_SPAN.sub("", p.read_text()))]
    assert shown, f"the decode Pareto plot {PARETO_PNG} is embedded neither in README.md nor in docs/benchmarks.md"
    assert (ROOT / PARETO_PNG).exists()


@pytest.mark.parametrize("page", pages(), ids=rel)
def test_relative_links_and_images_exist(page):
    problems = link_problems(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", pages(), ids=rel)
def test_bash_commands_name_existing_files_and_config_options(page):
    problems = command_problems(page)
    assert not problems, "commands that cannot run as written:\n" + "\n".join(problems)


def test_the_checks_catch_what_they_are_for():
    """The link and command checks fail on a broken link, a missing anchor, a missing script and a missing option."""
    page = DOCS / "_probe.md"  # read as if it were a page of docs/; nothing is written
    text = ("# Probe\n\n[gone](no_such_page.md) [ok](status.md) [bad anchor](status.md#no-such-heading)\n"
            "![img](../benchmarks/results/no_such.png) `[in code](nothing.md)`\n\n"
            "```bash\npython benchmarks/no_such_bench.py --out $OUT/x.json   # comment [x](y.md)\n"
            "python -m deepinfer model=no_such_model model.path=/x +recipe=no_such_recipe input_path=outputs/a\n"
            "python -m pytest -q tests/test_no_such_file.py\n"
            "python -m deepinfer --config-dir myrecipes +recipe=my_site\n```\n")
    problems = link_problems(page, text)
    assert [p.split("link ")[1].split(" ->")[0] for p in problems] == [
        "'no_such_page.md'", "'status.md#no-such-heading'", "'../benchmarks/results/no_such.png'"], problems
    commands = command_problems(page, text)
    assert len(commands) == 4, commands
    joined = "\n".join(commands)
    for needle in ("benchmarks/no_such_bench.py", "conf/model/no_such_model.yaml", "recipes/no_such_recipe.yaml",
                   "tests/test_no_such_file.py"):
        assert needle in joined, (needle, commands)


def test_every_row_of_readmes_api_parity_table_names_a_test_that_exists():
    """README's parity table (issue 24): each row names the test that exercises it with a client."""
    rows = [line for line in README.read_text().splitlines()
            if line.startswith("| `") and line.rstrip().endswith("` |") and "::test_" in line]
    assert len(rows) >= 15, "README.md's API parity table is missing"
    for row in rows:
        ref = row.rstrip(" |").rsplit("`", 2)[-2]  # the last cell: `file::test`
        path, name = ref.split("::")
        source = (ROOT / "tests" / path).read_text()
        assert re.search(rf"^(async )?def {name}\(", source, re.M), f"README's parity row names a missing test: {ref}"
