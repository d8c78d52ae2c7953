"""MkDocs hook: the docstrings cross-reference in Sphinx roles (:func:`x`, :mod:`x`, ...),
which the Markdown renderer of the API reference shows as literal text before the code
span. The role prefix is dropped; the name stays a code span."""

import re

_ROLE = re.compile(r":(?:func|mod|class|meth|data|attr|exc|obj):(?=<code>)")


def on_page_content(html, page, config, files):
    return _ROLE.sub("", html)
