"""tests/doc_examples.py: which fenced blocks of a Markdown page are runnable examples, and which tags are wrong."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

from ..doc_examples import (BASH_PRELUDE, ENV_FILES, Example, collect, doc_files, extract, missing_examples,
                            output_problem, responses, with_base_url)


def _md(s: str) -> str:
    return textwrap.dedent(s).lstrip("\n")


PAGE = _md('''
    # Quickstart

    <!-- runnable -->
    ```bash
    curl http://localhost:8000/v1/chat/completions \\
      -H "Content-Type: application/json" \\
      -d '{"model": "smollm2-135m", "max_tokens": 8,
           "messages": [{"role": "user", "content": "Hi"}]}'
    ```

    Not tagged:

    ```bash
    specray serve
    ```

    <!-- runnable -->
    ```python
    from openai import OpenAI
    client = OpenAI(base_url="http://localhost:8000/v1", api_key="none")
    ```
''')


def test_tagged_blocks_with_their_line_language_and_code():
    examples, errors = extract(PAGE, "README.md")
    assert errors == []
    assert [(e.where, e.language) for e in examples] == [("README.md:4", "bash"), ("README.md:18", "python")]
    assert examples[0].code == _md('''
        curl http://localhost:8000/v1/chat/completions \\
          -H "Content-Type: application/json" \\
          -d '{"model": "smollm2-135m", "max_tokens": 8,
               "messages": [{"role": "user", "content": "Hi"}]}'
    ''')
    assert examples[1].code.startswith("from openai import OpenAI\n") and examples[1].code.endswith('"none")\n')


def test_a_page_without_tags_has_no_examples():
    assert extract("# Title\n\n```bash\ncurl x\n```\n", "docs/a.md") == ([], [])


def test_a_tag_not_directly_before_a_fence_is_an_error():
    _, errors = extract("intro\n<!-- runnable -->\n\n```bash\ncurl x\n```\n", "docs/api.md")
    assert errors == ["docs/api.md:2: <!-- runnable --> is not directly followed by an opening fence "
                      "(```bash or ```python)"]
    _, errors = extract("text\n<!-- runnable -->", "docs/api.md")  # the last line
    assert [e.split(": ")[0] for e in errors] == ["docs/api.md:2"]


def test_a_tagged_block_in_another_language_is_an_error():
    for info, said in (("sh", "```sh"), ("console", "```console"), ("json", "```json"), ("", "without a language")):
        examples, errors = extract(f"<!-- runnable -->\n```{info}\ncurl x\n```\n", "README.md")
        assert examples == [] and len(errors) == 1, info
        assert errors[0].startswith("README.md:2: a runnable block must be ```bash or ```python") and said in errors[0]


def test_info_string_attributes_and_tilde_fences():
    text = '<!-- runnable -->\n```python title="chat.py"\nprint(1)\n```\n<!-- runnable -->\n~~~~bash\ncurl x\n~~~~\n'
    examples, errors = extract(text, "f.md")
    assert errors == []
    assert [(e.line, e.language, e.code) for e in examples] == [(2, "python", "print(1)\n"), (6, "bash", "curl x\n")]


def test_an_unclosed_or_empty_tagged_block_is_an_error():
    _, errors = extract("<!-- runnable -->\n```bash\ncurl x\n", "f.md")
    assert errors == ["f.md:2: the runnable block is not closed"]
    _, errors = extract("<!-- runnable -->\n```bash\n\n```\n", "f.md")
    assert errors == ["f.md:2: the runnable block is empty"]


def test_a_longer_fence_holds_a_shorter_one():
    text = "<!-- runnable -->\n````python\ns = '''\n```\n'''\nprint(s)\n````\nafter\n"
    examples, errors = extract(text, "f.md")
    assert errors == [] and examples[0].code == "s = '''\n```\n'''\nprint(s)\n"


def test_a_tag_inside_an_untagged_block_is_only_text():
    text = _md('''
        Tag an example like this:

        ````markdown
        <!-- runnable -->
        ```bash
        curl http://localhost:8000/health
        ```
        ````
    ''')
    assert extract(text, "docs/architecture.md") == ([], [])


def test_a_misspelt_tag_is_an_error_but_prose_about_the_tag_is_not():
    _, errors = extract("<!--runnable-->\n```bash\ncurl x\n```\n", "f.md")
    assert errors == ["f.md:1: looks like a runnable tag but is not exactly a line <!-- runnable -->: "
                      "'<!--runnable-->'"]
    _, errors = extract("<!-- runnable: stream -->\n```bash\ncurl x\n```\n", "f.md")
    assert len(errors) == 1 and errors[0].startswith("f.md:1: looks like a runnable tag")
    assert extract("Tag a block with `<!-- runnable -->` on the line before it.\n", "f.md") == ([], [])


def test_an_indented_block_content_tabs():
    """mkdocs-material content tabs indent their blocks: the fence's indentation is removed from the code."""
    text = _md('''
        === "curl"

            <!-- runnable -->
            ```bash
            curl http://localhost:8000/v1/models \\
              -H "Accept: application/json"
            ```
    ''')
    examples, errors = extract(text, "docs/api.md")
    assert errors == []
    assert examples == [Example("docs/api.md", 4, "bash",
                                'curl http://localhost:8000/v1/models \\\n  -H "Accept: application/json"\n')]


