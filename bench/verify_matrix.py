"""Run `fusedserve verify` over a matrix of (architecture, tp, dp, ep, fusion) and record the results.

    python bench/verify_matrix.py [--out bench/results/<date>-verify-matrix-cpu.json]

Tiny random checkpoints (fusedserve.tiny) for Llama, DeepSeek-V3 and Nemotron-H; three prompts,
so at dp=4 one DP group has no tokens. Each run spawns its ranks (gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = [(2, 1, 1), (4, 1, 1), (4, 2, 1), (4, 4, 4), (2, 1, 2), (4, 2, 2)]
PROMPTS = [[5, 17, 42, 8, 99, 3, 61], [7, 7, 1, 240, 13], [200]]


def main() -> None:
    from fusedserve.tiny import make_tiny_deepseek_v3, make_tiny_llama, make_tiny_nemotron_h

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=f"bench/results/{datetime.date.today()}-verify-matrix-cpu.json")
    ap.add_argument("--archs", default="llama,deepseek_v3,nemotron_h")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="verify-matrix-"))
    makers = {"llama": make_tiny_llama, "deepseek_v3": make_tiny_deepseek_v3, "nemotron_h": make_tiny_nemotron_h}
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    rows = []
    for arch in args.archs.split(","):
        model = makers[arch](tmp / arch)
        for tp, dp, ep in CONFIGS:
            for fusion in ("off", "reference"):
                cmd = [sys.executable, "-m", "fusedserve.cli", "verify", "--model", str(model), "--tp", str(tp),
                       "--dp", str(dp), "--ep", str(ep), "--fusion", fusion, "--oracle", "hf",
                       "--prompts", str(prompts), "--json"]
                t0 = time.time()
                proc = subprocess.run(cmd, capture_output=True, text=True)
                rep = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
                row = {"arch": arch, "tp": tp, "dp": dp, "ep": ep, "fusion": fusion, "exit": proc.returncode,
                       "ok": rep.get("ok"), "max_abs_diff": rep.get("max_abs_diff"),
                       "planned_per_forward": rep.get("planned_per_forward"),
                       "executed_per_forward": rep.get("executed_per_forward"),
                       "seconds": round(time.time() - t0, 1)}
                if proc.returncode != 0 and not rep:
                    row["stderr"] = proc.stderr.strip().splitlines()[-1:] 
                rows.append(row)
                print(json.dumps(row), flush=True)
    record = {"date": str(datetime.date.today()), "machine": f"{platform.node()} {os.cpu_count()} CPUs",
              "command": " ".join([sys.executable, *sys.argv]), "numbers": rows,
              "all_ok": all(r["exit"] == 0 and r["ok"] for r in rows)}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print("all ok" if record["all_ok"] else "FAILURES", file=sys.stderr)


if __name__ == "__main__":
    main()
