"""The `statax.extend` promise: the built-in handlers import `statax.extend` and nothing else of
statax's, as a handler written outside statax would. ruff enforces it (`statax/handlers/
ruff.toml`, run by CI); this checks that the rule fires."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUFF = pathlib.Path(sys.executable).with_name("ruff")


def lint_as_handler(source: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(RUFF), "check", "--no-cache", "--stdin-filename", "statax/handlers/probe.py", "-"],
        input=source,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    "source, rule",
    [
        ("from statax import _compat\n", "TID251"),
        ("from statax._interpreter import mark\n", "TID251"),
        ("from statax._equinox import impl_of\n", "TID251"),
        ("from jax._src import core\n", "TID251"),
        ("from .. import _compat\n", "TID252"),
    ],
)
def test_a_handler_importing_statax_internals_fails_lint(source, rule):
    result = lint_as_handler(source + f"__all__ = [{source.split()[-1]!r}]\n")
    assert result.returncode == 1 and rule in result.stdout, result.stdout


def test_a_handler_importing_statax_extend_passes_lint():
    source = "from statax.extend import mark, params\n\n__all__ = ['mark', 'params']\n"
    result = lint_as_handler(source)
    assert result.returncode == 0, result.stdout
