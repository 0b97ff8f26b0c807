"""scripts/gpu_check.py, the CUDA check, run where CI runs: on a CPU, with the tiny model.

The script is run unattended on a lent GPU machine, where a surprise costs the lease; here it must
at least run every part it can without CUDA and write the report it documents."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_every_part_it_can_on_a_cpu(tiny_dir, tmp_path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--model", str(tiny_dir), "--batches", "1,3",
         "--sessions", "1,4", "--out", str(out)],
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
    # the step loop: each level and mode ran (twice), every session of it to its end
    loop = report["loop"]
    assert sorted((r["concurrency"], r["mode"]) for r in loop["runs"]) == sorted(
        [(c, m) for c in (1, 4) for m in ("plain", "lookup")] * 2)
    assert all(r["tokens"] > 0 and r["steps"] > 0 for r in loop["runs"])
    assert loop["summary"]["1"]["plain_vs_one_session"] == 1.0 and loop["summary"]["4"]["plain_tokens_per_s"] > 0


def test_a_model_carried_in_parts_is_refused_when_its_parts_do_not_make_the_file(tmp_path) -> None:
    """gpu_check.sh joins .gpu/model.part-1 and -2 (scripts/gpu_bundle.sh's split for the device's
    64 MiB carries) and checks the sha256 before anything runs: a part that did not arrive whole
    must stop it with a clear error, not load a truncated model on a leased GPU."""
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "gpu_check.sh"
    script.write_text((ROOT / "scripts" / "gpu_check.sh").read_text())
    gpu = tmp_path / ".gpu"
    gpu.mkdir()
    (gpu / "model.part-1").write_bytes(b"GGUF" + b"\0" * 100)
    (gpu / "model.part-2").write_bytes(b"\1" * 50)  # short: the carry was cut
    whole = b"GGUF" + b"\0" * 100 + b"\1" * 60
    (gpu / "model.sha256").write_text(hashlib.sha256(whole).hexdigest() + "\n")
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "sha256" in proc.stderr and "part" in proc.stderr
    assert not (tmp_path / ".venv").exists()  # it stopped before any install or run
