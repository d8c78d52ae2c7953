import sys

from pyattr.cli import main

sys.exit(main())
