"""Test support that ships with kvrunner.

- :mod:`.conformance`: the conformance kit every backend proves itself with;
- :mod:`.harness`: a real ``BackendManager`` around a small model shape;
- :mod:`.steps`: a ``StepInput`` built row by row;
- :mod:`.model_parity`: cache-free attention for model parity tests.
"""
