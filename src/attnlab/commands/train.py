"""``attnlab train``: train a small Decoder on CPU (progress bar, checkpoints, resume)."""

import sys

HELP = "train a small Decoder on CPU (progress bar, checkpoints, resume)"
SHARED = {"json": False}


def add_arguments(p):
    p.add_argument(
        "--task",
        default="induction",
        choices=("text", "induction", "recall"),
        help="what to learn: text (BPE on the standard library's source), induction (repeated "
        "random segments) or recall (associative recall); default induction",
    )
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--layers", type=int, default=2, help="layers (default 2)")
    p.add_argument("--d-model", type=int, default=128, help="model width (default 128)")
    p.add_argument("--heads", type=int, default=4, help="attention heads per layer (default 4)")
    p.add_argument(
        "--positions",
        default="rope",
        choices=("learned", "sinusoidal", "rope", "alibi", "none"),
        help="position scheme (default rope)",
    )
    p.add_argument("--attn-only", action="store_true", help="no MLPs, no norms (circuits-style)")
    p.add_argument("--seq-len", type=int, default=64, help="training sequence length (default 64)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--vocab", type=int, help="vocabulary (text: BPE size, default 512; tasks: 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the initialization (default 0)")
    p.add_argument("--out", metavar="DIR", help="checkpoint folder (safetensors)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")


def run(args) -> int:
    from attnlab.train import run as train_run

    try:
        train_run.main(
            task=args.task,
            steps=args.steps,
            layers=args.layers,
            d_model=args.d_model,
            heads=args.heads,
            positions=args.positions,
            seq_len=args.seq_len,
            batch=args.batch,
            lr=args.lr,
            vocab=args.vocab,
            seed=args.seed,
            out=args.out,
            resume=args.resume,
            attn_only=args.attn_only,
        )
    except ValueError as e:
        print(f"attnlab train: {e}", file=sys.stderr)
        return 2
    return 0
