"""Frozen value records: ``@dataclass(frozen=True, slots=True)`` without its import-time cost.

``dataclasses`` writes each class's ``__init__``, ``__repr__``, ``__eq__``,
``__hash__``, ``__setattr__`` and ``__delattr__`` as source text and compiles
it with ``exec`` when the class is defined: about 0.66 ms per class on the
2-core development machine, about twice that on the H200 host. The eleven
records a cache-served call imports cost 11 of the 19 ms that
``import lazytriton.flash`` took there (cProfile), and the cold-start target
is 50 ms in all. ``@record`` builds the same methods from closures made once
per class, with nothing to compile: about 20 µs a class.

What a record gives (the subset of dataclasses this package uses):
fields from the class's own annotations, in order (``ClassVar`` ones skipped;
no inheritance of fields); defaults, ``field(default=, default_factory=,
repr=)``; ``__post_init__``; keyword or positional construction; frozen
(``FrozenRecordError``, an ``AttributeError``, on assignment); ``__slots__``;
equality and hash over the fields (records of different classes are never
equal); a repr like dataclasses'; pickling; and ``replace``, ``fields`` and
``asdict``. Type checkers see records as frozen dataclasses
(``typing.dataclass_transform``, new in Python 3.11; on 3.10 the decorator is
a no-op at run time, which is all it ever is there).

``NamedTuple`` is ``typing.NamedTuple`` for a class statement
(``class Call(NamedTuple): ...``), made without evaluating its annotations:
typing's compiles each field's annotation string into a ``ForwardRef`` (40
compiles for the five tuples a cache-served call imports; 0.25 ms a class
against 0.09 for ``collections.namedtuple`` on the 2-core development
machine). The class is ``collections.namedtuple``'s, with the annotations as
written, the defaults, the docstring and the methods of the class body; type
checkers see ``typing.NamedTuple`` itself.
"""

from __future__ import annotations

import collections
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, overload

T = TypeVar("T")

if TYPE_CHECKING:
    from typing import NamedTuple as NamedTuple
    from typing import dataclass_transform
else:  # run time: the marker only sets __dataclass_transform__, which only type checkers read
    def _no_transform(**_: Any) -> Callable[[T], T]:
        return lambda decorated: decorated

    dataclass_transform = getattr(typing, "dataclass_transform", _no_transform)

_MISSING: Any = object()
_set = object.__setattr__


class FrozenRecordError(AttributeError):
    """An assignment to, or deletion of, a record's field."""


class _FieldSpec:
    __slots__ = ("default", "default_factory", "repr")

    def __init__(self, default: Any, default_factory: Any, repr: bool) -> None:
        self.default, self.default_factory, self.repr = default, default_factory, repr


if TYPE_CHECKING:
    class Field(NamedTuple):
        """One field of a record class, as ``fields`` reports it."""

        name: str
        type: str  # the annotation as written (every module here uses ``from __future__ import annotations``)
        default: Any
        default_factory: Any
        repr: bool
else:  # the same tuple type, made without typing.NamedTuple: 0.06 ms at import, not 0.2 (its annotations compile)
    Field = collections.namedtuple("Field", ("name", "type", "default", "default_factory", "repr"))
    Field.__doc__ = "One field of a record class, as ``fields`` reports it."

# What a NamedTuple class body may not set, and what it sets that is not copied onto the class (typing's lists).
_NAMED_TUPLE_RESERVED = frozenset({"__new__", "__init__", "__slots__", "__getnewargs__", "_fields",
                                   "_field_defaults", "_make", "_replace", "_asdict", "_source"})
_NAMED_TUPLE_SPECIAL = frozenset({"__module__", "__name__", "__annotations__"})


def _named_tuple(name: str, namespace: dict[str, Any]) -> type:
    """The ``collections.namedtuple`` class of a ``class name(NamedTuple)`` body."""
    annotations = dict(namespace.get("__annotations__", {}))
    defaulted = [field_name for field_name in annotations if field_name in namespace]
    for field_name in list(annotations)[len(annotations) - len(defaulted):]:
        if field_name not in namespace:
            raise TypeError(f"Non-default namedtuple field {field_name} cannot follow default field"
                            f"{'s' if len(defaulted) > 1 else ''} {', '.join(defaulted)}")
    defaults = [namespace[field_name] for field_name in defaulted]
    make: Callable[..., Any] = collections.namedtuple  # its defaults from a list: not the literal mypy reads
    made: type = make(name, tuple(annotations), defaults=defaults, module=namespace["__module__"])
    made.__annotations__ = annotations
    for key, value in namespace.items():
        if key in _NAMED_TUPLE_RESERVED:
            raise AttributeError(f"Cannot overwrite NamedTuple attribute {key}")
        if key not in _NAMED_TUPLE_SPECIAL and key not in annotations:
            setattr(made, key, value)
    return made


if not TYPE_CHECKING:
    class _NamedTupleMeta(type):
        def __new__(cls, name: str, bases: tuple[type, ...], namespace: dict[str, Any]) -> type:
            if bases != (NamedTuple,):
                raise TypeError(f"{name}: a NamedTuple class derives from NamedTuple alone")
            return _named_tuple(name, namespace)

    NamedTuple = type.__new__(_NamedTupleMeta, "NamedTuple", (), {
        "__module__": __name__, "__doc__": "Base of a named tuple class: typing.NamedTuple, without its import cost."})


