"""The JSON records of several bench runs read for one table (CPU only): what a record's run set, and the records
themselves with the machines they came from, and the command line of a table of them (``bench/probe_table.py``,
``bench/decode_table.py``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
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


def table_main(argv: list[str] | None, description: str, tool: str, what: str,
               build: Callable[[list[dict[str, Any]]], dict[str, Any]], render: Callable[[dict[str, Any]], str]) -> int:
    """A table's command line: the records (``what`` they are) read, ``build``'s table printed by ``render`` and,
    with --out, written as JSON beside the record paths and machines. 2 when no record could be read."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("records", nargs="+", help=f"{what} (JSON)")
    ap.add_argument("--out", default="", help="the table as JSON")
    args = ap.parse_args(argv)
    records, machines = read_records(args.records, tool)
    if not records:
        print(f"{tool}: no readable record", file=sys.stderr)
        return 2
    body = build(records)
    print(render(body))
    if args.out:
        Path(args.out).write_text(json.dumps({"records": args.records, "machines": machines, **body}, indent=1))
    return 0
