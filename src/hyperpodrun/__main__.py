"""``python -m hyperpodrun`` is the same as the ``hyperpodrun`` command."""

import sys

from hyperpodrun.cli import main

sys.exit(main())
