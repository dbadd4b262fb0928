"""attnlab: transformer attention — the math, fast kernels with backward, and the tools to look inside.

>>> import torch, attnlab
>>> from attnlab import masks
>>> q = k = v = torch.randn(1, 4, 128, 64)
>>> attnlab.attention(q, k, v, mask=masks.sliding_window(32)).shape
torch.Size([1, 4, 128, 64])
"""

from attnlab import masks, scores
from attnlab.ops import BACKENDS, BlockMask, attention, attention_probs, merge_states
from attnlab.ops.varlen import flash_attn_varlen_func, varlen_attention

__version__ = "0.1.0"
__all__ = [
    "attention",
    "attention_probs",
    "merge_states",
    "varlen_attention",
    "flash_attn_varlen_func",
    "masks",
    "scores",
    "BlockMask",
    "BACKENDS",
    "__version__",
]
