"""An index directory's files, as index.py and dense.py write them."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
