"""The documentation's runnable examples, run as a user runs them against ONE real `specray serve`.

Every fenced block of README.md and docs/**/*.md whose previous line is `<!-- runnable -->`
(tests/doc_examples.py extracts them) is one test case, named file:line (the line of its opening fence). The
server is `specray serve --port P` with every other setting at its default (the default model and chain), started
as tests/serve/test_serve_command.py starts one: its own TMPDIR (so its Ray is invisible to the suite's), a free
port, stopped with Ctrl-C and then its process group. Each example's `localhost:8000` becomes `127.0.0.1:P`.

- A ```python block is a self-contained script run by this interpreter (the venv's python, which has `openai`) in
  an empty directory, with no OPENAI_* variables set (an example must pass its own `base_url` and `api_key`); it
  must exit 0 within TIMEOUT_S. The openai client raises on an HTTP error and on an error event in a stream.
- A ```bash block is run by `bash -euo pipefail` within TIMEOUT_S, with `curl` standing for
  `curl -sS --fail-with-body` (no `--fail-with-body` where the block already gives `-f` / `--fail`, which curl
  refuses together with it): an HTTP error status fails the block, as does any failing command. Its standard
  output must then be nothing but the responses: one or more JSON values and / or server-sent-event lines
  (`data: {...}`, `data: [DONE]`), at least one, and no JSON value with an `"error"` key (a stream reports a
  failure after its 200 that way). So a runnable curl block prints the raw response (no `jq -r`, no `-i`, no
  `-w`), and an error example (a 4xx on purpose) is not tagged runnable.
- Every runnable block must address the server as `localhost:8000` (else it would test nothing of ours).

The pages must keep their examples: README.md and docs/api.md each need at least one runnable bash and one
runnable python block, and a malformed tag (tests/doc_examples.py) fails `test_the_tags_are_well_formed` with
its file:line. SPECRAY_DOC_EXAMPLES=a.md:b.md runs the examples of those files instead (then at least one bash and
one python block among them), e.g. to try a page before it lands.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from ..doc_examples import (BASE_HOST, BASH_PRELUDE, ENV_FILES, Example, collect, doc_files, missing_examples,
                            output_problem, with_base_url)
from .test_serve_command import _free_port, _ignore_sigint, _stop

pytestmark = [pytest.mark.serve, pytest.mark.model]

BIN = Path(sys.executable).parent
#: one example's limit (each is a few requests of <= 32 tokens; generous for a loaded 2-core machine)
TIMEOUT_S = 300
#: `specray serve` must print its serving line within this (it loads the model and starts a local Ray)
START_TIMEOUT_S = 480

OVERRIDDEN = bool(os.environ.get(ENV_FILES))
PAGES = doc_files()
EXAMPLES, ERRORS = collect(PAGES)
#: the pages that must keep runnable examples, and of which languages
REQUIRED = {"README.md": ("bash", "python"), "docs/api.md": ("bash", "python")}


def test_the_tags_are_well_formed():
    if ERRORS:
        pytest.fail("malformed runnable tags:\n" + "\n".join(ERRORS), pytrace=False)


def test_the_pages_keep_their_runnable_examples():
    if OVERRIDDEN:
        missing = [f"no runnable ```{lang} block in {ENV_FILES}" for lang in ("bash", "python")
                   if not any(e.language == lang for e in EXAMPLES)]
    else:
        missing = missing_examples(EXAMPLES, REQUIRED)
    if missing:
        pytest.fail("\n".join(missing) + "\n(a runnable block is tagged `<!-- runnable -->` on the line before its "
                    "opening fence)", pytrace=False)


@pytest.fixture(scope="module")
def server():
    """`specray serve --port P`, defaults otherwise; yields "127.0.0.1:P"."""
    tmp = tempfile.mkdtemp(prefix="srd", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"TMPDIR": tmp}
    port = _free_port()
    proc = subprocess.Popen([str(BIN / "specray"), "serve", "--port", str(port)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=_ignore_sigint)
    lines: list[str] = []
    serving = threading.Event()

    def drain() -> None:  # always: a pipe nobody reads fills up and blocks the server
        for line in proc.stdout:
            lines.append(line.rstrip())
            if "specray: serving" in line:
                serving.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        deadline = time.time() + START_TIMEOUT_S
        while not serving.wait(1) and proc.poll() is None and time.time() < deadline:
            pass
        if not serving.is_set() or not _healthy(port, deadline):
            pytest.fail("specray serve did not come up:\n" + "\n".join(lines[-40:]), pytrace=False)
        yield f"127.0.0.1:{port}"
    finally:
        _stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def _healthy(port: int, deadline: float) -> bool:
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def _example_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    no_proxy = ",".join(filter(None, [env.get("NO_PROXY"), "127.0.0.1", "localhost"]))
    return env | {"NO_PROXY": no_proxy, "no_proxy": no_proxy}


def _run(args: list[str], cwd: Path) -> tuple[int | None, str, str]:
    """(exit status or None on timeout, stdout, stderr); a timeout kills the whole process group (curl too)."""
    proc = subprocess.Popen(args, cwd=cwd, env=_example_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def _report(ex: Example, code: str, why: str, out: str = "", err: str = "") -> str:
    return (f"{ex.where}: the runnable ```{ex.language} example {why}\n--- code (as run) ---\n{code.rstrip()}\n"
            f"--- stdout ---\n{out.rstrip()[-6000:]}\n--- stderr ---\n{err.rstrip()[-6000:]}")


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.where for e in EXAMPLES])
def test_the_example_runs(example: Example, server: str, tmp_path: Path):
    if BASE_HOST not in example.code:
        pytest.fail(_report(example, example.code, f"does not address the server as http://{BASE_HOST}"),
                    pytrace=False)
    code = with_base_url(example.code, server)
    if example.language == "python":
        script = tmp_path / "example.py"
        script.write_text(code)
        rc, out, err = _run([sys.executable, str(script)], tmp_path)
    else:
        script = tmp_path / "example.sh"
        script.write_text(BASH_PRELUDE + code)
        rc, out, err = _run(["bash", "-euo", "pipefail", str(script)], tmp_path)
    if rc is None:
        pytest.fail(_report(example, code, f"did not finish within {TIMEOUT_S} s", out, err), pytrace=False)
    if rc != 0:
        pytest.fail(_report(example, code, f"exited with status {rc}", out, err), pytrace=False)
    if example.language == "bash":
        problem = output_problem(out)
        if problem:
            pytest.fail(_report(example, code, f"printed more or less than responses: {problem}", out, err),
                        pytrace=False)
