"""Looking inside attention: hook points and the activation cache, capture, streaming statistics,
circuits, head detectors, ablation.

* :func:`hook_names`, :func:`run_with_hooks`, :func:`hooks` — TransformerLens-style named hook points;
* :func:`run_with_cache`, :class:`ActivationCache` — every activation by name, residual-stream tools;
* :func:`capture` — q, k, v, per-head outputs and (recomputed) patterns, fast path on;
* :func:`head_stats` — per-head entropy and masses in one tiled pass, O(N) memory;
* :class:`FactoredMatrix`, :mod:`circuits` — QK/OV circuits, composition, copying, on any
  model :func:`model_weights` reads (attnlab Decoder/Encoder, transformers GPT-2/Llama/BERT);
* :func:`detect`, :mod:`detectors` — previous-token, induction, sink ... heads;
* :func:`ablate`, :func:`ablation_effects` — zero / mean / resample ablation;
* :func:`activation_patching`, :func:`path_patching`, :func:`attribution_patching`, :func:`logit_lens`.

See docs/interp.md.
"""

from attnlab.interp import circuits, detectors
from attnlab.interp.ablation import ablate, ablation_effects
from attnlab.interp.activation_cache import ActivationCache, get_act_name, run_with_cache
from attnlab.interp.capture import Capture, attention_modules, capture
from attnlab.interp.detectors import HeadScores, detect, value_weighted
from attnlab.interp.factored import FactoredMatrix
from attnlab.interp.hooks import HookInfo, hook_names, hook_points, hooks, run_with_hooks
from attnlab.interp.lens import LensResult, logit_lens
from attnlab.interp.patching import (
    PatchResult,
    activation_patching,
    agreement,
    attribution_patching,
    logit_diff,
    path_patching,
)
from attnlab.interp.spec import ModelSpec, model_spec
from attnlab.interp.stats import HeadStats, head_stats, stats_from_probs
from attnlab.interp.weights import ModelWeights, model_weights

__all__ = [
    "Capture",
    "attention_modules",
    "capture",
    "ablate",
    "ablation_effects",
    "circuits",
    "detectors",
    "HeadScores",
    "detect",
    "value_weighted",
    "FactoredMatrix",
    "HeadStats",
    "head_stats",
    "stats_from_probs",
    "ActivationCache",
    "get_act_name",
    "run_with_cache",
    "HookInfo",
    "hook_names",
    "hook_points",
    "hooks",
    "run_with_hooks",
    "ModelSpec",
    "model_spec",
    "ModelWeights",
    "model_weights",
    "LensResult",
    "logit_lens",
    "PatchResult",
    "activation_patching",
    "agreement",
    "attribution_patching",
    "logit_diff",
    "path_patching",
]
