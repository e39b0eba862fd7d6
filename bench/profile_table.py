"""The profiles of a results file as a BENCHMARKS-ready markdown table: where each step's time goes
and the floor it implies.

Reads the rows that carry a ``profile`` (``bench/profiling.py``: ``bench/run.py``'s ``profile``
experiment key, the model benches' ``--profile``; plan ``profile1`` of bench/gpu_session.py
makes one per workload) and writes one line each:

* step ms: the median timed step (unprofiled); profiled: the wall time of a profiled step;
* kernel ms: kernel time per profiled step; GPU idle: the share of the profiled wall time in
  which no kernel ran; host ms: the profiled wall time less the host's waits for the GPU;
* top categories: kernel ms per step of the three largest categories;
* floor: kernel ms per step, the step with zero host time (x: profiled step / floor);
* MFU: the timed steps'; at floor: the profiled steps' model FLOPs over the floor.

    python3 bench/profile_table.py OUT/results.jsonl [more.jsonl ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

NAMES = {"voxcpm15_tts": "VoxCPM-1.5", "glmasr_cut": "GLM-ASR-Nano, cut windows",
         "glmasr_win30": "GLM-ASR-Nano, 30 s windows", "glm4v_9b": "GLM-4.1V-9B", "whisper": "Whisper-large-v3",
         "wav2vec2": "wav2vec2-large", "conformer": "Conformer-CTC"}
HEADER = ["workload", "peer", "step ms", "profiled ms", "kernel ms", "GPU idle", "host ms", "top categories (ms/step)",
          "floor ms (x)", "MFU", "MFU at floor"]


def timed_step_ms(row: dict) -> float | None:
    """The median timed step in ms: the row's step times where it has them (a step that compiled
    a new shape does not move a median), else its elapsed time over its steps."""
    steps = row.get("step_ms_all") or (row.get("step_ms") if isinstance(row.get("step_ms"), list) else None)
    if steps:
        return statistics.median(steps)
    if isinstance(row.get("step_ms_median"), (int, float)):
        return row["step_ms_median"]
    if row.get("elapsed_s") and row.get("steps"):
        return 1e3 * row["elapsed_s"] / row["steps"]
    return None


def _num(v, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "-"


def _pct(v) -> str:
    return f"{100 * v:.1f}%" if isinstance(v, (int, float)) else "-"


def line(row: dict) -> list[str]:
    """One table line (a list of cells) of a row."""
    workload = NAMES.get(row.get("workload"), str(row.get("workload")))
    if row.get("workload") == "glm4v_9b" and row.get("lora"):
        workload += f" LoRA, {row.get('tokens_per_step', '?')} tokens"
    peer = str(row.get("name") or row.get("peer") or row.get("job") or "?")
    if "error" in row:
        return [workload, peer, f"error: {str(row['error'])[:120]}"] + [""] * (len(HEADER) - 3)
    p = row.get("profile")
    if not isinstance(p, dict) or "floor_ms" not in p:
        return [workload, peer, _num(timed_step_ms(row), ".1f"), "no profile"] + [""] * (len(HEADER) - 4)
    cats = p.get("kernel_ms_per_step_by_category", {})
    top = ", ".join(f"{k} {v:.1f}" for k, v in list(cats.items())[:3])
    floor = f"{p['floor_ms']:.1f} ({p['floor_ratio']:.2f}x)" if p.get("floor_ratio") else _num(p.get("floor_ms"), ".1f")
    return [workload, peer, _num(timed_step_ms(row), ".1f"), _num(p.get("wall_ms_per_step"), ".1f"),
            _num(p.get("kernel_ms_per_step"), ".1f"), _pct(p.get("gpu_idle_frac_of_wall")),
            _num(p.get("host_ms_per_step"), ".1f"), top, floor, _pct(row.get("mfu")), _pct(p.get("mfu_at_floor"))]


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows`` (every row: a profile, an error, or "no profile")."""
    out = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    out += ["| " + " | ".join(line(r)) + " |" for r in rows]
    return "\n".join(out)


def read_rows(paths: list[str]) -> list[dict]:
    """The JSON rows of the files, in order.

    Raises:
        ValueError: naming the file and line of a line that is not JSON.
    """
    rows = []
    for path in paths:
        with open(path) as f:
            for i, text in enumerate(f, 1):
                if text.strip():
                    try:
                        rows.append(json.loads(text))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{i}: not a JSON row ({e})") from e
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="results files (JSON lines)")
    a = p.parse_args(argv)
    print(table(read_rows(a.results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
