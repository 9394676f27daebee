"""The JSON records of several bench runs read for one table (CPU only): what a record's run set, and the records
themselves with the machines they came from (``bench/probe_table.py``, ``bench/decode_table.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def variant_of(record: dict[str, Any]) -> str:
    """A record's variant: its --set constants and --drop kinds, '(defaults)' for none."""
    sets = [f"{k}={v}" for k, v in sorted((record.get("settings") or {}).items())]
    drops = [f"drop {k}" for k in record.get("dropped_kernels") or []]
    return ", ".join(sets + drops) or "(defaults)"


def read_records(paths: list[str], tool: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The readable records among ``paths`` (each unreadable one said on stderr) and their machines, sorted; with
    records of several machines, a warning on stderr (times compare within one lease only)."""
    records = []
    for path in paths:
        try:
            records.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            print(f"{tool}: {path}: {e}", file=sys.stderr)
    machines = sorted({str(r.get("machine")) for r in records})
    if len(machines) > 1:
        print(f"{tool}: records of {len(machines)} machines ({'; '.join(machines)}): do not compare them",
              file=sys.stderr)
    return records, machines
