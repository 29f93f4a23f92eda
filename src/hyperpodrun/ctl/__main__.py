"""``python -m hyperpodrun.ctl``: the same as ``hyperpodctl``."""

import sys

from hyperpodrun.ctl import main

if __name__ == "__main__":
    sys.exit(main())
