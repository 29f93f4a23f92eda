"""How a worker script ends: its output flushed, then ``os._exit``, skipping interpreter finalization, where torch's
gloo teardown can abort (SIGABRT, pytorch/pytorch#179291)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn


def run_and_exit(main: Callable[[], int | None]) -> NoReturn:
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
