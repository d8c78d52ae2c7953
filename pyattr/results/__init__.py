"""What every pyattr result can do with itself (DESIGN §11): show itself in a notebook
(``_repr_html_``), ``show()``, ``plot()``, ``to_pandas()``, ``save(path)``, and come back
with :func:`pyattr.load`. The layouts are in :mod:`pyattr.results.layouts`, the media in
:mod:`pyattr.results.html` and :mod:`pyattr.results.figure`, the file format in
:mod:`pyattr.results.store`."""

from __future__ import annotations

from pyattr.results.store import load


class ResultViews:
    """Views shared by the result classes. ``tokens`` (list of lists of str, one per batch
    row and column; None at padding) is set where the call was given a tokenizer."""

    def _panels(self, limit="default"):
        from pyattr.results.layouts import MAX_ROWS, panels

        return panels(self, MAX_ROWS if limit == "default" else limit)

    def _heading(self) -> str:
        return f"{type(self).__name__}" + (f" · backend {self.backend}" if getattr(self, "backend", None) else "")

    def _repr_html_(self) -> str:
        """The result as self-contained HTML (what a notebook shows for it): token
        heatmaps and matrices in blue (negative) to red (positive) with a legend, every
        value on hover; no script, no network."""
        from pyattr.results.html import render

        return render(self._panels(), self._heading())

    def to_html(self) -> str:
        """The same view as a whole HTML document (write it to a file to open it in a browser)."""
        from pyattr.results.html import page

        return page(self._panels(), self._heading())

    def show(self) -> None:
        """Display the result: the HTML view in a notebook (IPython), plain text elsewhere."""
        import sys

        if "ipykernel" in sys.modules and _in_ipython():
            from IPython.display import HTML, display

            display(HTML(self._repr_html_()))
            return
        from pyattr.results.figure import text

        print(text(self._panels(), self._heading()))

    def plot(self, path=None):
        """A matplotlib figure of the result: heatmaps with a colour bar centred on 0
        (blue negative, red positive, grey where a cell does not apply), curves as lines.

        Args:
            path (str | os.PathLike, optional): also write the figure there (a PNG, or the
                format the suffix names, as ``Figure.savefig`` reads it).

        Returns:
            matplotlib.figure.Figure (``fig.savefig("out.png")`` writes it).

        Raises:
            ImportError: matplotlib is not installed. ValueError: nothing to draw.
        """
        from pyattr.results.figure import figure

        fig = figure(self._panels(), self._heading())
        if path is not None:
            fig.savefig(path)
        return fig

    def to_pandas(self):
        """Every cell as one row of a long ``pandas.DataFrame``: the panel, its coordinates
        (position and token; layer and token; step and token; …) and the value. Every batch
        row is in it, also those the views leave out (they draw the first 8)."""
        from pyattr.results.figure import dataframe

        return dataframe(self._panels(None))

    def save(self, path) -> str:
        """Write the result to ``path`` (safetensors: tensors, with every other field as
        JSON metadata; no pickle). :func:`pyattr.load` reads it back. Returns the path."""
        from pyattr.results.store import save

        return save(self, path)


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


__all__ = ["ResultViews", "load"]
