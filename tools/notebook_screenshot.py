"""Render statax's notebook display in a real browser: build a notebook, execute it in a
Jupyter kernel, export it to HTML with nbconvert, and take a screenshot with headless Chromium.

Not part of the test suite (it needs a kernel, nbconvert and a browser); the HTML itself is
tested in tests/test_display.py. Run it after changing the display, and look at the PNG:

    pip install -e ".[notebook]" ipython nbformat nbclient nbconvert ipykernel
    apt-get install chromium
    python tools/notebook_screenshot.py docs/assets/notebook.png
"""

import pathlib
import subprocess
import sys
import tempfile

import nbclient
import nbconvert
import nbformat

CELLS = [
    """\
import jax, jax.numpy as jnp
import statax as stx

def model(x):
    for i in range(3):
        x = stx.save_inter(jax.nn.relu(x @ jnp.full((4, 4), 0.5) - i), name=f"layer{i}")
    return stx.save_inter(jnp.log(x), name="log")  # log(0): -inf where layer2 is zero

out, inters = stx.pull(jax.jit(model))(jnp.linspace(-1.0, 2.0, 8).reshape(2, 4))
inters  # the dict pull returns""",
    "stx.describe(inters)  # the same table; below it, treescope's rendering of the values",
]


def main(png: str) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in CELLS]
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3").execute()
    body, _ = nbconvert.HTMLExporter().from_notebook_node(notebook)
    # The last output's treescope section opened, as a click would open it.
    head, _, tail = body.rpartition("<details>")
    body = f"{head}<details open>{tail}"
    with tempfile.TemporaryDirectory() as tmp:
        page = pathlib.Path(tmp) / "notebook.html"
        page.write_text(body)
        subprocess.run(
            [
                "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", f"--user-data-dir={tmp}/profile", "--hide-scrollbars",
                "--window-size=1100,1000", f"--screenshot={pathlib.Path(png).resolve()}",
                page.as_uri(),
            ],
            check=True,
        )  # fmt: skip
    print("wrote", png)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "notebook.png")
