"""For pytest only (``--doctest-modules`` collects ``src/attnlab``): skip the modules that
import triton.

Without the ``triton`` extra their import fails.  With it, importing them defines the
kernels, for the GPU or for the interpreter depending on ``TRITON_INTERPRET`` at that
moment, and tests/ops/triton/conftest.py must set it first.  They hold no doctests.
"""

collect_ignore = ["autograd.py", "backward.py", "forward.py", "jitlib.py"]
