"""What the tests share that is not a fixture: servers, processes, waits, captures.

Fixtures are in tests/conftest.py; these are plain modules, imported by name
(``from tests.support.tap import running_tap``), never from another test module.
"""
