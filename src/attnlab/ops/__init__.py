"""Functional attention: no parameters, no state.  See :func:`attnlab.attention`."""

from attnlab.masks import BlockMask
from attnlab.ops.dispatch import BACKENDS, attention, attention_probs
from attnlab.ops.dropout import dropout_mask
from attnlab.ops.flash import flash_attention
from attnlab.ops.merge import merge_states
from attnlab.ops.reference import reference_attention

__all__ = [
    "attention",
    "attention_probs",
    "BACKENDS",
    "BlockMask",
    "dropout_mask",
    "flash_attention",
    "merge_states",
    "reference_attention",
]
