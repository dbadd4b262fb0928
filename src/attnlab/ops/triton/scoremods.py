"""How a score mod reaches the Triton kernels (host side, torch only).

A Python callable cannot run inside a Triton kernel, so the built-in mods are compiled
in as constexpr variants of one pipeline, applied to the scaled score ``s`` in natural
units, in float32::

    s = scale · q·kᵀ
    s = c · tanh(s / c)                    SOFTCAP == 1   (softcap applied first)
    s = s + slopes[h] · (kv_pos − q_pos)   ALIBI == 1     (−slopes[h]·|kv_pos − q_pos| if ALIBI == 2)
    s = s + table[h, clip(kv_pos − q_pos, −R, R) + R]     RELBIAS
    s = c · tanh(s / c)                    SOFTCAP == 2   (softcap applied last)

which covers ``alibi``, ``softcap``, ``relative_bias`` and their ``compose`` (the two
biases commute; at most one of each, and a softcap either before all biases or after
all of them).  The backward differentiates the same pipeline in the kernel: the
gradient of the slopes is a per-program partial sum (reduced on the host, so it is
deterministic), the gradient of the relative-bias table an ``atomic_add`` per element.
``scores.custom`` and anything else raise a ValueError that names the mod and points
to ``backend='flash'``, which runs any mod.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ModSpec:
    alibi: int = 0  # 0 none, 1 slopes·(kv − q), 2 symmetric −slopes·|kv − q|
    slopes: torch.Tensor | None = None
    softcap: int = 0  # 0 none, 1 before the biases, 2 after them
    cap: float = 1.0
    relbias: bool = False
    table: torch.Tensor | None = None
    params: list = field(default_factory=list)  # the learnable tensors, autograd inputs

    @property
    def any(self) -> bool:
        return bool(self.alibi or self.softcap or self.relbias)


def _flatten(mod):
    t = type(mod)
    if t.__module__ == "attnlab.scores" and t.__name__ == "_Compose":
        return [m for sub in mod.mods for m in _flatten(sub)]
    return [mod]


def lower_score_mod(mod) -> ModSpec | str:
    """The mod as a :class:`ModSpec`, or a string saying why the kernels cannot run it."""
    spec = ModSpec()
    if mod is None:
        return spec
    seen_bias = False
    for m in _flatten(mod):
        t = type(m)
        name = t.__name__ if t.__module__ == "attnlab.scores" else None
        if name == "_Softcap":
            if spec.softcap:
                return f"two softcaps in {mod!r}"
            spec.softcap, spec.cap = (2 if seen_bias else 1), float(m.c)
        elif name in ("_Alibi", "_RelativeBias"):
            if spec.softcap == 2:
                return f"a bias after a softcap that follows a bias in {mod!r}"
            seen_bias = True
            if name == "_Alibi":
                if spec.alibi:
                    return f"two alibi mods in {mod!r}"
                spec.alibi, spec.slopes = (2 if m.symmetric else 1), m.slopes
            else:
                if spec.relbias:
                    return f"two relative_bias mods in {mod!r}"
                spec.relbias, spec.table = True, m.table
        else:
            return (
                f"score_mod {m!r} has no Triton lowering (the kernels compile alibi, softcap, "
                "relative_bias and their compose)"
            )
    for p in (spec.slopes, spec.table):
        if p is not None and p.requires_grad and not any(p is x for x in spec.params):
            spec.params.append(p)
    return spec
