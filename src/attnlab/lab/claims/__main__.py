"""``python -m attnlab.lab.claims [IDS...] [--json PATH] [--list]`` (same as ``attnlab claims``)."""

import sys

from attnlab.lab.claims.registry import main

sys.exit(main())
