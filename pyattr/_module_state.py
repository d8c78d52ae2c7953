"""A model's structure and plain settings kept across a probe forward pyattr runs on it.

Some forwards change the model they run on: BigBird and BigBird-Pegasus switch their
encoder to full attention on an input shorter than their sparse pattern needs, replacing
each layer's attention module and setting ``attention_type`` for every later call. A probe
pyattr runs on short ids (the position probe, the plan check) must not leave that change
behind: the user's own calls would then run another attention than the one they chose.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

_PLAIN = (str, int, float, bool, type(None))


@contextlib.contextmanager
def kept_state(root: nn.Module) -> Iterator[None]:
    """During the block ``root`` may be run; on exit every module under it has its children
    and its plain attributes (str, int, float, bool, None: ``attention_type``,
    ``training``) back as they were on entry."""
    saved = [(m, dict(m._modules), {k: v for k, v in vars(m).items() if isinstance(v, _PLAIN)})
             for m in root.modules()]
    try:
        yield
    finally:
        for m, children, plain in saved:
            if m._modules != children:
                m._modules.clear()
                m._modules.update(children)
            m.__dict__.update(plain)
