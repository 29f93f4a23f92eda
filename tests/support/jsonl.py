"""Read the JSON-lines files that test jobs append to while the test polls them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete records of ``path`` ([] when it does not exist yet).

    A writer appends one line at a time, so a poll can catch the last line half written (CI saw
    ``{"step": 2585, "world": 2, "ts": 179556``): only newline-terminated lines are records.
    """
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]
