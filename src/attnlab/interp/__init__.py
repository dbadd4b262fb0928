"""Looking inside attention: capture, streaming statistics, circuits, head detectors, ablation."""

from attnlab.interp.capture import Capture, attention_modules, capture

__all__ = ["Capture", "attention_modules", "capture"]

from attnlab.interp import detectors  # noqa: E402
from attnlab.interp.ablation import ablate, ablation_effects  # noqa: E402
from attnlab.interp.detectors import HeadScores, detect, value_weighted  # noqa: E402

__all__ += ["ablate", "ablation_effects", "detectors", "HeadScores", "detect", "value_weighted"]

from attnlab.interp import circuits  # noqa: E402
from attnlab.interp.factored import FactoredMatrix  # noqa: E402

__all__ += ["circuits", "FactoredMatrix"]

from attnlab.interp.stats import HeadStats, head_stats, stats_from_probs  # noqa: E402

__all__ += ["HeadStats", "head_stats", "stats_from_probs"]
