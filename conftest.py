# The conformance plugin normally loads through its pytest11 entry point, i.e. before
# pytest-cov starts measuring, which would hide fabric_core's import-time lines from the
# coverage report. In this repository it is disabled on the command line (pyproject addopts)
# and loaded here instead, after coverage has started.
pytest_plugins = ["fabric_core.testing.plugin"]
