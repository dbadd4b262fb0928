"""``attnlab inspect TEXT``: score every head of a model on a text; print the table, write a report."""

import sys

HELP = "score every head of a model on a text; print the table, write a report"
SHARED = {"json": False}


def add_arguments(p):
    p.add_argument("text", help="the text to read (tokenized by the model's own tokenizer)")
    p.add_argument("--model", default="minilm", help="'minilm' (default) or a checkpoint folder (bert/gpt2/llama)")
    p.add_argument("--out", default="out/inspect.html", help="the HTML report to write (default out/inspect.html)")


def run(args) -> int:
    from attnlab.lab.demo import inspect

    try:
        inspect(args.text, model_name=args.model, out=args.out)
    except ValueError as e:
        print(f"attnlab inspect: {e}", file=sys.stderr)
        return 2
    return 0
