"""Training on CPU: a byte-level BPE trained locally, data sources, the loop, checkpoints.

>>> from attnlab.train import ByteBPE, TrainConfig, repeated_sequences, train
"""

from attnlab.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from attnlab.train.data import TokenStream, associative_recall, repeated_sequences
from attnlab.train.loop import TrainConfig, TrainResult, evaluate, lr_at, train
from attnlab.train.tokenizer import ByteBPE, ByteTokenizer, stdlib_corpus

__all__ = [
    "ByteBPE",
    "ByteTokenizer",
    "stdlib_corpus",
    "TokenStream",
    "repeated_sequences",
    "associative_recall",
    "TrainConfig",
    "TrainResult",
    "train",
    "evaluate",
    "lr_at",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
]
