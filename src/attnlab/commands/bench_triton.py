"""``attnlab bench triton``: the Triton kernels on a CUDA GPU — correctness, then TFLOP/s."""

HELP = "the Triton kernels on a CUDA GPU: correctness, then TFLOP/s vs SDPA and FlexAttention (exits 2 without a GPU)"
SHARED = {"quick": "N = 8k only"}


def add_arguments(p):
    p.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention (its compiles take time)")
    p.add_argument("--markdown", metavar="PATH", help="write the table for docs/benchmarks.md")


def run(args) -> int:
    from attnlab.bench import triton

    return triton.main(
        quick=args.quick,
        flex=not args.no_flex,
        json_path=args.json,
        markdown_path=args.markdown,
        argv=getattr(args, "_argv", ["bench", "triton"])[2:],
    )
