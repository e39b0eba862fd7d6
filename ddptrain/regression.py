"""Evaluation over named sources: the mean over sources, and the regression gate against a base.

Why: adapting a model to one dialect degrades the others, and the pooled metric hides it (the
biggest source dominates it). Two pieces, both over the recipe's per-source metrics
``<metric>/<source>`` (``metrics_fn`` returns them for ``data.eval_sources``; ddptrain/data/mix.py):

* ``<metric>/mean``: the mean over the eval sources of ``<metric>/<source>`` (each source counts
  once, whatever its size), logged with every evaluation, so keep-best can rank checkpoints over
  all sources: ``checkpoint.best_metric: wer/mean``.
* The gate (``eval.baseline`` != none): each evaluation compares every source's
  ``eval.regression_metric`` with the base model's; a source worse than the base by more than
  ``eval.regression_margin`` (``eval.regression_mode`` says which way is worse) is printed as a
  warning naming the source, its value, the base's and the margin, and logged as the flag
  ``regressed/<source>`` = 1 (0 when it is within the margin), with ``regressed`` = how many did.
  The base's metrics are measured at step 0, before training (``eval.baseline: measure``; kept in
  ``output_dir/eval_baseline.json``, which a resume reads), or read from a JSON file: a flat
  ``{metric: value}`` (another run's ``eval_baseline.json``) or a checkpoint's ``meta.json``
  (its ``metrics``). A gate that would check nothing is refused at the start: no named eval
  sources, or a metric the evaluation (a probe of a batch, or the base's measurement) or the base
  file does not have per source (a typo, or ``loss`` where the recipe gives it for the whole set).
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable, Iterable, Optional

from ddptrain.config import ConfigError

BASELINE_FILE = "eval_baseline.json"
MEAN = "mean"  # <metric>/mean: a source may not be called so (ddptrain/config.py)


def source_means(result: dict, sources: Iterable[str]) -> dict:
    """``{<metric>/mean: mean over sources}`` of each metric that ``result`` has per source
    (``<metric>/<source>`` for a name in ``sources``; NaN values are left out)."""
    names = set(map(str, sources)) - {MEAN}
    per_metric: dict[str, list[float]] = {}
    for key, value in result.items():
        metric, _, source = key.rpartition("/")
        if metric and source in names and math.isfinite(value):
            per_metric.setdefault(metric, []).append(float(value))
    return {f"{m}/{MEAN}": sum(v) / len(v) for m, v in per_metric.items()}


def read_baseline(path: str) -> dict:
    """The metrics of a baseline file: ``{metric: value}``, or the ``metrics`` of a checkpoint's
    ``meta.json``. Raises ConfigError naming the file when it is missing or holds no metrics."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"eval.baseline: cannot read {path}: {e}") from None
    data = data.get("metrics", data) if isinstance(data, dict) else data
    if not isinstance(data, dict) or not data or not all(isinstance(v, (int, float)) for v in data.values()):
        raise ConfigError(f"eval.baseline: {path} holds no {{metric: number}} object (or a meta.json's metrics)")
    return {str(k): float(v) for k, v in data.items()}


def eval_sources(config, data) -> list[str]:
    """The named sources of an evaluation: ``data.eval_sources`` and the names of ``data``'s
    dataset if it is a MixedDataset (a Python-built loader)."""
    named = getattr(getattr(data, "dataset", None), "names", None) or ()
    return list(dict.fromkeys(map(str, [*config.data.eval_sources, *named])))


def gate_for(config, eval_data, step: int, is_main: bool) -> Optional["RegressionGate"]:
    """The run's gate (``eval.baseline`` != none), else None.

    Raises:
        ConfigError: a gate without eval data or without named eval sources (it compares each
            source's metric: with one ``data.eval_manifest`` it would check nothing), or
            :class:`RegressionGate`'s.
    """
    if config.eval.baseline == "none":
        return None
    if eval_data is None:
        raise ConfigError("eval.baseline compares evaluations with the base model's, and this run has no eval_data")
    sources = eval_sources(config, eval_data)
    if not sources:
        raise ConfigError(f"eval.baseline={config.eval.baseline!r} compares eval.regression_metric per eval source "
                          f"({config.eval.regression_metric}/<source>), and this run's evaluation has no named sources "
                          "(a single data.eval_manifest): name them with data.eval_sources ({name: manifest}), or "
                          "set eval.baseline=none")
    return RegressionGate(config.eval, config.trainer.output_dir, step, is_main, sources)


