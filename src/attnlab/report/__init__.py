"""A self-contained, offline HTML report (everything inlined; no network)."""

from attnlab.report.builder import Report

__all__ = ["Report"]
