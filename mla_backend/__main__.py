"""`python -m mla_backend`: the command line (`mla_backend.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
