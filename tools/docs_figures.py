"""An MkDocs hook: the figures a docs page's own code draws, made while the site builds.

Before the build, each page listed here has its Python blocks run (as `tests/test_docs.py`
runs them) in a temporary folder, and the image the page writes there is copied into
`docs/assets/`, where the page shows it. The images are build outputs: git ignores them.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import tempfile

FIGURES = {"patching-experiments.md": "patching_heatmap.png"}
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def on_pre_build(config, **kwargs) -> None:
    import jax

    docs = pathlib.Path(config["docs_dir"])
    for page, image in FIGURES.items():
        code = FENCE.findall((docs / page).read_text())
        with tempfile.TemporaryDirectory() as folder, _cwd(folder):
            namespace = {"__name__": "__docs__"}
            with jax.numpy_rank_promotion("allow"):  # (as a user runs them)
                for i, body in enumerate(code):
                    exec(compile(body, f"{page}[block {i}]", "exec"), namespace)
            shutil.copy(pathlib.Path(folder) / image, docs / "assets" / image)


class _cwd:
    def __init__(self, path):
        self.path, self.old = path, None

    def __enter__(self):
        import os

        self.old = os.getcwd()
        os.chdir(self.path)

    def __exit__(self, *exc):
        import os

        os.chdir(self.old)
