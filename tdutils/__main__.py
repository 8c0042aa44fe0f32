"""`python -m tdutils ...`: the command line lives in `tdutils.cli` (`tdutils.cli.main`)."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
