"""``python -m pyattr ...`` (what ``torchrun -m pyattr run ...`` calls): the command line."""

import sys

from pyattr.cli import main

sys.exit(main())
