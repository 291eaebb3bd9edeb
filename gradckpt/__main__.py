"""``python -m gradckpt``: the same as the ``gradckpt`` command."""

import sys

from gradckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
