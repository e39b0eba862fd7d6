"""Issue 30 item 18, what a new user trips on: `make demo` moves a previous demo run aside (and
says so) instead of deleting it without a word; the demo's test-set log lines name their set;
examples/plot_curves.py without matplotlib is one line naming `pip install matplotlib`."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_evaluate import TINY_ASR, manifest  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_frozen_heap")  # tests/conftest.py: tiny steps, shared cores


def demo_commands() -> list[list[str]]:
    """The commands `make demo` runs (make -n: printed, not run)."""
    out = subprocess.run(["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    assert "rm -rf" not in out, out
    return [shlex.split(line) for line in out.splitlines() if "examples/finetune_asr.py" in line]


@pytest.mark.timeout(240)
def test_make_demo_moves_a_previous_run_aside_and_test_lines_name_their_set(tmp_path, capsys):
    import finetune_asr

    commands = demo_commands()
    assert len(commands) == 2 and all("checkpoint.start_over=true" in c for c in commands), commands
    stage1 = commands[0][commands[0].index("--config"):]
    train, a, b = manifest(tmp_path, "base/train", 60), manifest(tmp_path, "base/test", 4), manifest(tmp_path, "accent/test", 4)
    args = [*stage1, f"trainer.output_dir={tmp_path}/base", f"data.tokenizer={tmp_path}/tok.json",
            f"data.train_manifest={train}", f"data.eval_manifest={a}", f"demo.test_manifests=[{a},{b}]",
            "trainer.max_steps=2", "trainer.eval_every=0", *TINY_ASR]
    args[1] = os.path.join(ROOT, args[1])
    finetune_asr.main(args)
    first = (tmp_path / "base" / "report.json").read_text()
    printed = capsys.readouterr()
    log = printed.err
    assert printed.out.rstrip().splitlines()[-1].startswith(f"report: {tmp_path}/base/report.json; logs: ")  # said last
    for m in (a, b):  # each test set's line says which set it is
        assert f"[test {m} step 2]" in log, log[-2000:]
    rows = [json.loads(line) for line in open(tmp_path / "base" / "metrics.jsonl")]
    assert sorted(r["set"] for r in rows if r["split"] == "test") == sorted([a, b])
    finetune_asr.main(args)  # `make demo` again: the first run is archived, not deleted
    printed = capsys.readouterr()
    assert "checkpoint.start_over: moved the previous run's" in printed.out + printed.err
    archived = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "base" / "archive") for f in files]
    assert any(open(f).read() == first for f in archived if f.endswith("report.json")), archived


def test_plot_curves_without_matplotlib_says_what_to_install(tmp_path):
    block = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = ['plot_curves.py', 'run']; "
             f"runpy.run_path({os.path.join(ROOT, 'examples', 'plot_curves.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "examples/plot_curves.py needs matplotlib, which the set-up does not install: pip install matplotlib"]


@pytest.mark.timeout(180)
def test_minimal_under_torchrun_prints_its_result_once(tmp_path):
    """issue 49 item 15: `make minimal` (2 ranks under torchrun) printed its result once per rank."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(ROOT, "examples", "minimal.py"),
                           f"trainer.output_dir={tmp_path}/run", "trainer.max_epochs=1", "logging.progress_bar=false"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=170,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("{'loss': ") == 1, proc.stdout
