"""relay.model.record against the dataclass it stands for: the same equality, hash, repr, frozen
refusals and dataclasses helpers, with only __init__ compiled per class (relay/model/record.py)."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from dataclasses import dataclass, field

import pytest

from relay.model.record import record


@record
class Point:
    """A frozen record."""

    x: int
    y: str = "y"
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class PointDC:
    """Its dataclass twin."""

    x: int
    y: str = "y"
    tags: tuple[str, ...] = ()


@record(frozen=False)
class Bag:
    """A mutable record."""

    items: list[int] = field(default_factory=list)
    name: str = ""


@record
class Empty:
    """No fields."""


@record
class One:
    """One field: the hash is of a one-tuple, as a dataclass's."""

    v: int


def test_a_frozen_record_behaves_as_its_frozen_dataclass_twin() -> None:
    a, twin = Point(1, "b", ("t",)), PointDC(1, "b", ("t",))
    assert repr(a) == repr(twin).replace("PointDC", "Point")
    assert a == Point(1, "b", ("t",)) and a != Point(2, "b", ("t",)) and a != twin
    assert hash(a) == hash(twin) == hash(Point(1, "b", ("t",)))
    assert hash(One(3)) == hash(dataclass(frozen=True)(type("OneDC", (), {"__annotations__": {"v": "int"}}))(3))
    assert len({a, Point(1, "b", ("t",)), Point(1)}) == 2
    assert dataclasses.is_dataclass(a) and [f.name for f in dataclasses.fields(a)] == ["x", "y", "tags"]
    assert dataclasses.asdict(a) == dataclasses.asdict(twin)
    assert dataclasses.replace(a, y="c") == Point(1, "c", ("t",))
    assert copy.deepcopy(a) == a and pickle.loads(pickle.dumps(a)) == a
    assert Point.__match_args__ == ("x", "y", "tags")
    assert Empty() == Empty() and hash(Empty()) == hash(()) and repr(Empty()) == "Empty()"


def test_a_frozen_record_refuses_what_a_frozen_dataclass_refuses() -> None:
    a = Point(1)
    for attack in (lambda: setattr(a, "x", 2), lambda: setattr(a, "other", 1), lambda: delattr(a, "x"),
                   lambda: delattr(a, "y")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            attack()
    assert a == Point(1)
    with pytest.raises(TypeError):
        Point()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        hash(Point(1, "y", [1]))  # type: ignore[arg-type]  # an unhashable field, as a dataclass's


def test_a_mutable_record_is_a_mutable_dataclass() -> None:
    b = Bag()
    b.items.append(1)
    b.name = "n"
    assert b == Bag([1], "n") and Bag().items is not Bag().items
    assert repr(b) == "Bag(items=[1], name='n')"
    with pytest.raises(TypeError):
        hash(b)


def test_a_recursive_repr_ends() -> None:
    b = Bag()
    b.items.append(b)  # type: ignore[arg-type]
    assert repr(b) == "Bag(items=[...], name='')"


def test_the_records_own_helpers_match_the_stdlibs() -> None:
    from relay.model import record as rec

    a = Point(1, "b", ("t",))
    assert [f.name for f in rec.fields(a)] == [f.name for f in dataclasses.fields(PointDC)]
    assert rec.asdict(a) == dataclasses.asdict(PointDC(1, "b", ("t",)))
    assert rec.replace(a, y="c") == dataclasses.replace(a, y="c") == Point(1, "c", ("t",))
    with pytest.raises(TypeError):
        rec.replace(a, nope=1)
    nested = Bag([1], "n")
    assert rec.asdict(nested) == {"items": [1], "name": "n"} and rec.asdict(nested)["items"] is not nested.items
    with pytest.raises(TypeError):
        rec.asdict(Point)


def test_a_record_refuses_what_a_dataclass_refuses_at_definition() -> None:
    with pytest.raises(ValueError, match="mutable default"):
        record(type("Bad", (), {"__annotations__": {"items": "list"}, "items": []}))
    with pytest.raises(TypeError, match="non-default argument 'b' follows default argument"):
        record(type("Bad", (), {"__annotations__": {"a": "int", "b": "int"}, "a": 1}))


def test_the_launch_path_never_imports_dataclasses_and_its_refusals_still_name_frozen() -> None:
    """The reason records exist: a launch's modules load without dataclasses (and inspect, ast, dis);
    a frozen record's refusal is still an AttributeError that says so."""
    import subprocess
    import sys

    from .conftest import REPO

    script = """
import sys
import relay.commands.cli, relay.modes.runner, relay.modes.bwrap_runner, relay.egress.proxy, relay.ui.staged_exit
loaded = sorted(m for m in ("dataclasses", "inspect", "ast", "dis", "copy") if m in sys.modules)
from relay.model.mounts import Mount
from relay.model.vocab import MountKind
m = Mount(MountKind.RO_BIND, "/a", "/b")
try:
    m.dst = "/c"
except AttributeError as err:
    print("refused", type(err).__name__, err)
print("loaded", loaded)
"""
    out = subprocess.run([sys.executable, "-c", script], env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["refused _FrozenError cannot assign to field 'dst'", "loaded []"], out.stdout


def test_a_records_init_is_compiled_at_its_first_instance_and_subclasses_share_it() -> None:
    @record
    class Base:
        a: int
        b: str = "x"

    class Plain(Base):  # not a record: inherits the stand-in, which compiles Base's own __init__
        pass

    stand_in = Base.__dict__["__init__"]
    assert Plain(1) == Plain(1) and Plain(1).b == "x"
    assert Base.__dict__["__init__"] is not stand_in  # compiled once, in the stand-in's place
    assert Base(2, b="y") == Base(2, "y") and repr(Base(3)) == "test_a_records_init_is_compiled_at_its_first_instance_and_subclasses_share_it.<locals>.Base(a=3, b='x')"
    with pytest.raises(TypeError):
        Base()  # the real signature refuses a missing field
    with pytest.raises(TypeError):
        Base(1, "y", 3)

    @record
    class Child(Base):
        c: float = 0.5

    assert Child(1).c == 0.5 and Child(1, "z", 2.0) == Child(a=1, b="z", c=2.0)
