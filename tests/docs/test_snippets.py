"""Every code block of the README and of docs/ runs, as its page's comments say.

One test per page runs that page's blocks in order (``tests/docs/snippets.py`` has the
convention); the other tests check the parser and the runner on crafted pages.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from phalanx.testing import scaled
from tests.docs import snippets
from tests.docs.snippets import Block, SnippetError, parse, run_page

PAGES = snippets.pages()


def check_page(page: Path, deadline: float = snippets.DEADLINE_S) -> list[snippets.Outcome]:
    """Run ``page``'s blocks; fail with each failed block's output."""
    outcomes = run_page(page, deadline=scaled(deadline))
    report = snippets.failures(outcomes)
    if report:
        pytest.fail(f"{snippets.display(page)}: a block failed\n{report}", pytrace=False)
    return outcomes


@pytest.mark.parametrize("page", PAGES, ids=[snippets.display(p) for p in PAGES])
def test_every_block_of_the_page_runs(page: Path) -> None:
    check_page(page)


def test_every_block_is_run_or_says_why_not() -> None:
    """Every page parses (a language on every fence, known comments, ``tested-by:`` tests that
    exist and name the block's files), and every block that is not run gives its reason; the
    list of them is printed."""
    errors, skipped = [], []
    for page in PAGES:
        try:
            blocks = snippets.parse_page(page)
        except SnippetError as e:
            errors.append(str(e))
            continue
        skipped += [b for b in blocks if b.action == "not-run"]
    assert not errors, "\n".join(errors)
    assert all(b.not_run and b.not_run.strip() for b in skipped)
    print(f"{len(skipped)} blocks not run:")
    for b in skipped:
        print(f"  {b.where}: {b.not_run}")


def test_tested_by_names_a_real_test_that_runs_the_blocks_files(tmp_path: Path) -> None:
    good = "tests/e2e/test_examples.py::test_p2p_pingpong"
    code = "phalanx run --standalone --nproc-per-node 2 examples/p2p_pingpong.py\n"
    page = write(tmp_path, f"<!-- tested-by: {good} -->\n```bash\n{code}```\n")
    (outcome,) = snippets.run_page(page)
    assert outcome.status == "tested-by" and outcome.ok
    wrong = [
        ("tests/e2e/test_examples.py::test_no_such_test", code, "has no test named"),
        ("tests/e2e/nothing.py::test_x", code, "is not tests/FILE.py::test_name"),
        ("tests/e2e/test_examples.py", code, "is not tests/FILE.py::test_name"),
        (good, "python examples/hogwild_digits.py\n", "never names"),
    ]
    for target, body, needle in wrong:
        page = write(tmp_path, f"<!-- tested-by: {target} -->\n```bash\n{body}```\n")
        with pytest.raises(SnippetError, match=needle):
            snippets.run_page(page)


# ---- the parser ---------------------------------------------------------------------------------
PAGE = Path("page.md")


def one(text: str) -> Block:
    (block,) = parse(text, PAGE)
    return block


def test_languages_decide_what_runs() -> None:
    text = "\n".join(
        f"```{lang}\nx\n```" for lang in ("python", "bash", "text", "console-output", "toml")
    )
    assert [b.action for b in parse(text, PAGE)] == ["run", "run", "shown", "shown", "shown"]
    assert one('```python title="train.py"\nprint(1)\n```').lang == "python"


def test_a_python_block_runs_with_python_and_a_bash_block_with_strict_bash() -> None:
    assert one("```python\nprint(1)\n```").command() == ["python", "snippet_1.py"]
    assert one("x\n\n```bash\ntrue\n```").command() == ["bash", "-euo", "pipefail", "snippet_3.sh"]


def test_comments_on_the_line_before_the_fence() -> None:
    run = one("<!-- run: phalanx run --standalone --nproc-per-node 2 -->\n```python\n1\n```")
    assert run.action == "run"
    assert run.command() == [
        "bash",
        "-c",
        "phalanx run --standalone --nproc-per-node 2 snippet_2.py",
    ]
    saved = one("<!-- save: train.py -->\n```python\n1\n```")
    assert (saved.action, saved.filename) == ("saved", "train.py")
    both = one("<!--save: t.py;run: phalanx run --standalone -->\n```python\n1\n```")
    assert both.action == "run" and both.command()[-1] == "phalanx run --standalone t.py"
    skipped = one("<!-- not-run: needs a second machine; not here -->\n```bash\nx\n```")
    assert (skipped.action, skipped.not_run) == ("not-run", "needs a second machine; not here")
    failing = one("<!-- expect-exit: 3 -->\n```bash\nexit 3\n```")
    assert failing.expect_exit == 3
    toml = one("<!-- save: job.toml -->\n```toml\na = 1\n```")
    assert (toml.action, toml.filename) == ("saved", "job.toml")


def test_an_ordinary_comment_further_up_does_not_apply() -> None:
    assert one("<!-- an ordinary comment -->\n\ntext\n```bash\nx\n```").action == "run"


def test_nested_fences_and_fences_in_lists() -> None:
    text = "````text\n```python\nnot a block\n```\n````\n~~~python\n```\nx = 1\n~~~\n"
    outer, tilde = parse(text, PAGE)
    assert outer.lang == "text" and outer.code == "```python\nnot a block\n```\n"
    assert tilde.code == "```\nx = 1\n" and tilde.line == 6
    listed = one(
        "1. Save it:\n\n   <!-- save: a.py -->\n   ```python\n   if True:\n       x = 1\n   ```\n"
    )
    assert (listed.save, listed.code, listed.line) == ("a.py", "if True:\n    x = 1\n", 4)
    tabbed = one('=== "Tab"\n\n    ```bash\n    echo hi\n    ```\n')
    assert tabbed.code == "echo hi\n"


def test_an_included_file_is_run() -> None:
    block = one('```python\n--8<-- "examples/quickstart.py"\n```')
    assert block.code == (snippets.ROOT / "examples" / "quickstart.py").read_text()


@pytest.mark.parametrize(
    ("text", "line", "says"),
    [
        ("intro\n```\nx\n```", 2, "without a language tag"),
        ("```pycon\n>>> 1\n```", 1, "unknown language 'pycon'"),
        ("a\n<!-- skip -->\n```bash\nx\n```", 3, "unknown comment"),
        ("<!-- not-run: -->\n```bash\nx\n```", 2, "needs a value"),
        ("<!-- not-run -->\n```bash\nx\n```", 2, "needs a value"),
        ("<!-- run: phalanx run -->\n```bash\nx\n```", 2, "run: is for python blocks"),
        ("<!-- expect-exit: one -->\n```bash\nx\n```", 2, "not an integer"),
        ("<!-- not-run: a; expect-exit: 1 -->\n```bash\nx\n```", 2, "contradicts"),
        ("<!-- save: ../x.py -->\n```python\nx\n```", 2, "relative name"),
        ("<!-- not-run: output -->\n```text\nx\n```", 2, "never run"),
        ("<!-- run: python -->\n\n```python\nx\n```", 1, "just before a fence"),
        ("text\n> ```python\n> x\n> ```", 2, "block quote"),
        ("ok\n\n```python\nx\n", 3, "never closed"),
    ],
)
def test_errors_name_the_file_and_line(text: str, line: int, says: str) -> None:
    with pytest.raises(SnippetError) as error:
        parse(text, Path("/elsewhere/page.md"))
    assert f"/elsewhere/page.md:{line}: " in str(error.value)
    assert says in str(error.value)


def test_every_error_of_a_page_is_named() -> None:
    with pytest.raises(SnippetError) as error:
        parse("```\nx\n```\n\n```perl\nx\n```", PAGE)
    assert "page.md:1: " in str(error.value) and "page.md:5: " in str(error.value)


# ---- the runner ---------------------------------------------------------------------------------
def write(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


def test_blocks_of_a_page_share_a_directory_with_examples_and_phalanx(tmp_path: Path) -> None:
    page = write(
        tmp_path,
        "```python\n"
        "import pathlib, phalanx\n"
        "assert pathlib.Path('examples/quickstart.py').is_file()\n"
        "assert pathlib.Path('benchmarks').is_dir()\n"
        "pathlib.Path('made.txt').write_text('made')\n"
        "```\n"
        "<!-- save: hello.py -->\n"
        "```python\nprint('hello from', __file__)\n```\n"
        "```bash\n"
        'test "$(cat made.txt)" = made\n'
        'test "$(command -v python)" -ef "$(dirname "$(command -v phalanx)")/python"\n'
        "python hello.py\n"
        "```\n",
    )
    outcomes = check_page(page)
    assert [o.status for o in outcomes] == ["passed", "saved", "passed"]
    assert "hello from" in outcomes[2].output


def test_a_failing_block_fails_its_page(tmp_path: Path) -> None:
    page = write(tmp_path, "```python\nraise SystemExit(3)\n```\n")
    with pytest.raises(pytest.fail.Exception) as failed:
        check_page(page)
    assert "page.md:1  python  failed" in str(failed.value)
    assert "(exit 3, expected 0)" in str(failed.value)


def test_an_expected_exit_passes_and_another_fails(tmp_path: Path) -> None:
    page = write(
        tmp_path,
        "<!-- expect-exit: 3 -->\n```bash\nexit 3\n```\n"
        "<!-- expect-exit: 3 -->\n```bash\nexit 0\n```\n",
    )
    assert [o.status for o in run_page(page)] == ["passed", "failed"]


def test_a_block_past_its_deadline_is_killed_with_its_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    page = write(tmp_path, f"```bash\nsleep 60 &\necho $! > {pid_file}\nsleep 60\n```\n")
    (outcome,) = run_page(page, deadline=1.0)
    assert outcome.status == "timeout" and not outcome.ok
    assert "deadline" in outcome.output
    child = pid_file.read_text().strip()
    for _ in range(200):  # the background child went with the group
        if gone(child):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the block's background child {child} outlived its deadline")


def gone(pid: str) -> bool:
    """No process ``pid`` runs (none, or a zombie not yet reaped)."""
    try:
        stat = (Path("/proc") / pid / "stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_a_not_run_block_is_not_run(tmp_path: Path) -> None:
    page = write(tmp_path, "<!-- not-run: would fail -->\n```bash\nexit 1\n```\n")
    (outcome,) = check_page(page)
    assert outcome.status == "not-run" and outcome.ok


# ---- python blocks forked after `import torch` behave as `python block.py` ---------------------
AS_PYTHON = """```python
import os, sys
from pathlib import Path
assert __name__ == "__main__", __name__
here = Path(__file__)
assert here.is_absolute() and here.name == "snippet_1.py", __file__
assert sys.argv == ["snippet_1.py"], sys.argv
assert Path.cwd() == here.parent and Path(sys.path[0]) == here.parent, (os.getcwd(), sys.path)
assert sys.stdin.read() == ""
assert os.getpgid(0) == os.getpid()  # its own process group
import atexit
atexit.register(print, "ran at exit")
print("to stdout"); print("to stderr", file=sys.stderr)
unclosed = open("unclosed.txt", "w")
unclosed.write("flushed at exit")
import threading
done = threading.Event()
threading._register_atexit(done.set)  # a background writer's hook (phalanx.checkpoint)
threading.Thread(target=lambda: done.wait() and print("thread joined")).start()
```
```bash
test "$(cat unclosed.txt)" = "flushed at exit"
```
<!-- expect-exit: 1 -->
```python
def train():
    raise ValueError("boom")
train()
```
<!-- expect-exit: 1 -->
```python
raise SystemExit("said why")
```
<!-- expect-exit: 4 -->
```python
import sys; sys.exit(4)
```
"""


@pytest.mark.parametrize("preload", [True, False], ids=["preloaded", "fresh"])
def test_a_python_block_runs_as_python_would(tmp_path: Path, preload: bool) -> None:
    outcomes = run_page(write(tmp_path, AS_PYTHON), preload=preload)
    assert [o.status for o in outcomes] == ["passed"] * 5, snippets.failures(outcomes)
    ran, _, failed, said, _ = (o.output for o in outcomes)
    assert "to stdout" in ran and "to stderr" in ran
    assert ran.index("thread joined") < ran.index("ran at exit")
    assert failed.startswith("Traceback (most recent call last):\n"), failed
    fence = AS_PYTHON.splitlines().index("def train():")  # 1-based line of the fence
    assert f'snippet_{fence}.py", line 3, in <module>' in failed and "ValueError: boom" in failed
    assert "preload" not in failed and "runpy" not in failed, failed
    assert said.strip() == "said why"


def test_a_preloaded_block_past_its_deadline_is_killed_and_the_next_runs(tmp_path: Path) -> None:
    page = write(
        tmp_path, "```python\nimport time\ntime.sleep(60)\n```\n```python\nprint('next')\n```\n"
    )
    slow, after = run_page(page, deadline=2.0, preload=True)
    assert slow.status == "timeout" and slow.returncode == -9
    assert after.status == "passed" and after.output == "next\n"
