"""``attnlab bench tiles``: the flash backend's tile sizes per dtype and head dim."""

HELP = "measure the flash backend's tile sizes per dtype and head dim"
SHARED: dict[str, object] = {}


def add_arguments(p):
    pass


def run(args) -> int:
    from attnlab.bench import tiles

    tiles.main(json_path=args.json)
    return 0
