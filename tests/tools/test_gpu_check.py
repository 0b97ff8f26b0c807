"""scripts/gpu_check.py, the CUDA check, run where CI runs: on a CPU, with the tiny model.

The script is run unattended on a lent GPU machine, where a surprise costs the lease; here it must
at least run every part it can without CUDA and write the report it documents."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_every_part_it_can_on_a_cpu(tiny_dir, tmp_path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--model", str(tiny_dir), "--batches", "1,3",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                                                           "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["failed"] == [] and "kernels" not in report  # no CUDA: no Triton part
    assert [r["batch"] for r in report["steps"]] == [1, 3]
    pool = report["pool"]
    assert [r["batch"] for r in pool] == [1, 3]
    # the pooled forward computes what the caches of their own do (the CPU runs a pool only when
    # asked: the script asks), every cache of the pooled variant in the pool
    assert all(r["pool_pooled_caches"] == r["batch"] and r["own_pooled_caches"] == 0 for r in pool)
    assert all(r["max_abs_logit_diff"] < 1e-4 and r["argmax_equal"] == 1.0 for r in pool)
    assert report["bench"]["lossless"] is True and len(report["bench"]["rows"]) == 4
