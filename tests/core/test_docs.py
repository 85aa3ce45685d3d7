"""README.md stays a short front door and the pages under docs/ stay readable (issue 45).

Checked here:

- README.md has at most 300 lines.
- README.md links every docs/*.md page.
- Every relative link in README.md and docs/*.md points at a file or folder that exists.
- The prose of README.md and of each docs/*.md averages at most 25 words a sentence.

How sentences are counted (`sentence_lengths`):

- Lines inside ``` fences are code, not prose: they are skipped.
- Table rows (a line starting with '|') and headings (a line starting with '#') are skipped.
- The remaining lines form units: a blank line, a skipped line or a list item's first line
  (starting with '-', '*', '+' or '1.') ends the unit before it. So a list item ends a
  sentence even when it has no full stop.
- A unit's lines are joined with spaces and split into sentences after '.', '!' or '?' followed
  by whitespace. Closing marks right after the stop (')', '"', "'", ']', '*', '_', '`') stay
  with the sentence. The end of the unit ends its last sentence.
- A word is a whitespace-separated token; a list marker is not a word.
- The average is all words over all sentences.

An abbreviation such as "e.g. " ends a sentence under this rule. That makes the average a
little lower than a careful reader's count, so the pages should not lean on it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 300
MAX_WORDS_PER_SENTENCE = 25

_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
_SENTENCE_END = re.compile(r"(?<=[.!?])[)\"'\]*_`]*\s+")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_units(text: str) -> list[str]:
    """The prose of a Markdown text as units (paragraphs and list items), code and tables out."""
    units: list[str] = []
    current: list[str] = []
    in_fence = False

    def close() -> None:
        if current:
            units.append(" ".join(current))
            current.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            close()
            in_fence = not in_fence
            continue
        if in_fence or not stripped or stripped.startswith(("|", "#")):
            close()
            continue
        item = _ITEM.match(line)
        if item:
            close()
            stripped = line[item.end() :].strip()
        current.append(stripped)
    close()
    return units


def sentence_lengths(text: str) -> list[int]:
    """Words per sentence of the prose in `text` (the rules are in the module docstring)."""
    lengths = []
    for unit in prose_units(text):
        for sentence in _SENTENCE_END.split(unit):
            words = len(sentence.split())
            if words:
                lengths.append(words)
    return lengths


def average_sentence_length(text: str) -> float:
    lengths = sentence_lengths(text)
    return sum(lengths) / len(lengths) if lengths else 0.0


def relative_links(text: str) -> list[str]:
    """Link targets outside code fences that name a path (no scheme, not a bare #anchor)."""
    targets = []
    in_fence = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for target in _LINK.findall(line):
            if target.startswith("#") or _SCHEME.match(target):
                continue
            targets.append(target.split("#", 1)[0])
    return targets


def test_the_counter_on_a_known_sample():
    sample = (
        "One two three. Four five!\n"
        "Six seven eight nine\n"
        "ten? (Eleven twelve.) Thirteen\n"
        "\n"
        "- a list item without a stop\n"
        "- two\n"
        "  continued here.\n"
        "\n"
        "```\n"
        "code. is. not. counted.\n"
        "```\n"
        "| a table. row | is | skipped |\n"
        "# A heading is skipped too.\n"
        "Last one.\n"
    )
    # one two three | four five | six ... ten? | (eleven twelve.) | thirteen
    # a list item without a stop | two continued here. | last one.
    assert sentence_lengths(sample) == [3, 2, 5, 2, 1, 6, 3, 2]
    assert average_sentence_length(sample) == 24 / 8


def test_the_limit_can_fail():
    long = " ".join(["word"] * 40) + ". Short one.\n"
    assert sentence_lengths(long) == [40, 2]
    assert average_sentence_length(long) == 21.0
    longer = " ".join(["word"] * 60) + ". Short one.\n"
    assert average_sentence_length(longer) > MAX_WORDS_PER_SENTENCE


def test_links_are_found_and_filtered():
    text = (
        "[a](docs/x.md) ![img](docs/p.png) [web](https://example.com) [here](#anchor)\n"
        "[b](ARCHITECTURE.md#the-map)\n```\n[c](not/a/link.md)\n```\n"
    )
    assert relative_links(text) == ["docs/x.md", "docs/p.png", "ARCHITECTURE.md"]


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


def test_readme_links_every_docs_page():
    assert DOCS, "docs/ has no .md page"
    linked = {(ROOT / t).resolve() for t in relative_links(README.read_text())}
    missing = [p.name for p in DOCS if p.resolve() not in linked]
    assert missing == [], f"README.md does not link {missing}"


def test_every_relative_link_points_at_a_file():
    broken = []
    for page in [README, *DOCS]:
        for target in relative_links(page.read_text()):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_sentences_are_short():
    too_long = {}
    for page in [README, *DOCS]:
        average = average_sentence_length(page.read_text())
        if average > MAX_WORDS_PER_SENTENCE:
            too_long[str(page.relative_to(ROOT))] = round(average, 1)
    assert too_long == {}, f"average words per sentence above {MAX_WORDS_PER_SENTENCE}"


# A repository path named in code: a top-level folder of the repository and a file under it, or
# one of the top-level documents. Placeholders (RUN/..., NAME.yaml) are not paths.
_CODE_REF = re.compile(
    r"(?<![\w./-])((?:codex|pipeline|model|train|eval|configs|tests|bench|docs|\.ci)/[\w./-]*"
    r"\.(?:py|md|yaml|c|json|toml)|(?:NOTES|README|ARCHITECTURE)\.md)\b"
)


def code_references(path: Path) -> list[tuple[int, str]]:
    """(line, path) of every repository file a comment or string of `path` names."""
    import io
    import tokenize

    found = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            for ref in _CODE_REF.findall(tok.string):
                if not re.search(r"(^|/)[A-Z_]+[./]", ref) or ref.endswith(".md"):
                    found.append((tok.start[0], ref))
    return found


def test_code_names_only_files_that_exist():
    """A comment or docstring that names a file of the repository names one that exists."""
    sources = [
        p
        for d in ("codex/cli", "codex/core", "pipeline", "model", "train", "eval", "bench", "tests")
        for p in (ROOT / d).rglob("*.py")
        if p.name != "test_docs.py"  # its own examples
    ]
    missing = [
        f"{p.relative_to(ROOT)}:{line}: {ref}"
        for p in sources
        for line, ref in code_references(p)
        if not (ROOT / ref).exists()
    ]
    assert not missing, missing


def test_the_code_reference_check_can_fail(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""See NOTES.md and train/plan/hardware.py; RUN/eval/step_N.json."""\n')
    assert [ref for _, ref in code_references(f)] == ["NOTES.md", "train/plan/hardware.py"]
