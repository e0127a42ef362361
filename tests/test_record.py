"""lazytriton.record: frozen slotted records behave like frozen dataclasses and cost little to define."""

from __future__ import annotations

import copy
import pickle
import time
import typing
from typing import Any, ClassVar

import pytest
from conftest import run_python

from lazytriton.record import FrozenRecordError, NamedTuple, asdict, field, fields, record, replace


@record
class Inner:
    name: str
    size: int = 0


@record
class Outer:
    """An outer record."""

    LIMIT: ClassVar[int] = 3
    inner: Inner
    items: tuple[int, ...]
    blob: bytes = field(default=b"", repr=False)
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.items) > self.LIMIT:
            raise ValueError(f"items: at most {self.LIMIT}")

    @property
    def total(self) -> int:
        return sum(self.items)


def make() -> Outer:
    return Outer(Inner("a", 2), (1, 2), blob=b"xyz", tags=["t"])


def test_construction_defaults_and_factories() -> None:
    first, second = Outer(Inner("a"), ()), Outer(Inner("a"), ())
    assert first.blob == b"" and first.tags == [] and first.inner.size == 0
    assert first.tags is not second.tags  # a fresh default per instance
    assert make().total == 3 and Outer.__doc__ == "An outer record." and Outer.LIMIT == 3


def test_argument_errors_are_type_errors_naming_the_argument() -> None:
    with pytest.raises(TypeError, match="missing required argument: 'items'"):
        Outer(Inner("a"))  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        Inner("a", colour=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="multiple values for argument 'name'"):
        Inner("a", name="b")  # type: ignore[misc]
    with pytest.raises(TypeError, match="takes 2 positional arguments but 3"):
        Inner("a", 1, 2)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="items: at most 3"):
        Outer(Inner("a"), (1, 2, 3, 4))


def test_frozen_and_slotted() -> None:
    value = make()
    with pytest.raises(FrozenRecordError, match="'items'"):
        value.items = ()  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del value.inner  # type: ignore[misc]
    with pytest.raises(AttributeError):
        value.other = 1  # type: ignore[attr-defined]
    assert not hasattr(value, "__dict__") and Outer.__slots__ == ("inner", "items", "blob", "tags")


def test_equality_hash_and_repr() -> None:
    assert make() == make() and make() != replace(make(), blob=b"")
    assert Inner("a", 1) != ("a", 1) and hash(Inner("a", 1)) == hash(Inner("a", 1))
    assert len({Inner("a", 1), Inner("a", 1), Inner("b", 1)}) == 2

    @record
    class Twin:
        name: str
        size: int = 0

    assert Twin("a", 1) != Inner("a", 1)  # same fields, different class
    assert repr(make()) == "Outer(inner=Inner(name='a', size=2), items=(1, 2), tags=['t'])"  # blob: repr=False


def test_replace_fields_asdict() -> None:
    value = make()
    changed = replace(value, items=(5,))
    assert changed.items == (5,) and changed.inner is value.inner and value.items == (1, 2)
    with pytest.raises(ValueError, match="at most"):
        replace(value, items=(1, 2, 3, 4))  # __post_init__ runs again
    with pytest.raises(TypeError, match="no field 'colour'"):
        replace(value, colour=1)
    expected = [("inner", "Inner"), ("items", "tuple[int, ...]"), ("blob", "bytes"), ("tags", "list[str]")]
    assert [(f.name, f.type) for f in fields(Outer)] == [(f.name, f.type) for f in fields(value)] == expected
    assert [f.repr for f in fields(Outer)] == [True, True, False, True]
    assert asdict(value) == {"inner": {"name": "a", "size": 2}, "items": (1, 2), "blob": b"xyz", "tags": ["t"]}
    with pytest.raises(TypeError, match="record class or instance"):
        fields(object())


def test_pickle_and_copy_round_trip() -> None:
    value = make()
    for copied in (pickle.loads(pickle.dumps(value)), copy.copy(value), copy.deepcopy(value)):
        assert copied == value and type(copied) is Outer


def test_bad_definitions() -> None:
    with pytest.raises(TypeError, match="non-default field 'b' follows a default field"):
        @record
        class Bad:
            a: int = 0
            b: int
    with pytest.raises(ValueError, match="default or default_factory"):
        field(default=1, default_factory=int)


