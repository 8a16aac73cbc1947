"""What `sweep` returns: the metric for every site and index, with named axes, as a DataFrame,
a heatmap, and an HTML table with its image in a notebook."""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import itertools
import os

import numpy as np

from .._monitor.optional import require

__all__ = ["SweepResult"]


@dataclasses.dataclass(frozen=True)
class SweepResult:
    """The metric for every site and index of a sweep.

    `values[site]` has one axis per name in `axes` (sized as the site's value is along it),
    or none where each site was patched whole; `axes` is `{site: names}` where the sites
    were given axes of their own. `baseline` is the metric of the run patched
    into (the corrupted run when denoising, the clean run otherwise), `clean` and `corrupted`
    the metric of each run. `method` is `"exact"` or `"attribution"` (the first-order
    estimate of each patch). `memory_analysis()` says what the compiled program of one chunk
    of patches holds (its temporaries grow with `batch_size`), for an exact sweep."""

    sites: list
    axes: tuple | dict
    values: dict
    baseline: float
    clean: float
    corrupted: float | None
    mode: str
    method: str
    locations: dict
    lowered: object = dataclasses.field(default=None, repr=False)  # the chunk's, when asked

    def memory_analysis(self):
        """The compiled chunk program's `memory_analysis()` (an exact sweep's)."""
        if self.lowered is None:
            raise ValueError("an attribution sweep runs no chunks of patches.")
        return self.lowered().compile().memory_analysis()

    def __getitem__(self, site: str) -> np.ndarray:
        return self.values[site]

    def names(self, site: str) -> tuple:
        """The names of a site's axes."""
        return tuple(self.axes[site]) if isinstance(self.axes, dict) else tuple(self.axes)

    def array(self) -> np.ndarray:
        """Every site's values stacked, `(sites, *axes)`: sites of one shape only."""
        shapes = {v.shape for v in self.values.values()}
        if len(shapes) > 1:
            raise ValueError(
                f"the sites' values have shapes {sorted(shapes)}: stack those of one shape "
                "(result[site]), or sweep them apart."
            )
        return np.stack([self.values[s] for s in self.sites])

    def normalized(self) -> dict:
        """Each value as the fraction of the way from the base run's metric to the other
        run's (denoising: 0 is the corrupted run, 1 the clean one), as patching papers plot."""
        if self.corrupted is None:
            raise ValueError("normalized() needs a corrupted run: the ablations have one run.")
        other = self.clean if self.mode == "denoising" else self.corrupted
        span = other - self.baseline
        return {s: (v - self.baseline) / span for s, v in self.values.items()}

    def to_dataframe(self):
        """One row per site and index: `site`, one column per axis, `metric` (pandas)."""
        pd = require("pandas", "pandas")
        rows = []
        for site in self.sites:
            value = self.values[site]
            for index in itertools.product(*map(range, value.shape)):
                rows.append(
                    {
                        "site": str(site),
                        **dict(zip(self.names(site), index)),
                        "metric": value[index],
                    }
                )
        return pd.DataFrame(rows)

    def correlation(self, other: SweepResult) -> float:
        """Pearson's correlation with another sweep's values, site by site, index by index
        (the attribution against the exact sweep)."""
        a = np.concatenate([np.ravel(self.values[s]) for s in self.sites])
        b = np.concatenate([np.ravel(other.values[s]) for s in self.sites])
        return float(np.corrcoef(a, b)[0, 1])

    def heatmap(self, ax=None, title: str | None = None):
        """Sites by the first axis's index (layers by positions), the metric as colour.
        Returns the Figure (matplotlib)."""
        require("matplotlib", "plot")
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        grid = self.array()
        grid = grid.reshape(len(self.sites), -1) if grid.ndim != 2 else grid
        names = [str(s) for s in self.sites]
        cut = os.path.commonprefix(names).rfind("/") + 1  # a shared scope, shown once
        if ax is None:
            size = (2.5 + 0.5 * grid.shape[1], 1.2 + 0.45 * grid.shape[0])
            fig, ax = plt.subplots(figsize=size)
        else:
            fig = ax.figure
        image = ax.imshow(grid, cmap="RdBu_r", aspect="auto", interpolation="nearest")
        limit = np.max(np.abs(grid - self.baseline)) or 1.0
        image.set_clim(self.baseline - limit, self.baseline + limit)
        ax.set_yticks(range(len(names)), [n[cut:] for n in names])
        ax.set_ylabel(names[0][:cut] if cut else "site")
        names = self.names(self.sites[0])
        ax.set_xlabel(names[0] if names else "")
        ax.set_title(title or f"{self.mode} ({self.method}): metric after each patch")
        fig.colorbar(image, ax=ax, label="metric")
        fig.tight_layout()
        return fig

    def _repr_html_(self) -> str:
        table = "".join(
            f"<tr><th>{html.escape(str(s))}</th>"
            + "".join(f"<td>{v:.4g}</td>" for v in np.ravel(self.values[s]))
            + "</tr>"
            for s in self.sites
        )
        image = ""
        try:
            figure = self.heatmap()
        except (ImportError, ValueError):
            figure = None
        if figure is not None:
            buffer = io.BytesIO()
            figure.savefig(buffer, format="png", dpi=80)
            import matplotlib.pyplot as plt

            plt.close(figure)
            encoded = base64.b64encode(buffer.getvalue()).decode()
            image = f'<img src="data:image/png;base64,{encoded}"/>'
        caption = (
            f"{self.mode}, {self.method}: baseline {self.baseline:.4g}, clean {self.clean:.4g}"
            + ("" if self.corrupted is None else f", corrupted {self.corrupted:.4g}")
        )
        return f"<div><p>{html.escape(caption)}</p>{image}<table>{table}</table></div>"

    def __repr__(self) -> str:
        shapes = {str(s): self.values[s].shape for s in self.sites}
        return (
            f"SweepResult({self.mode}, {self.method}, axes={self.axes}, baseline="
            f"{self.baseline:.4g}, sites={shapes})"
        )
