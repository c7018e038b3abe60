"""A pytest plugin for the conformance kit.

Enable it in a ``conftest.py`` with
``pytest_plugins = ["kvrunner.testing.conformance.pytest_plugin"]`` (or ``-p
kvrunner.testing.conformance.pytest_plugin``).

Gives a ``backend_conformance`` fixture, a function ``(backend, check=None)`` that
runs one check (or all that apply, :func:`~kvrunner.testing.conformance.not_run_because`)
on every layer type the installed backend serves, and the
option ``--kvrunner-examples N`` (cases per check, default 8).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvrunner.testing.conformance import CHECKS, Target, not_run_because, run_check


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--kvrunner-examples", type=int, default=8,
                     help="hypothesis cases per conformance check")


@pytest.fixture
def backend_conformance(request: pytest.FixtureRequest) -> Callable[..., None]:
    examples = request.config.getoption("--kvrunner-examples")

    def check(backend: str, check: str | None = None, *, use_triton: bool = False,
              device: str = "cpu") -> None:
        for target in Target.of(backend, use_triton=use_triton, device=device):
            names = [check] if check else [
                c for c in CHECKS if not_run_because(target, c) is None
            ]
            for name in names:
                run_check(target, name, max_examples=examples)

    return check