def test_errors_do_not_stop_the_other_examples():
    text = "<!-- runnable -->\n```sh\nx\n```\n<!-- runnable -->\n```bash\ncurl y\n```\n"
    examples, errors = extract(text, "f.md")
    assert [e.code for e in examples] == ["curl y\n"] and len(errors) == 1


def test_with_base_url():
    assert with_base_url('curl http://localhost:8000/v1/models', "127.0.0.1:4321") == \
        "curl http://127.0.0.1:4321/v1/models"
    assert with_base_url('OpenAI(base_url="http://localhost:8000/v1")', "127.0.0.1:4321") == \
        'OpenAI(base_url="http://127.0.0.1:4321/v1")'
    assert with_base_url("http://localhost:80001 http://mylocalhost:8000", "h:1") == \
        "http://localhost:80001 http://mylocalhost:8000"


def test_missing_examples():
    ex = [Example("README.md", 3, "bash", "curl x\n"), Example("docs/api.md", 9, "python", "print()\n")]
    required = {"README.md": ("bash", "python"), "docs/api.md": ("bash", "python")}
    assert missing_examples(ex, required) == ["README.md: no runnable ```python block",
                                              "docs/api.md: no runnable ```bash block"]
    assert missing_examples(ex + [Example("README.md", 9, "python", "x\n"), Example("docs/api.md", 2, "bash", "c\n")],
                            required) == []


def test_the_scanned_files_and_their_names(tmp_path, monkeypatch):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "README.md").write_text("<!-- runnable -->\n```bash\ncurl a\n```\n")
    (tmp_path / "docs" / "api.md").write_text("<!-- runnable -->\n```python\nprint()\n```\n")
    (tmp_path / "docs" / "sub" / "x.md").write_text("<!-- runnable -->\n```ruby\nputs 1\n```\n")
    monkeypatch.delenv(ENV_FILES, raising=False)
    files = doc_files(tmp_path)
    assert files == [tmp_path / "README.md", tmp_path / "docs" / "api.md", tmp_path / "docs" / "sub" / "x.md"]
    examples, errors = collect(files, tmp_path)
    assert [e.where for e in examples] == ["README.md:2", "docs/api.md:2"]
    assert errors == ["docs/sub/x.md:2: a runnable block must be ```bash or ```python, not ```ruby"]
    draft = tmp_path / "draft.md"
    monkeypatch.setenv(ENV_FILES, str(draft))
    assert doc_files(tmp_path) == [draft]


def _curl_args(tmp_path, command: str) -> list[str]:
    """The arguments BASH_PRELUDE's `curl` passes on to the real one (a fake curl that prints them)."""
    fake = tmp_path / "bin" / "curl"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", BASH_PRELUDE + command], capture_output=True, text=True,
                         env=os.environ | {"PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}, check=True)
    return out.stdout.splitlines()


def test_the_bash_prelude_makes_curl_fail_on_an_http_error(tmp_path):
    assert _curl_args(tmp_path, "curl http://h/v1/models") == ["-sS", "--fail-with-body", "http://h/v1/models"]
    assert _curl_args(tmp_path, "curl -N http://h -d '{\"stream\": true}'") == \
        ["-sS", "--fail-with-body", "-N", "http://h", "-d", '{"stream": true}']
    # a command that already fails on an HTTP error keeps its own option (curl refuses both together)
    for given in ("-f", "--fail", "--fail-with-body", "-sSf", "-fsS"):
        assert _curl_args(tmp_path, f"curl {given} http://h") == ["-sS", given, "http://h"], given
    # neither a long option nor an option's value with an f in it is taken for -f
    assert _curl_args(tmp_path, "curl --fail-early -H 'x-f: 1' http://h") == \
        ["-sS", "--fail-with-body", "--fail-early", "-H", "x-f: 1", "http://h"]


def test_responses_of_a_curl_block():
    chat = '{"id": "c1", "choices": [{"message": {"content": "Blue"}}]}'
    assert responses(chat + "\n") == [json.loads(chat)]
    assert responses('{"a": 1}{"b": 2}\n{\n  "c": [3]\n}\n') == [{"a": 1}, {"b": 2}, {"c": [3]}]  # several curls
    sse = 'data: {"choices": [{"delta": {"content": "B"}}]}\n\ndata: {"choices": []}\n\ndata: [DONE]\n\n'
    assert responses(sse) == [{"choices": [{"delta": {"content": "B"}}]}, {"choices": []}]
    assert responses(chat + "\n" + sse) == [json.loads(chat), {"choices": [{"delta": {"content": "B"}}]},
                                            {"choices": []}]
    assert responses(": keep-alive\nevent: x\ndata:{\"a\":1}\n") == [{"a": 1}]
    assert output_problem(chat) is None and output_problem(sse) is None


def test_what_a_curl_block_may_not_print():
    assert output_problem("") == "it printed no response"
    assert output_problem("data: [DONE]\n") == "it printed no response"
    err = ('{"error": {"message": "unknown field", "type": "invalid_request_error", "param": "speculative", '
           '"code": null}}')
    assert output_problem(err).startswith("a response is an error: {\"error\"")
    assert output_problem('data: {"choices": []}\n\n' + "data: " + err + "\n\ndata: [DONE]\n").startswith(
        "a response is an error")  # a stream's failure after its 200
    assert output_problem("HTTP/1.1 200 OK\ncontent-type: application/json\n\n{}").startswith("not JSON")  # curl -i
    assert output_problem("Blue\n").startswith("not JSON")  # jq -r
    assert output_problem("data: Blue\n").startswith("a server-sent event whose data is not JSON")
