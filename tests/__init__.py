"""The test suite, laid out like the code (see tests/README.md). Every folder is a package, so a test
imports another test module or a helper by its full name (`from tests.helpers.wandb_offline import of_type`)
and two test files may share a basename without colliding."""
