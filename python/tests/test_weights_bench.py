"""CI smoke of ``benches/scripts/weights_bench.py`` (docs/BENCHMARKS.md, "From Python:
weight_iterator and ensure"): the script runs end to end on a 32 MiB checkpoint against the
daemon under test and reports every figure. It never asserts on timing: only that each figure
was measured (every loaded byte was checked against the file inside the script, which fails
otherwise) and that the single flight published exactly once per cold run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO, kvpoold_bin, require_module

SCRIPT = REPO / "benches" / "scripts" / "weights_bench.py"
PROCS = 4


def test_weights_bench_reports_every_figure(tmp_path: Path) -> None:
    require_module(
        "safetensors", "pip install safetensors (a dependency of transformers)"
    )
    out = tmp_path / "weights_bench.json"
    cmd = [sys.executable, str(SCRIPT), "--size", "32MiB", "--reps", "1"]
    cmd += ["--latency-reps", "2", "--procs", str(PROCS), "--timeout", "240"]
    cmd += ["--kvpoold", str(kvpoold_bin()), "--json", str(out), "--dir", str(tmp_path)]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "weight_iterator: call to first tensor" in run.stdout
    report = json.loads(out.read_text())
    assert report["procs"] == PROCS and report["bytes"] > 30 << 20
    rows = {r["what"].strip(): r for r in report["rows"]}
    want = [
        "weight_iterator: call to first tensor (lm_head.weight)",
        "weight_iterator: call to first tensor, a 4 KiB one first",
        "weight_iterator: call to last tensor",
        "reference: file read into one numpy buffer + views",
        "reference: safetensors.torch.load_file (mmap: no byte read)",
        "reference: load_into preallocated buffers",
        "step: manifest fetch (_weights_manifest)",
        "1 process, ensure, model not in the pool",
        f"{PROCS} processes, ensure, model not in the pool",
        "1 process, ensure, model already published",
        f"{PROCS} processes, ensure, model already published",
        f"{PROCS} processes, reference: file read into numpy (no pool)",
        f"{PROCS} processes, reference: allocate + write the bytes (np.ones)",
        "load: zero-copy views (verified)",
        "reference: file read (page cache)",
        "load(copy=True): verified copies",
        "load: zero-copy views of MiniLM (verified)",
        "load(verify=False): views, node checksums only",
        "load(verify=False) of MiniLM",
        "reference: safetensors.numpy.load_file",
    ]
    for what in want:
        assert what in rows, (what, sorted(rows))
        assert rows[what]["median_s"] > 0 and len(rows[what]["runs_s"]) >= 1
    for what in (want[0], want[1], want[8], want[13], want[16]):
        assert isinstance(rows[what]["goal_met"], bool), rows[what]
    assert rows[want[8]]["ratio"] > 0
    # One read of the file per cold run: one process published, the others loaded.
    assert rows[want[8]]["how_per_run"] == [["pool"] * (PROCS - 1) + ["published"]]
    # The temporary checkpoint is gone.
    assert not list(tmp_path.glob("kvpool-wbench-*"))
