"""A reward module that fails while it is imported (tests/test_dataset.py)."""

raise ImportError("this module needs a package that is not installed")
