"""``pyattr.kernels``: the Triton kernels of the rule backwards (one module per rule family).

Their sources live in the checkout's top-level ``kernels/`` folder (DESIGN §1), which has no
``__init__.py`` of its own, so that a checkout's root on ``sys.path`` (``python -c``, a
notebook, ``torchrun -m`` started there) never turns it into a top-level package shadowing
the ``kernels`` distribution that transformers imports. A wheel or sdist build copies them
in here (``setup.py``); an editable install or a checkout finds them through this package's
``__path__``, extended below to that folder.
"""

import os as _os

_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_os.path.dirname(_here))
_checkout = _os.path.join(_root, "kernels")
# only a pyattr checkout's own folder (setup.py beside it, the kernels' helper module in
# it), never a `kernels` that happens to sit beside an installed pyattr (site-packages)
if not _os.path.isfile(_os.path.join(_here, "_common.py")) and _os.path.isfile(_os.path.join(_root, "setup.py")) \
        and _os.path.isfile(_os.path.join(_checkout, "_common.py")):
    __path__.append(_checkout)  # noqa: F821 - a package's __path__
