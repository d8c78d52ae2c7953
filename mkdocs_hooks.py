"""MkDocs hook: the docstrings cross-reference in Sphinx roles (:func:`x`, :mod:`x`, ...),
which the Markdown renderer of the API reference shows as literal text before the code
span. The role prefix is dropped; the name stays a code span, and a name written
``~a.b.C`` (Sphinx: show only the last part) shows as ``C``."""

import re

_ROLE = re.compile(r":(?:func|mod|class|meth|data|attr|exc|obj):(?=<code>)")


_TILDE = re.compile(r"<code>~(?:[\w]+\.)*(\w+)</code>")


def on_page_content(html, page, config, files):
    return _TILDE.sub(r"<code>\1</code>", _ROLE.sub("", html))
