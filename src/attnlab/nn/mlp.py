"""Feed-forward blocks: the classic two-layer MLP and the gated SwiGLU.

``MLP(x) = W_out · act(W_in x + b_in) + b_out``; ``SwiGLU(x) = W_down (silu(W_gate x) ⊙ W_up x)``
(Shazeer, 2020), with gate and up fused into one GEMM.

>>> import torch
>>> from attnlab.nn import MLP, SwiGLU
>>> MLP(16, 64)(torch.randn(2, 3, 16)).shape, SwiGLU(16, 48)(torch.randn(2, 3, 16)).shape
(torch.Size([2, 3, 16]), torch.Size([2, 3, 16]))
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from attnlab.nn.hooks import HookPoint
from attnlab.validate import choice, positive_int

ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),  # erf form (BERT)
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's "gelu_new"
    "relu": F.relu,
    "silu": F.silu,
}


class MLP(nn.Module):
    def __init__(self, d_model: int, d_mlp: int, *, act: str = "gelu", bias: bool = True):
        super().__init__()
        self.act = choice(act, "act", ACTIVATIONS)
        self.fc_in = nn.Linear(positive_int(d_model, "d_model"), positive_int(d_mlp, "d_mlp"), bias=bias)
        self.fc_out = nn.Linear(d_mlp, d_model, bias=bias)
        self.hook_pre, self.hook_post = HookPoint(), HookPoint()  # (B, N, d_mlp): before / after act

    def forward(self, x):
        return self.fc_out(self.hook_post(ACTIVATIONS[self.act](self.hook_pre(self.fc_in(x)))))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_mlp: int, *, act: str = "silu", bias: bool = False):
        super().__init__()
        self.act = choice(act, "act", ACTIVATIONS)
        self.d_mlp = positive_int(d_mlp, "d_mlp")
        self.gate_up = nn.Linear(positive_int(d_model, "d_model"), 2 * d_mlp, bias=bias)
        self.down = nn.Linear(d_mlp, d_model, bias=bias)
        #: (B, N, d_mlp) each: the gate before its activation, the up projection, act(gate) ⊙ up
        #: (TransformerLens' gated MLP: hook_pre, hook_pre_linear, hook_post)
        self.hook_pre, self.hook_pre_linear, self.hook_post = HookPoint(), HookPoint(), HookPoint()

    def forward(self, x):
        gate, up = self.gate_up(x).split(self.d_mlp, dim=-1)
        return self.down(self.hook_post(ACTIVATIONS[self.act](self.hook_pre(gate)) * self.hook_pre_linear(up)))
