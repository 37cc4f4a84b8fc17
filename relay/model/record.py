"""Records: the house's value types. A dataclass's behaviour, without importing or running dataclasses.

Why not `@dataclass(frozen=True)`: on Python 3.11 a launch paid twice for it.
- Compiling: dataclasses compiles six functions per frozen class with `exec` (__init__, __repr__,
  __eq__, __hash__, __setattr__, __delattr__), about 0.39 ms a class here, and a launch creates about
  50 classes: some 15-20 ms of every launch went to methods that do the same for every class.
- Importing: `dataclasses` imports `inspect`, and with it `ast`, `dis`, `tokenize` and `copy`, which
  nothing else on the launch path needs: about 8 ms under `-X importtime`.

A record compiles only its __init__ (one `exec`, at its first instance: its signature and defaults
are the class's own) and shares one __eq__, __hash__, __repr__ and frozen guard, which read the class's field names, taken
once: about 0.1 ms a class. What it keeps of a dataclass:
- `field(default=...)` and `field(default_factory=...)`; a mutable default is refused, a field
  without a default after one with a default is refused;
- equality (same class, equal fields in order), the hash of the fields' tuple, the dataclass's repr
  text, `__match_args__`, `dataclasses.FrozenInstanceError`'s refusals (raised as that class once
  `dataclasses` is loaded, else as an AttributeError subclass of our own);
- `fields`, `replace` and `asdict` here; and the stdlib's `dataclasses.fields`, `replace`, `asdict`
  and `is_dataclass` too (tests use them): a record's `__dataclass_fields__` is made on first use,
  from a dataclass twin of its fields, so only a caller that already imported dataclasses pays.
Not supported (nothing uses them): ClassVar and InitVar fields, __post_init__, keyword-only fields,
order, slots.
"""

from __future__ import annotations

import reprlib
import sys
import typing
from collections.abc import Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")


class _Missing:
    def __repr__(self) -> str:
        return "<no default>"


MISSING: Any = _Missing()


class Field:
    """One field of a record: its name, and its default or the factory that makes one."""

    __slots__ = ("name", "default", "default_factory")

    def __init__(self, default: Any = MISSING, default_factory: Any = MISSING) -> None:
        if default is not MISSING and default_factory is not MISSING:
            raise ValueError("cannot give both default and default_factory")
        self.name = ""
        self.default = default
        self.default_factory = default_factory

    def __repr__(self) -> str:
        return f"Field(name={self.name!r}, default={self.default!r}, default_factory={self.default_factory!r})"


def field(*, default: Any = MISSING, default_factory: Any = MISSING) -> Any:
    """A field's default, as `dataclasses.field` takes it."""
    return Field(default, default_factory)


class _FrozenError(AttributeError):
    """Raised where a frozen dataclass raises dataclasses.FrozenInstanceError, when that is not loaded."""


def _frozen_error(message: str) -> AttributeError:
    dc = sys.modules.get("dataclasses")  # if it is loaded, the stdlib's own class (what tests catch)
    return dc.FrozenInstanceError(message) if dc is not None else _FrozenError(message)


def _getter(names: tuple[str, ...]) -> Callable[[Any], tuple]:
    """The tuple of the named attributes, for any number of names (attrgetter returns a bare value for one)."""
    from operator import attrgetter

    if not names:
        return lambda obj: ()
    if len(names) == 1:
        one = attrgetter(names[0])
        return lambda obj: (one(obj),)
    return attrgetter(*names)  # type: ignore[return-value]


def _eq(self: Any, other: Any) -> bool:
    if other.__class__ is not self.__class__:
        return NotImplemented
    values = self.__class__.__record_values__
    return values(self) == values(other)


def _hash(self: Any) -> int:
    return hash(self.__class__.__record_values__(self))


@reprlib.recursive_repr()
def _repr(self: Any) -> str:
    cls = self.__class__
    return f"{cls.__qualname__}(" + ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in cls.__record_fields__) + ")"


def _frozen_setattr(self: Any, name: str, value: Any) -> None:
    raise _frozen_error(f"cannot assign to field {name!r}")


def _frozen_delattr(self: Any, name: str) -> None:
    raise _frozen_error(f"cannot delete field {name!r}")


class _DataclassFields:
    """`__dataclass_fields__` on first use: the stdlib's Field objects, from a dataclass twin made of
    the record's annotations and defaults, so that `dataclasses.replace` and friends work on records."""

    def __get__(self, obj: Any, cls: type) -> dict[str, Any]:
        import dataclasses

        ns: dict[str, Any] = {"__annotations__": {f.name: cls.__annotations__.get(f.name, Any)
                                                 for f in cls.__record_fields__}}
        for f in cls.__record_fields__:
            if f.default is not MISSING:
                ns[f.name] = f.default
            elif f.default_factory is not MISSING:
                ns[f.name] = dataclasses.field(default_factory=f.default_factory)
        twin = dataclasses.dataclass(type(cls.__name__, (), ns))
        found = twin.__dataclass_fields__  # type: ignore[attr-defined]
        type.__setattr__(cls, "__dataclass_fields__", found)
        return found


def _fields_of(cls: type) -> list[Field]:
    """The record's fields in order: the bases' records' first (as dataclasses orders them), then its own."""
    found: dict[str, Field] = {}
    for base in reversed(cls.__mro__[1:]):
        for f in base.__dict__.get("__record_fields__", ()):
            found[f.name] = f
    for name in cls.__dict__.get("__annotations__", {}):
        value = _ours(cls.__dict__.get(name, MISSING))
        f = value if isinstance(value, Field) else Field(default=value)
        if isinstance(f.default, (list, dict, set)):
            raise ValueError(f"mutable default {type(f.default)} for field {name} is not allowed: use default_factory")
        f.name = name
        found[name] = f
        if isinstance(value, Field):  # the class attribute is the default, as dataclasses leaves it, or nothing
            if f.default is MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, f.default)
    return list(found.values())


