"""Tests of the README and the documentation site: every code block runs (``snippets.py``)."""
