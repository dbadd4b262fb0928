"""Looking inside attention: capture, streaming statistics, circuits, head detectors, ablation."""

from attnlab.interp.capture import Capture, attention_modules, capture

__all__ = ["Capture", "attention_modules", "capture"]