def _ours(value: Any) -> Any:
    """A `dataclasses.field(...)` given to a record, as our Field (the stdlib's only if it is loaded)."""
    dc = sys.modules.get("dataclasses")
    if dc is None or not isinstance(value, dc.Field):
        return value
    def mine(v: Any) -> Any:
        return MISSING if v is dc.MISSING else v
    return Field(mine(value.default), mine(value.default_factory))


def _check_order(fields: list[Field]) -> None:
    """A field without a default after one with a default is refused when the class is made, as a
    dataclass refuses it (its __init__ is compiled only later, at first use)."""
    seen_default = False
    for f in fields:
        if f.default is not MISSING or f.default_factory is not MISSING:
            seen_default = True
        elif seen_default:
            raise TypeError(f"non-default argument {f.name!r} follows default argument")


def _lazy_init(cls: type, fields: list[Field], frozen: bool) -> Callable[..., None]:
    """A stand-in __init__ that compiles the real one at the class's first instance and puts it in
    its place: a launch defines ~80 records and makes instances of half of them, and the `exec` of
    each __init__ was the larger part of a record's cost."""
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        real = cls.__dict__["__init__"]
        if real is __init__:
            real = _init(cls, fields, frozen)
            type.__setattr__(cls, "__init__", real)
        real(self, *args, **kwargs)

    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    return __init__


def _init(cls: type, fields: list[Field], frozen: bool) -> Callable[..., None]:
    """The record's __init__, compiled once: each field's parameter with its default, each assigned once."""
    ns: dict[str, Any] = {"__MISSING": MISSING, "__set": object.__setattr__}
    params, body, seen_default = [], [], False
    for i, f in enumerate(fields):
        if f.default is not MISSING:
            ns[f"__d{i}"] = f.default
            params.append(f"{f.name}=__d{i}")
            value = f.name
            seen_default = True
        elif f.default_factory is not MISSING:
            ns[f"__f{i}"] = f.default_factory
            params.append(f"{f.name}=__MISSING")
            value = f"__f{i}() if {f.name} is __MISSING else {f.name}"
            seen_default = True
        else:
            if seen_default:
                raise TypeError(f"non-default argument {f.name!r} follows default argument")
            params.append(f.name)
            value = f.name
        body.append(f"__set(self, {f.name!r}, {value})" if frozen else f"self.{f.name} = {value}")
    src = f"def __init__(self, {', '.join(params)}):\n    " + ("\n    ".join(body) or "pass") + "\n"
    exec(src, ns)  # noqa: S102 - our own text, made of the class's field names (identifiers)
    init = ns["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    return init


def _make(cls: type[T], frozen: bool) -> type[T]:
    fields = _fields_of(cls)
    for f in fields:
        if not f.name.isidentifier():
            raise TypeError(f"field name {f.name!r} is not an identifier")
    c: Any = cls
    c.__record_fields__ = tuple(fields)
    c.__record_values__ = _getter(tuple(f.name for f in fields))
    c.__match_args__ = tuple(f.name for f in fields)
    _check_order(fields)
    c.__init__ = _lazy_init(cls, fields, frozen)
    c.__eq__ = _eq
    c.__repr__ = _repr
    c.__dataclass_fields__ = _DataclassFields()
    if frozen:
        c.__hash__ = _hash
        c.__setattr__ = _frozen_setattr
        c.__delattr__ = _frozen_delattr
    else:
        c.__hash__ = None  # a mutable class with __eq__ is unhashable, as a dataclass is
    return cls


@overload
def record(cls: type[T], /) -> type[T]:
    ...


@overload
def record(*, frozen: bool = True) -> Callable[[type[T]], type[T]]:
    ...


@typing.dataclass_transform(frozen_default=True, field_specifiers=(field,))
def record(cls: type[T] | None = None, /, *, frozen: bool = True) -> type[T] | Callable[[type[T]], type[T]]:
    """`@record`: a frozen record; `@record(frozen=False)`: a mutable one (unhashable)."""
    if cls is not None:
        return _make(cls, frozen)
    return lambda c: _make(c, frozen)


def _instance(obj: Any) -> bool:
    """Whether OBJ is a record instance (a record class's own type is `type`, which has no fields)."""
    return hasattr(type(obj), "__record_fields__")


def fields(obj: Any) -> tuple[Field, ...]:
    """The fields of a record (class or instance), in order."""
    try:
        return (obj if isinstance(obj, type) else type(obj)).__record_fields__
    except AttributeError:
        raise TypeError(f"{obj!r} is not a record") from None


def replace(obj: T, /, **changes: Any) -> T:
    """A copy of the record OBJ with CHANGES, made through its __init__ (defaults are not re-made)."""
    names = {f.name for f in fields(obj)}
    unknown = set(changes) - names
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field {sorted(unknown)[0]!r}")
    values = {name: getattr(obj, name) for name in names}
    values.update(changes)
    return type(obj)(**values)


def asdict(obj: Any) -> dict[str, Any]:
    """The record as nested plain data: records become dicts; lists, tuples and dicts are copied."""
    if not _instance(obj):
        raise TypeError("asdict() should be called on record instances")
    return _plain(obj)


def _plain(value: Any) -> Any:
    if _instance(value):
        return {f.name: _plain(getattr(value, f.name)) for f in type(value).__record_fields__}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple, as dataclasses keeps it
        return type(value)(*[_plain(v) for v in value])
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return type(value)((_plain(k), _plain(v)) for k, v in value.items())
    return value

