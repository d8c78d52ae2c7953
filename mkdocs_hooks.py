"""MkDocs hook: the docstrings cross-reference in Sphinx roles (:func:`x`, :mod:`x`, ...),
which the Markdown renderer of the API reference shows as literal text before the code
span. The role prefix is dropped; the name stays a code span, and a name written
``~a.b.C`` (Sphinx: show only the last part) shows as ``C``."""

import re

_ROLE = re.compile(r":(?:func|mod|class|meth|data|attr|exc|obj):(?=<code>)")


_TILDE = re.compile(r"<code>~(?:[\w]+\.)*(\w+)</code>")


def on_page_content(html, page, config, files):
    return _TILDE.sub(r"<code>\1</code>", _ROLE.sub("", html))


def _notebook_pages(docs_dir):
    """The example notebooks (docs/notebooks/*.ipynb, stored with their outputs) as markdown
    pages, made in memory by docs/notebooks/render.py."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("notebook_render", Path(docs_dir) / "notebooks" / "render.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    return render.pages(docs_dir)


def on_files(files, config):
    from mkdocs.structure.files import File

    for uri, text in _notebook_pages(config["docs_dir"]).items():
        files.append(File.generated(config, uri, content=text))
    return files