@overload
def field(*, default: T, repr: bool = True) -> T: ...
@overload
def field(*, default_factory: Callable[[], T], repr: bool = True) -> T: ...
@overload
def field(*, repr: bool = True) -> Any: ...
def field(*, default: Any = _MISSING, default_factory: Any = _MISSING, repr: bool = True) -> Any:
    """A field's default (or default factory) and whether ``repr`` shows it."""
    if default is not _MISSING and default_factory is not _MISSING:
        raise ValueError("field() takes default or default_factory, not both")
    return _FieldSpec(default, default_factory, repr)


def _collect(cls: type) -> tuple[Field, ...]:
    out = []
    for name, annotation in cls.__dict__.get("__annotations__", {}).items():
        text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
        if text.startswith(("ClassVar", "typing.ClassVar")):
            continue
        value = cls.__dict__.get(name, _MISSING)
        if isinstance(value, _FieldSpec):
            out.append(Field(name, text, value.default, value.default_factory, value.repr))
        else:
            out.append(Field(name, text, value, _MISSING, True))
    seen_default = False
    for f in out:
        has_default = f.default is not _MISSING or f.default_factory is not _MISSING
        if seen_default and not has_default:
            raise TypeError(f"{cls.__name__}: non-default field {f.name!r} follows a default field")
        seen_default = seen_default or has_default
    return tuple(out)


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def record(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen, slotted record of its annotated fields (see the module docstring)."""
    specs = _collect(cls)
    names = tuple(f.name for f in specs)
    shown = tuple(f.name for f in specs if f.repr)
    n = len(names)
    defaults = {f.name: f.default for f in specs if f.default is not _MISSING}
    factories = {f.name: f.default_factory for f in specs if f.default_factory is not _MISSING}
    post_init = getattr(cls, "__post_init__", None)
    title = cls.__qualname__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > n:
            raise TypeError(f"{title}() takes {n} positional arguments but {len(args)} were given")
        for name, value in zip(names, args, strict=False):  # fewer args than names: the rest below
            _set(self, name, value)
        for name in names[len(args):]:
            if name in kwargs:
                _set(self, name, kwargs.pop(name))
            elif name in defaults:
                _set(self, name, defaults[name])
            elif name in factories:
                _set(self, name, factories[name]())
            else:
                raise TypeError(f"{title}() missing required argument: {name!r}")
        if kwargs:
            extra = next(iter(kwargs))
            why = "got multiple values for argument" if extra in names else "got an unexpected keyword argument"
            raise TypeError(f"{title}() {why} {extra!r}")
        if post_init is not None:
            post_init(self)

    def values(self: Any) -> tuple[Any, ...]:
        return tuple([getattr(self, name) for name in names])

    def __eq__(self: Any, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return values(self) == values(other)

    def __hash__(self: Any) -> int:
        return hash(values(self))

    def __repr__(self: Any) -> str:
        return f"{title}({', '.join(f'{name}={getattr(self, name)!r}' for name in shown)})"

    def __setattr__(self: Any, name: str, value: Any) -> None:
        raise FrozenRecordError(f"cannot assign to field {name!r} of {title}: records are frozen")

    def __delattr__(self: Any, name: str) -> None:
        raise FrozenRecordError(f"cannot delete field {name!r} of {title}: records are frozen")

    def __reduce__(self: Any) -> tuple[Any, tuple[Any, ...]]:
        return (self.__class__, values(self))

    namespace = {key: value for key, value in cls.__dict__.items()
                 if key not in names and key not in ("__dict__", "__weakref__")}
    namespace.update(__slots__=names, __match_args__=names, __record_fields__=specs, __init__=__init__,
                     __eq__=__eq__, __hash__=__hash__, __repr__=__repr__, __setattr__=__setattr__,
                     __delattr__=__delattr__, __reduce__=__reduce__)
    for name, function in (("__init__", __init__), ("__eq__", __eq__), ("__hash__", __hash__),
                           ("__repr__", __repr__), ("__setattr__", __setattr__), ("__delattr__", __delattr__),
                           ("__reduce__", __reduce__)):
        function.__qualname__ = f"{title}.{name}"
    metaclass: Any = type(cls)
    made: type[T] = metaclass(cls.__name__, cls.__bases__, namespace)
    return made


def is_record(obj: Any) -> bool:
    """Whether ``obj`` is a record class or an instance of one."""
    return hasattr(obj, "__record_fields__")


def fields(obj: Any) -> tuple[Field, ...]:
    """The fields of a record class or instance, in order."""
    if not is_record(obj):
        raise TypeError(f"fields() takes a record class or instance, not {type(obj).__name__}")
    specs: tuple[Field, ...] = obj.__record_fields__
    return specs


def replace(obj: T, /, **changes: Any) -> T:
    """A copy of record ``obj`` with ``changes`` (``__post_init__`` runs again, as with dataclasses)."""
    values = {f.name: getattr(obj, f.name) for f in fields(obj)}
    for name in changes:
        if name not in values:
            raise TypeError(f"{type(obj).__qualname__} has no field {name!r}")
    values.update(changes)
    return type(obj)(**values)


def asdict(obj: Any) -> dict[str, Any]:
    """The record's fields as a dict, records, lists, tuples and dicts inside it converted too."""
    return {f.name: _plain(getattr(obj, f.name)) for f in fields(obj)}


def _plain(value: Any) -> Any:
    if is_record(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return value
