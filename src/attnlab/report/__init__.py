"""A self-contained, offline HTML report (everything inlined; no network)."""
