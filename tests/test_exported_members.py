"""``__all__`` is exactly the public surface, both ways (the way httpx's test_exported_members.py
checks its package): every name in ``__all__`` exists, and every public name a module defines
or re-exports is in ``__all__``.

A public name does not start with ``_`` and is not an imported module, a ``__future__``
feature, a typing helper or an object of another project (``Any``, ``Mapping``, torch's
``Dataset``...). A package facade (``__init__``) re-exports from its private modules, so any
object of this project counts; a plain module (``errors``, ``torch``) only counts what it
defines itself, since what it imports from its neighbours is for its own use.
"""

from __future__ import annotations
import __future__

import importlib
import inspect
import types
import typing

import pytest

PROJECT = "shmcache"
DUNDERS = {"__version__"}
"""Private-looking names a module may export on purpose."""
TYPING_HELPERS = {"TYPE_CHECKING"}

MODULES = [
    ("shmcache", None),
    ("shmcache.errors", None),
    ("shmcache.compat", None),
    ("shmcache.compat.sharearray", None),
    ("shmcache.client", "httpx"),
    ("shmcache.service", "fastapi"),
    ("shmcache.torch", "torch"),
]


def _is_alias(value: object) -> bool:
    """A type alias such as ``str | os.PathLike[str] | None`` or ``list[int]``."""
    return isinstance(value, (types.UnionType, types.GenericAlias)) or type(value).__module__ == "typing"


def public_names(module: types.ModuleType) -> set[str]:
    """The names ``module`` makes public, by the rules in this file's docstring."""
    is_package = hasattr(module, "__path__")
    names = set()
    for name, value in vars(module).items():
        if name.startswith("_") and name not in DUNDERS:
            continue
        if name in TYPING_HELPERS or _is_alias(value):
            continue
        if isinstance(value, (types.ModuleType, __future__._Feature)):
            continue
        home = getattr(value, "__module__", None)
        if home is not None and not isinstance(home, str):
            home = None  # e.g. a class's __module__ seen through a descriptor
        if home is not None:
            if home != PROJECT and not home.startswith(PROJECT + "."):
                continue  # imported from elsewhere (typing, collections.abc, torch...)
            if not is_package and home != module.__name__:
                continue  # a neighbour's object this module uses
        names.add(name)
    return names


def load(name: str, needs: str | None) -> types.ModuleType:
    if needs is not None:
        pytest.importorskip(needs)
    module = importlib.import_module(name)
    for exported in module.__all__:  # lazy modules (PEP 562) bind their names on first access
        getattr(module, exported, None)
    return module


@pytest.mark.parametrize(("name", "needs"), MODULES, ids=[name for name, _ in MODULES])
def test_all_is_exactly_the_public_names(name: str, needs: str | None) -> None:
    module = load(name, needs)
    exported = list(module.__all__)
    assert len(set(exported)) == len(exported), "a name is listed twice"
    missing = [n for n in exported if not hasattr(module, n)]
    assert missing == [], f"in __all__ but not defined: {missing}"
    public = public_names(module)
    not_exported = sorted(public - set(exported))
    assert not_exported == [], f"public but not in __all__: {not_exported} (export them or prefix _)"
    if hasattr(module, "__path__"):  # a facade: everything it lists is one of its public names
        assert set(exported) == public
    else:  # a module may also list names it re-exports on purpose
        assert public <= set(exported)


@pytest.mark.parametrize(("name", "needs"), MODULES, ids=[name for name, _ in MODULES])
def test_exported_classes_and_functions_are_documented(name: str, needs: str | None) -> None:
    module = load(name, needs)
    undocumented = [
        n
        for n in module.__all__
        if isinstance(value := getattr(module, n), (type, types.FunctionType)) and not value.__doc__
    ]
    assert undocumented == []


def test_the_rules_tell_imports_from_definitions() -> None:
    """The filter itself: imports and aliases are not public, definitions and constants are."""
    fake = types.ModuleType("shmcache.fake_module")
    exec(
        "from __future__ import annotations\n"
        "import os\n"
        "from typing import Any, TYPE_CHECKING\n"
        "from collections.abc import Mapping\n"
        "from shmcache.errors import ShmCacheError\n"
        "Alias = int | None\n"
        "LIMIT = 3\n"
        "class Thing: pass\n"
        "def act(): pass\n"
        "def _hidden(): pass\n",
        fake.__dict__,
    )
    assert public_names(fake) == {"LIMIT", "Thing", "act"}
    fake.__path__ = []  # as a package facade, re-exports of the project count too
    assert public_names(fake) == {"LIMIT", "Thing", "act", "ShmCacheError"}



def _classes_in(annotation: object) -> set[type]:
    found = {annotation} if isinstance(annotation, type) else set()
    for argument in typing.get_args(annotation):
        found |= _classes_in(argument)
    return found


def _public_namespace() -> dict[str, object]:
    project = importlib.import_module(PROJECT)
    return {name: getattr(project, name) for name in project.__all__}


def _returned_classes(owner: object) -> dict[str, set[type]]:
    """Public callable name -> this project's classes in its return annotation."""
    returned = {}
    for name, member in inspect.getmembers(owner):
        target = member.fget if isinstance(member, property) else member
        if name.startswith("_") or not callable(target) or isinstance(target, type):
            continue
        # Names a module imports for type checking only (the store, which the open path
        # must not load) are the public ones of that name.
        hint = typing.get_type_hints(target, localns=_public_namespace()).get("return")
        classes = {cls for cls in _classes_in(hint) if cls.__module__.split(".")[0] == PROJECT}
        if classes:
            returned[name] = classes
    return returned


@pytest.mark.parametrize(
    ("owner", "exported_by", "needs"),
    [
        ("shmcache", ("shmcache",), None),
        ("shmcache.Store", ("shmcache",), None),
        ("shmcache.client.Client", ("shmcache", "shmcache.client"), "httpx"),
    ],
)
def test_what_public_calls_return_is_exported(
    owner: str, exported_by: tuple[str, ...], needs: str | None
) -> None:
    """A user can name (import, annotate, isinstance) every class a public call hands back."""
    if needs is not None:
        pytest.importorskip(needs)
    module_name, _, attribute = owner.rpartition(".") if owner != PROJECT else (owner, "", "")
    target = importlib.import_module(module_name)
    if attribute:
        target = getattr(target, attribute)
    exported = set()
    for name in exported_by:
        module = importlib.import_module(name)
        exported |= {value for n in module.__all__ if isinstance(value := getattr(module, n), type)}
    hidden = {
        name: sorted(cls.__qualname__ for cls in classes - exported)
        for name, classes in _returned_classes(target).items()
        if classes - exported
    }
    assert hidden == {}
