"""Where benchmark records go: JSON files named by the host's CPU kind under docs/results/."""

from __future__ import annotations

import json
from pathlib import Path


def host_label(cpu: str) -> str:
    """The results folder of a CPU model name (`lscpu`'s): epyc, xeon or other."""
    return "epyc" if "EPYC" in cpu else ("xeon" if "Xeon" in cpu else "other")


def write_record(path: Path, record: dict) -> Path:
    """`record` as indented JSON at `path` (its folders made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
