"""The test suite, laid out as the code is: core/, model/, runtime/, text/, entry/ (tl's layers),
kernels/, serve/, bench/, and test_layering.py here (the import rules of the whole tree).

Shared helpers live in tests/helpers/ (never in test modules) and are imported one way,
`from tests.helpers.x import y`; the repository root is pytest's only pythonpath. Data: golden/
(reference outputs) and templates/ (official chat templates). Fixtures: conftest.py.
"""
