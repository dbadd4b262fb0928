"""``attnlab lab sinks``: where the pretrained MiniLM parks its attention."""

HELP = "attention sinks in the pretrained MiniLM: mass on [CLS]/[SEP], raw and weighted by the values read"
RUNTIME = "about 20 s"
SHARED: dict[str, object] = {}


def add_arguments(p):
    pass


def run(args) -> int:
    from attnlab.commands.options import write_json
    from attnlab.lab import sinks

    res = sinks.run()
    print(sinks.summary(res))
    write_json(args.json, res)
    return 0
