"""The trainers' tests run in `.venv-integrations` (`make test-integrations`).

Every module is still collected by the core run (tests/meta checks that); each one marks its
tests skipped there with ``needs(...)`` instead of importing the trainer at module level.
"""