def test_defining_a_record_is_cheap() -> None:
    """The reason this module exists: a record class costs microseconds to define, not a dataclass's ~0.7 ms."""
    def define() -> None:
        @record
        class Many:
            a: int
            b: str
            c: float = 1.0
            d: bytes = field(default=b"", repr=False)

    best = min(_seconds(define) for _ in range(5))
    assert best < 300e-6, f"defining a record took {best * 1e6:.0f} µs"


def _seconds(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def test_the_launch_path_defines_no_dataclass_and_skips_the_cffi_package() -> None:
    """What the cold start (13.6 ms on the H200) depends on: nothing on a cache-served call's path pays for these."""
    code = ("import sys\n"
            "import lazytriton.runtime, lazytriton.kernels.dispatch, lazytriton.driver.gpu, lazytriton.store.image\n"
            "import lazytriton.tuning, lazytriton.config, lazytriton.cache_format\n"
            "from lazytriton.driver import cdefs\n"
            "cdefs.make_ffi('cuda', cdefs.CUDA_CDEF)\n"
            "print(sorted(m for m in ('dataclasses', 'cffi', 'triton', 'diskcache', 'sqlite3') if m in sys.modules))")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- NamedTuple: typing.NamedTuple's class, without evaluating the annotations ------------------------------------


class Span(NamedTuple):
    """A span of rows."""

    start: int
    stop: int
    label: str | None = None
    weight: float = 1.0

    @property
    def size(self) -> int:
        return self.stop - self.start

    def shifted(self, by: int) -> Span:
        return self._replace(start=self.start + by, stop=self.stop + by)


class TypingSpan(typing.NamedTuple):
    """A span of rows."""

    start: int
    stop: int
    label: str | None = None
    weight: float = 1.0


def test_named_tuple_gives_typing_named_tuples_class() -> None:
    span = Span(2, 5, label="a")
    twin = TypingSpan(2, 5, label="a")
    assert span == twin == (2, 5, "a", 1.0) and isinstance(span, tuple)
    assert repr(span) == repr(twin).replace("TypingSpan", "Span")
    for name in ("_fields", "_field_defaults", "__doc__", "__module__", "__match_args__"):
        assert getattr(Span, name) == getattr(TypingSpan, name), name
    # The annotations as written (typing's are ForwardRefs of the same text): get_type_hints reads both alike.
    assert Span.__annotations__ == {name: ref.__forward_arg__ for name, ref in TypingSpan.__annotations__.items()}
    assert typing.get_type_hints(Span) == typing.get_type_hints(TypingSpan)
    assert Span.__qualname__ == "Span" and span.size == 3 and span.shifted(1) == (3, 6, "a", 1.0)
    assert Span._make([0, 1, None, 2.0]) == (0, 1, None, 2.0) and span._asdict() == twin._asdict()
    assert pickle.loads(pickle.dumps(span)) == span and copy.deepcopy(span) == span
    match span:
        case Span(start, stop):
            assert (start, stop) == (2, 5)
    with pytest.raises(AttributeError):
        span.start = 3  # type: ignore[misc]


def test_named_tuple_refuses_what_typing_refuses() -> None:
    def define(body: str) -> Any:
        scope: dict[str, Any] = {"NamedTuple": NamedTuple, "__name__": "m"}
        exec(f"class Bad(NamedTuple):\n{body}", scope)
        return scope["Bad"]

    with pytest.raises(TypeError, match="Non-default namedtuple field b cannot follow default field a"):
        define("    a: int = 1\n    b: int\n")
    with pytest.raises(AttributeError, match="Cannot overwrite NamedTuple attribute _asdict"):
        define("    a: int\n    def _asdict(self): return {}\n")
    with pytest.raises(TypeError, match="derives from NamedTuple alone"):
        exec("class Both(NamedTuple, int):\n    a: int\n", {"NamedTuple": NamedTuple, "__name__": "m"})


def test_named_tuple_compiles_no_annotation() -> None:
    """The reason it exists: typing.NamedTuple compiles each annotation (a ForwardRef); this compiles none."""
    code = ("from __future__ import annotations\n"
            "import builtins\n"
            "from lazytriton.record import NamedTuple\n"
            "compiled = []\n"
            "real = builtins.compile\n"
            "builtins.compile = lambda *a, **k: compiled.append(a[0]) or real(*a, **k)\n"
            "class Wide(NamedTuple):\n"
            "    a: int\n    b: str | None\n    c: tuple[int, ...] = ()\n"
            "print([text for text in compiled if text in ('int', 'str | None', 'tuple[int, ...]')])")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
