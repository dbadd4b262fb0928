"""``attnlab lab hopfield``: the capacity of one attention read as a modern Hopfield update."""

HELP = "Hopfield capacity: one attention read retrieves far more patterns than the classical 0.138·d"
RUNTIME = "about 10 s, most of it starting torch"
SHARED: dict[str, object] = {}


def add_arguments(p):
    pass


def run(args) -> int:
    from attnlab.commands.options import write_json
    from attnlab.lab import hopfield

    res = hopfield.run()
    print(hopfield.summary(res))
    write_json(args.json, res)
    return 0
