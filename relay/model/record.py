"""Records: the house's value types, dataclasses whose generic methods are shared, not compiled per class.

Why not plain `@dataclass(frozen=True)`: Python 3.11 compiles six functions per frozen class with
`exec` (__init__, __repr__, __eq__, __hash__, __setattr__, __delattr__), about 0.39 ms a class on
this machine type. A launch creates about 50 classes, so some 15-20 ms of every launch (of about
57 ms of imports) went to compiling methods that do the same for every class. A record lets
dataclasses compile only __init__ (its signature and defaults are the class's own) and shares one
__eq__, __hash__, __repr__ and frozen guard, which read the class's field names, taken once: about
0.1 ms a class. (Python 3.13 compiles a class's methods in one go; this is not needed there, and
harmless.)

A record is a dataclass in every other respect: `dataclasses.fields`, `replace`, `asdict` and
`is_dataclass` work on it, `field(default_factory=...)` too. Equality and hashing are a frozen
dataclass's: same class, equal fields in order; the hash of the fields' tuple. The repr is the
dataclass's text.

The frozen guard: the compiled __init__ assigns each field once, through __setattr__, which takes a
field's first assignment and refuses every later one, and any name that is not a field: after
__init__, exactly what a frozen dataclass refuses (`dataclasses.FrozenInstanceError`).
"""

from __future__ import annotations

import dataclasses
import operator
import reprlib
import typing
from collections.abc import Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")


def _getter(names: tuple[str, ...]) -> Callable[[Any], tuple]:
    """The tuple of the named attributes, for any number of names (attrgetter returns a bare value for one)."""
    if not names:
        return lambda obj: ()
    if len(names) == 1:
        one = operator.attrgetter(names[0])
        return lambda obj: (one(obj),)
    return operator.attrgetter(*names)  # type: ignore[return-value]


def _eq(self: Any, other: Any) -> bool:
    if other.__class__ is not self.__class__:
        return NotImplemented
    compare = self.__class__.__record_compare__
    return compare(self) == compare(other)


def _hash(self: Any) -> int:
    return hash(self.__class__.__record_hash__(self))


@reprlib.recursive_repr()
def _repr(self: Any) -> str:
    cls = self.__class__
    return f"{cls.__qualname__}(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in cls.__record_repr__) + ")"


def _frozen_setattr(self: Any, name: str, value: Any) -> None:
    if name in self.__dict__ or name not in self.__class__.__record_fields__:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
    object.__setattr__(self, name, value)


def _frozen_delattr(self: Any, name: str) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


def _make(cls: type[T], frozen: bool) -> type[T]:
    cls = dataclasses.dataclass(cls, eq=False, repr=False)  # only __init__ is compiled
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    c: Any = cls
    c.__record_fields__ = frozenset(f.name for f in fields)
    c.__record_compare__ = _getter(tuple(f.name for f in fields if f.compare))
    c.__record_hash__ = _getter(tuple(f.name for f in fields if (f.compare if f.hash is None else f.hash)))
    c.__record_repr__ = tuple(f.name for f in fields if f.repr)
    c.__eq__ = _eq
    c.__repr__ = _repr
    if frozen:
        c.__hash__ = _hash
        c.__setattr__ = _frozen_setattr
        c.__delattr__ = _frozen_delattr
    else:
        c.__hash__ = None  # a mutable dataclass with __eq__ is unhashable, as here
    return cls


@overload
def record(cls: type[T], /) -> type[T]:
    ...


@overload
def record(*, frozen: bool = True) -> Callable[[type[T]], type[T]]:
    ...


@typing.dataclass_transform(frozen_default=True)
def record(cls: type[T] | None = None, /, *, frozen: bool = True) -> type[T] | Callable[[type[T]], type[T]]:
    """`@record`: a frozen dataclass; `@record(frozen=False)`: a mutable one (unhashable, as a
    dataclass with __eq__ is)."""
    if cls is not None:
        return _make(cls, frozen)
    return lambda c: _make(c, frozen)
