"""Benchmarks that ``attnlab bench`` runs.  Each compares against its anchors in one run."""
