"""Real checkpoints and the transformers bridge.

>>> from attnlab.models import load
>>> model, tok = load("minilm")                     # the shipped all-MiniLM-L6-v2
>>> batch = tok(["attention is all you need", "hello"])
>>> emb = sentence_embeddings(model, tok, ["attention is all you need"])
>>> emb.shape
torch.Size([1, 384])
"""

from attnlab.models.checkpoint import CheckpointError
from attnlab.models.hf_cache import as_hf_cache
from attnlab.models.load import ARCHITECTURES, load, minilm_path
from attnlab.models.sentence import sentence_embeddings
from attnlab.models.tokenizer import Tokenizer

__all__ = ["as_hf_cache", "load", "CheckpointError", "ARCHITECTURES", "minilm_path", "sentence_embeddings", "Tokenizer"]
