"""Looking inside attention: capture, streaming statistics, circuits, head detectors, ablation.

* :func:`capture` — q, k, v, per-head outputs and (recomputed) patterns, fast path on;
* :func:`head_stats` — per-head entropy and masses in one tiled pass, O(N) memory;
* :class:`FactoredMatrix`, :mod:`circuits` — QK/OV circuits, composition, copying, on any
  model :func:`model_weights` reads (attnlab Decoder/Encoder, transformers GPT-2/Llama/BERT);
* :func:`detect`, :mod:`detectors` — previous-token, induction, sink ... heads;
* :func:`ablate`, :func:`ablation_effects` — zero / mean / resample ablation.

See docs/interp.md.
"""

from attnlab.interp import circuits, detectors
from attnlab.interp.ablation import ablate, ablation_effects
from attnlab.interp.capture import Capture, attention_modules, capture
from attnlab.interp.detectors import HeadScores, detect, value_weighted
from attnlab.interp.factored import FactoredMatrix
from attnlab.interp.stats import HeadStats, head_stats, stats_from_probs
from attnlab.interp.weights import ModelWeights, model_weights

__all__ = ["Capture", "attention_modules", "capture", "ablate", "ablation_effects", "circuits", "detectors",
           "HeadScores", "detect", "value_weighted", "FactoredMatrix", "HeadStats", "head_stats", "stats_from_probs",
           "ModelWeights", "model_weights"]
