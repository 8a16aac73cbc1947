"""Docs are code: every example in README.md and docs/ runs here.

`pycon` blocks (`>>>` prompts) run as doctests, outputs compared up to whitespace; `python`
blocks are executed. Blocks of one page share a namespace, in page order.
"""

import doctest
import pathlib
import re

import jax
import pytest

import statax as stx

ROOT = pathlib.Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
FENCE = re.compile(r"^```(python|pycon)\n(.*?)^```", re.M | re.S)


def blocks(page):
    return [(lang, body) for lang, body in FENCE.findall(page.read_text())]


def test_every_page_has_examples_or_none_claimed():
    assert blocks(ROOT / "README.md"), "the README's example must be a python block"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    namespace = {"__name__": "__docs__"}
    flags = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
    runner = doctest.DocTestRunner(optionflags=flags)
    parser = doctest.DocTestParser()
    # As a user runs them: with JAX's default rank promotion (the suite raises on it, and the
    # model libraries the docs use broadcast ranks implicitly).
    with jax.numpy_rank_promotion("allow"):
        _run_blocks(page, namespace, parser, runner)


def _run_blocks(page, namespace, parser, runner):
    for i, (lang, body) in enumerate(blocks(page)):
        name = f"{page.name}[block {i}]"
        if lang == "python":
            exec(compile(body, name, "exec"), namespace)
        else:
            test = parser.get_doctest(body, namespace, name, str(page), 0)
            result = runner.run(test, clear_globs=False)
            namespace.update(test.globs)
            assert result.failed == 0, f"{name} failed; see the doctest output above"


def repl_sessions(page) -> list[list[tuple[int, str]]]:
    """The page's REPL sessions: each begins with a `pycon` block whose first line imports, and
    goes on with the page's next `pycon` blocks until the next that begins one. `(index, body)`
    of each block. (A `pycon` block before any such is the page's script's, run above.)"""
    sessions: list[list[tuple[int, str]]] = []
    for i, (lang, body) in enumerate(blocks(page)):
        if lang != "pycon":
            continue
        if re.match(r">>> (import|from) ", body.lstrip()):
            sessions.append([])
        if sessions:
            sessions[-1].append((i, body))
    return sessions


SESSIONS = [(page, n, session) for page in PAGES for n, session in enumerate(repl_sessions(page))]


@pytest.mark.parametrize(
    ("page", "n", "session"),
    SESSIONS,
    ids=[f"{p.relative_to(ROOT)}[session {n}]" for p, n, _ in SESSIONS],
)
def test_each_repl_session_runs_pasted_in_order_in_a_fresh_interpreter(
    page, n, session, tmp_path, monkeypatch
):
    """As a reader pastes it: only the session's own blocks, in order, in a new namespace."""
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    parser = doctest.DocTestParser()
    with jax.numpy_rank_promotion("allow"):
        for i, body in session:
            name = f"{page.name}[block {i}]"
            test = parser.get_doctest(body, namespace, name, str(page), 0)
            result = runner.run(test, clear_globs=False)
            namespace.update(test.globs)
            assert result.failed == 0, f"{name} (session {n}) failed; see the doctest output"


def test_api_page_documents_every_public_name():
    import statax.extend

    page = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^::: (\S+)$", page, flags=re.M))
    documented |= set(re.findall(r"^\| `(statax\.\S+)` \|", page, flags=re.M))  # constants
    public = {f"statax.{n}" for n in stx.__all__ if n != "extend"}
    public |= {f"statax.extend.{n}" for n in statax.extend.__all__}
    assert public - documented == set()
    assert stx.__all__ == sorted(stx.__all__)
    assert statax.extend.__all__ == sorted(statax.extend.__all__)


def test_maintaining_lists_every_private_jax_name():
    import subprocess
    import sys

    table = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "private_names.py"), "--markdown"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    page = (ROOT / "docs" / "maintaining.md").read_text()
    missing = [row for row in table.splitlines() if row not in page]
    assert not missing, "docs/maintaining.md lacks (run tools/private_names.py --markdown):\n" + (
        "\n".join(missing)
    )


def readme_command(tag: str) -> str:
    """The README's command under `<!-- ci:{tag} -->`, as `.ci/run` reads it."""
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- ci:{tag} -->\n```bash\n(.*?)\n```", text, re.S)
    assert match, tag
    return match[1]


def test_the_main_job_installs_what_it_needs_and_the_tests_their_extra():
    install, tests = readme_command("install"), readme_command("test")
    assert re.search(r"pip install -e \.( |$)", install), install  # statax alone, no extra
    assert '".[test]"' in tests and "pytest" in tests
    quickstart = (ROOT / "examples" / "quickstart.py").read_text()
    imported = set(re.findall(r"^(?:import|from) (\w+)", quickstart, re.M))
    assert imported <= {"jax", "equinox", "statax", "__future__"}, imported
    core = re.search(
        r"^dependencies = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S
    )
    names = {re.match(r'\s*"([a-z]+)', d)[1] for d in core[1].split(",") if d.strip()}
    assert names == {"jax", "jaxlib", "equinox"}


def test_the_runs_at_size_are_a_second_command_ci_runs():
    # The README's test command deselects them (pyproject's addopts); the second command runs
    # them, and .ci/run reads it from the README as it reads the others.
    exhaustive = readme_command("exhaustive")
    assert "-m exhaustive" in exhaustive and "pip" not in exhaustive
    assert "-m 'not exhaustive'" in (ROOT / "pyproject.toml").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "exhaustive_cmd=$(readme_command exhaustive)" in ci and 'eval "$exhaustive_cmd"' in ci


def test_no_figure_refers_to_an_issue_or_a_past_state():
    for page in (ROOT / "README.md", ROOT / "docs" / "performance.md"):
        text = page.read_text()
        assert not re.search(r"\bissue \d+", text), page.name
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Performance") : readme.index("## How it compares")]
    assert section.count("\n|") <= 12, "the README keeps a short table; the rest is a docs page"
