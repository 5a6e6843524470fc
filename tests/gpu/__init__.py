"""The GPU tier (a package, so its conftest does not displace tests/conftest.py as the module `conftest`)."""
