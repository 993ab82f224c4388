"""The documentation's runnable examples, read from the Markdown itself (no server, no specray import).

A fenced block is runnable when the line directly before its opening fence is the HTML comment
`<!-- runnable -->` (invisible on the rendered page). Only ```bash blocks (curl calls) and ```python blocks
(scripts using the `openai` client) may be tagged; they address the server as `http://localhost:8000`.
tests/serve/test_doc_examples.py runs each one against a real `specray serve`.

    >>> text = 'Ask:\\n<!-- runnable -->\\n```bash\\ncurl http://localhost:8000/health\\n```\\n'
    >>> examples, errors = extract(text, "README.md")
    >>> examples[0].where, examples[0].language, examples[0].code, errors
    ('README.md:3', 'bash', 'curl http://localhost:8000/health\\n', [])

A tag in front of anything but a fence, a tagged block in another language, an unclosed tagged block or a
comment line that looks like the tag but is not exactly it is an error naming its file:line. Fences are tracked for
every block, so a tag shown inside an untagged code block (a page explaining the convention) is only text.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

TAG = "<!-- runnable -->"
LANGUAGES = ("bash", "python")
#: how the examples address the server; the test replaces it with its own server's address
BASE_HOST = "localhost:8000"
#: os.pathsep-separated Markdown files to scan instead of the repository's pages (to try the test on a draft)
ENV_FILES = "SPECRAY_DOC_EXAMPLES"

REPO = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_TAG_LIKE = re.compile(r"^\s*<!--\s*runnable\b", re.IGNORECASE)  # a comment line, not the tag in prose


@dataclass(frozen=True)
class Example:
    file: str  # as given (relative to the repository for its own pages)
    line: int  # 1-based line of the opening fence; the code starts on the next line
    language: str  # "bash" or "python"
    code: str  # the block's lines, its fence's indentation removed, each ending in a newline

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _opening_fence(line: str) -> tuple[str, str, str] | None:
    """(indent, fence, info string) of a line that opens a fenced block, else None."""
    m = _FENCE.match(line)
    if m is None:
        return None
    if m["fence"][0] == "`" and "`" in m["info"]:
        return None  # CommonMark: a backtick fence's info string has no backtick (that is inline code)
    return m["indent"], m["fence"], m["info"].strip()


def _closes(line: str, fence: str) -> bool:
    s = line.strip()
    return len(s) >= len(fence) and set(s) == {fence[0]}


def _dedent(line: str, indent: str) -> str:
    n = len(indent)
    head = len(line) - len(line.lstrip(" \t"))
    return line[min(n, head):]


def extract(text: str, file: str) -> tuple[list[Example], list[str]]:
    """The tagged blocks of one Markdown text, and the errors ("file:line: why"), in order."""
    lines = text.splitlines()
    examples: list[Example] = []
    errors: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        opened = _opening_fence(line)
        if opened is not None:  # an untagged block: skip it whole (a tag shown inside it is only text)
            i = _end_of_block(lines, i, opened[1])
            continue
        if line.strip() == TAG:
            nxt = lines[i + 1] if i + 1 < len(lines) else None
            opened = _opening_fence(nxt) if nxt is not None else None
            if opened is None:
                errors.append(f"{file}:{i + 1}: {TAG} is not directly followed by an opening fence "
                              "(```bash or ```python)")
                i += 1
                continue
            indent, fence, info = opened
            language = info.split()[0].lstrip("{.").rstrip("}").lower() if info else ""
            end = _end_of_block(lines, i + 1, fence)
            if end > len(lines):
                errors.append(f"{file}:{i + 2}: the runnable block is not closed")
            elif language not in LANGUAGES:
                errors.append(f"{file}:{i + 2}: a runnable block must be ```bash or ```python, not "
                              f"{'```' + info if info else 'a block without a language'}")
            else:
                code = "".join(_dedent(ln, indent) + "\n" for ln in lines[i + 2:end - 1])
                if not code.strip():
                    errors.append(f"{file}:{i + 2}: the runnable block is empty")
                else:
                    examples.append(Example(file, i + 2, language, code))
            i = end
            continue
        if _TAG_LIKE.match(line):
            errors.append(f"{file}:{i + 1}: looks like a runnable tag but is not exactly a line {TAG}: "
                          f"{line.strip()!r}")
        i += 1
    return examples, errors


def _end_of_block(lines: list[str], start: int, fence: str) -> int:
    """Index just past the block that opens at lines[start] (past the end of the text if it is not closed)."""
    for j in range(start + 1, len(lines)):
        if _closes(lines[j], fence):
            return j + 1
    return len(lines) + 1


def doc_files(root: Path = REPO) -> list[Path]:
    """The pages scanned: $SPECRAY_DOC_EXAMPLES if set, else README.md and every docs/**/*.md."""
    override = os.environ.get(ENV_FILES)
    if override:
        return [Path(p) for p in override.split(os.pathsep) if p]
    return [p for p in [root / "README.md", *sorted((root / "docs").rglob("*.md"))] if p.exists()]


def display_name(path: Path, root: Path = REPO) -> str:
    try:
        return path.resolve().relative_to(root).as_posix()
    except ValueError:
        return str(path)


def collect(paths: list[Path], root: Path = REPO) -> tuple[list[Example], list[str]]:
    """Every tagged block of these pages, and every error, in page order."""
    examples: list[Example] = []
    errors: list[str] = []
    for path in paths:
        name = display_name(path, root)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            errors.append(f"{name}: cannot read: {e}")
            continue
        ex, err = extract(text, name)
        examples += ex
        errors += err
    return examples, errors


def with_base_url(code: str, host_port: str) -> str:
    """The example addressed to host_port ("127.0.0.1:PORT") instead of localhost:8000."""
    return re.sub(r"(?<![\w.-])localhost:8000(?!\d)", host_port, code)


def missing_examples(examples: list[Example], required: dict[str, tuple[str, ...]]) -> list[str]:
    """What `required` ({file: languages each needing at least one tagged block}) finds missing."""
    have = {(e.file, e.language) for e in examples}
    return [f"{file}: no runnable ```{lang} block" for file, langs in required.items() for lang in langs
            if (file, lang) not in have]


#: put before a bash block's code: `curl` is `curl -sS --fail-with-body`, or `curl -sS` where the command already
#: gives -f / --fail / --fail-with-body (curl refuses --fail with --fail-with-body)
BASH_PRELUDE = r'''curl() {
  local a fail=
  for a in "$@"; do
    case "$a" in
      --fail|--fail-with-body) fail=1 ;;
      --*) ;;
      -*f*) if [[ "$a" =~ ^-[A-Za-z]+$ ]]; then fail=1; fi ;;
    esac
  done
  if [[ -n "$fail" ]]; then command curl -sS "$@"; else command curl -sS --fail-with-body "$@"; fi
}
'''


def responses(out: str) -> list:
    """The JSON values and server-sent events' data of a curl block's output, in order (`[DONE]` left out).
    Raises ValueError where the output is anything else."""
    decoder = json.JSONDecoder()
    values: list = []
    i, n = 0, len(out)
    while True:
        while i < n and out[i].isspace():
            i += 1
        if i == n:
            return values
        if out.startswith(("data:", "event:", "id:", "retry:", ":"), i):
            end = out.find("\n", i)
            end = n if end < 0 else end
            line = out[i:end]
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                try:
                    values.append(json.loads(line[5:]))
                except ValueError as e:
                    raise ValueError(f"a server-sent event whose data is not JSON: {line!r} ({e})") from None
            i = end
            continue
        try:
            value, i = decoder.raw_decode(out, i)
        except ValueError as e:
            raise ValueError(f"not JSON or server-sent events at character {i}: {out[i:i + 80]!r} ({e})") from None
        values.append(value)


def output_problem(out: str) -> str | None:
    """Why a curl block's standard output is not a clean set of responses, or None."""
    try:
        values = responses(out)
    except ValueError as e:
        return str(e)
    if not values:
        return "it printed no response"
    errors = [v for v in values if isinstance(v, dict) and "error" in v]
    if errors:
        return f"a response is an error: {json.dumps(errors[0])}"
    return None