class RegressionGate:
    """Compares each evaluation's per-source metric with the base model's (the module docstring).

    Args:
        cfg: the ``eval`` section.
        output_dir: the run folder (``eval.baseline: measure`` keeps the measured base there).
        step: the step the run starts at; a resumed run (> 0) reads the base it measured.
        is_main: this rank writes the measured base's file.
        sources: the eval sources (for the checks; :meth:`review` is given them each time).

    Raises:
        ConfigError: a baseline file that cannot be read or has no ``<metric>/<source>`` of these
            sources, or a resumed ``measure`` run without it.
    """

    def __init__(self, cfg, output_dir: str, step: int, is_main: bool, sources: Iterable[str] = ()):
        self.metric, self.mode, self.margin = cfg.regression_metric, cfg.regression_mode, float(cfg.regression_margin)
        self.path, self.is_main = os.path.join(output_dir, BASELINE_FILE), is_main
        self.baseline: Optional[dict] = None  # None: measure it at the first evaluation (step 0)
        self.checked = False  # check_metric has seen an evaluation produce the metric
        self._unknown: set = set()  # sources without a base value, warned about once
        path = cfg.baseline
        if cfg.baseline != "measure":
            self.baseline = read_baseline(cfg.baseline)
        elif step > 0:
            if not os.path.isfile(self.path):
                raise ConfigError(f"eval.baseline=measure: this run resumes at step {step} and {self.path} does not "
                                  "exist (the base is measured at step 0): set eval.baseline to a file of the base "
                                  "model's metrics, or to none")
            self.baseline, path = read_baseline(self.path), self.path
        sources = list(map(str, sources))
        if self.baseline is not None and sources and not self._per_source(self.baseline, sources):
            raise ConfigError(f"eval.regression_metric={self.metric!r}: the base's metrics in {path} have no "
                              f"{self.metric}/<source> for the eval sources {sources}; per-source metrics there: "
                              f"{self._produced(self.baseline, sources) or 'none'}")

    def _per_source(self, result: dict, sources: list) -> list:
        return [s for s in sources if f"{self.metric}/{s}" in result]

    @staticmethod
    def _produced(result: dict, sources: list) -> str:
        """The metrics ``result`` has per source (``wer`` for ``wer/a``), as a list to print."""
        return ", ".join(sorted({k.rpartition("/")[0] for k in result if k.rpartition("/")[2] in sources} - {""}))

    def check_metric(self, result: dict, sources: Iterable[str]) -> None:
        """Refuse a metric the evaluation does not produce per source (a typo, or ``loss``, which a
        recipe may produce for the whole set only): the gate would check nothing, without a word.

        Called with the run's first evaluation of its own data (a probe of a batch per rank is
        enough: a per-source metric is there for the sources in it).

        Raises:
            ConfigError: no ``<metric>/<source>`` in ``result`` for any of ``sources``.
        """
        sources = list(map(str, sources))
        if not self._per_source(result, sources):
            produced = self._produced(result, sources) or "none (metrics_fn returns no <metric>/<source>)"
            raise ConfigError(f"eval.regression_metric={self.metric!r} is not a metric this run's evaluation produces "
                              f"per eval source ({self.metric}/<source> for a source of {sources}); it produces "
                              f"per source: {produced}")
        self.checked = True

    def review(self, result: dict, step: int, sources: Iterable[str], say: Callable[[str], None]) -> dict:
        """Check ``result`` (an evaluation at ``step``); returns the flags to log with it.

        The first evaluation of a ``measure`` run is the base's: it is kept (and written), not checked.
        """
        if self.baseline is None:
            self.baseline = {k: float(v) for k, v in result.items() if math.isfinite(v)}
            if self.is_main:
                tmp = self.path + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(self.baseline, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
                say(f"eval.baseline: the base model's metrics at step {step} are kept in {self.path}")
            return {}
        flags, sign = {}, 1.0 if self.mode == "min" else -1.0
        for source in dict.fromkeys(map(str, sources)):
            key = f"{self.metric}/{source}"
            value, base = result.get(key), self.baseline.get(key)
            if value is None or not math.isfinite(value):
                continue
            if base is None:
                if source not in self._unknown:
                    self._unknown.add(source)
                    say(f"WARNING: eval.baseline has no {key}: source {source!r} is not checked for regressions")
                continue
            worse = sign * (value - base) > self.margin
            flags[f"regressed/{source}"] = float(worse)
            if worse:
                say(f"WARNING: regression at step {step}: source {source!r} {key}={value:.4f} is worse than the "
                    f"base's {base:.4f} by more than eval.regression_margin={self.margin:g}")
        if flags:
            flags["regressed"] = float(sum(flags.values()))
        return flags
