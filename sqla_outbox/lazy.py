"""Re-exports imported on first use (PEP 562), for the ``__init__`` of a package.

A package whose ``__init__`` re-exports names from heavy modules (the root package's
``Catalog`` and ``install``, the relay's ``Relay`` and with it boto3) gives itself a module
``__getattr__`` and ``__dir__`` from :func:`attributes`; the names are then imported when
first read, so importing the package, or a light module inside it, stays cheap. For type
checkers the package imports the same names under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def attributes(
    package: str, exports: Mapping[str, str], public: Iterable[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``.

    Args:
        package: The package's ``__name__``.
        exports: ``name -> module`` for each re-exported name: ``package.name`` is
            ``module.name``, imported on first use and then kept in the package's namespace.
        public: The names :func:`dir` lists besides those already set (the package's
            ``__all__``).

    Returns:
        ``(__getattr__, __dir__)``. Any other name is read as a submodule
        (``package.name``, imported on first use).

    Raises:
        AttributeError: From ``__getattr__``, when the name is neither exported nor a
            submodule.
    """
    listed = frozenset(public)

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
            setattr(sys.modules[package], name, value)
            return value
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{package}.{name}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | listed)

    return __getattr__, __dir__
