"""A reward module that fails while it is imported (tests/unit/tasks/test_dataset_task.py)."""

raise ImportError("this module needs a package that is not installed")
