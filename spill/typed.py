"""The one rule for what crosses a process boundary: each field of a message declares its type and its
range where it is declared, and `checked` applies them on decode to every message, nested records included.

    rows: list[RowId]                            each item an int in RowId's range (-1 to 2**31 - 1)
    tokens: Annotated[bytes, Packed(per="rows")]  int32 bytes, one per row
    texts: Annotated[list[str], PerRow]           as many items as the record's rows

A field's value markers (Range, Size, OneOf) check the value itself; its record markers (SameLength, Packed,
RequiredIf) check it against its record's other fields once they are decoded.
"""

import functools
import math
import types
import typing
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Annotated


class BadMessage(ValueError):
    """A frame that is not a well-formed message of ours: the receiver drops it and logs one line."""


# -- value markers -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Range:
    """A number from lo to hi, both included."""
    lo: float
    hi: float


@dataclass(frozen=True)
class Size:
    """A list of exactly n items."""
    n: int


@dataclass(frozen=True)
class OneOf:
    """One of these strings."""
    options: tuple[str, ...]


# -- record markers ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SameLength:
    """As many items as the record's field `other`."""
    other: str

    def problem(self, record, name: str) -> str | None:
        n, want = len(getattr(record, name)), len(getattr(record, self.other))
        return None if n == want else f"{name} has {n} items for {want} {self.other}"


@dataclass(frozen=True)
class Packed:
    """int32 bytes: one per item of the field `per`, or as many as the field `total` sums to."""
    per: str = ""
    total: str = ""

    def problem(self, record, name: str) -> str | None:
        want = len(getattr(record, self.per)) if self.per else sum(getattr(record, self.total))
        n = len(getattr(record, name))
        return None if n == 4 * want else f"{name} has {n} bytes for {want} int32 ({self.per or 'the sum of ' + self.total})"


@dataclass(frozen=True)
class RequiredIf:
    """Not None when the record's field `other` is `value`."""
    other: str
    value: str

    def problem(self, record, name: str) -> str | None:
        if getattr(record, self.other) == self.value and getattr(record, name) is None:
            return f"{self.other} {self.value!r} without its {name}"
        return None


# -- the ranges messages share ----------------------------------------------------------------------
PerRow = SameLength("rows")
MODEL_ROW = -1   # the row number of an ERROR about the job's model rather than one row
INT32_MAX, INT64_MAX = (1 << 31) - 1, (1 << 63) - 1
Int64 = Annotated[int, Range(-INT64_MAX - 1, INT64_MAX)]
Count = Annotated[int, Range(0, INT32_MAX)]                # token counts and ids, lengths, epochs, pass indices
Natural = Annotated[int, Range(0, INT64_MAX)]              # bytes, and counts that may pass 2**31
RowId = Annotated[int, Range(MODEL_ROW, INT32_MAX)]        # row numbers within a job
Fraction = Annotated[float, Range(0.0, 1.0)]
MaxTokens = Annotated[int, Range(1, INT32_MAX)]
Temperature = Annotated[float, Range(0.0, 2.0)]
TopK = Annotated[int, Range(0, INT32_MAX)]                 # 0: no top-k
Seed = Annotated[int, Range(0, INT64_MAX)]
Pair = Annotated[list[Count], Size(2)]
MAX_DRAFTS = 16
AUTO_DRAFTS = -1                                            # --speculate auto: admission's policy per pass
Drafts = Annotated[int, Range(AUTO_DRAFTS, MAX_DRAFTS)]     # drafts a decode row may carry a pass; 0: none


# -- the checker -------------------------------------------------------------------------------------
def checked(cls, raw, where: str = ""):
    """raw (msgpack's own types) as a record of cls, every field and nested record checked; BadMessage naming the
    first field that is wrong."""
    return _converter(cls)(raw, where or cls.__name__)


def _clip(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@functools.cache
def _split(hint) -> tuple:
    """(bare type, its origin, its type arguments, its value markers, its record markers)."""
    marks: tuple = ()
    if typing.get_origin(hint) is Annotated:
        hint, marks = hint.__origin__, hint.__metadata__
    values = tuple(k for k in marks if isinstance(k, (Range, Size, OneOf)))
    records = tuple(k for k in marks if hasattr(k, "problem"))
    return hint, typing.get_origin(hint), typing.get_args(hint), values, records


@functools.cache
def expected(hint) -> str:
    """What a value of hint is, in words."""
    bare, origin, args, marks, _ = _split(hint)
    rng = next((k for k in marks if isinstance(k, Range)), None)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(expected(a) for a in args)
    if bare in (int, float):
        word = "an int" if bare is int else "a finite number"
        return f"{word} from {rng.lo} to {rng.hi}" if rng else word
    if bare is str and any(isinstance(k, OneOf) for k in marks):
        return "one of " + ", ".join(repr(o) for o in next(k for k in marks if isinstance(k, OneOf)).options)
    if is_dataclass(bare):
        return f"a map of {bare.__name__}'s fields"
    size = next((k.n for k in marks if isinstance(k, Size)), None)
    return {str: "a string", bytes: "bytes", bool: "a bool", type(None): "None", list: "a list" if size is None else
            f"a list of {size}", dict: "a map with string keys"}.get(origin or bare, str(bare))


@functools.cache
def _test(hint):
    """A fast predicate for a leaf value (a number, a string, None, a union of those); None where there is none."""
    bare, origin, args, marks, _ = _split(hint)
    if origin in (typing.Union, types.UnionType):
        tests = [_test(a) for a in args]
        return None if None in tests else lambda v: any(t(v) for t in tests)
    rng = next((k for k in marks if isinstance(k, Range)), None)
    lo, hi = (rng.lo, rng.hi) if rng else (-INT64_MAX - 1, INT64_MAX) if bare is int else (-math.inf, math.inf)
    if bare is int:
        return lambda v: type(v) is int and lo <= v <= hi
    if bare is float:
        return lambda v: type(v) in (int, float) and math.isfinite(v) and lo <= v <= hi
    if bare is str:
        options = next((k.options for k in marks if isinstance(k, OneOf)), None)
        return (lambda v: type(v) is str) if options is None else (lambda v: type(v) is str and v in options)
    if bare in (bytes, bool, type(None)):
        return lambda v: type(v) is bare
    return None


def _outer(hint) -> tuple:
    """The msgpack types a value of hint can have."""
    bare, origin, *_ = _split(hint)
    bare = origin or bare
    return {int: (int,), float: (int, float), list: (list,), dict: (dict,)}.get(
        bare, (dict,) if is_dataclass(bare) else (bare,))


@functools.cache
def _converter(hint):
    """value, where -> value checked against hint (a record decoded into its dataclass); BadMessage otherwise."""
    bare, origin, args, marks, _ = _split(hint)
    test = _test(hint)
    if test is not None:
        def leaf(value, where):
            if not test(value):
                raise BadMessage(f"{where}: expected {expected(hint)}, found {_clip(value)}")
            return value
        return leaf
    if origin in (typing.Union, types.UnionType):
        return _union(hint, args)
    if bare is list or origin is list:
        return _list(hint, args[0] if args else None, next((k.n for k in marks if isinstance(k, Size)), None))
    if bare is dict or origin is dict:
        return _map(hint, args[1] if args else None)
    if is_dataclass(bare):
        return _record(bare)
    raise TypeError(f"no wire rule for {hint}")


def _union(hint, options):
    converters = [(o, _converter(o)) for o in options]

    def union(value, where):
        if value is None and type(None) in options:
            return None
        fits = [conv for o, conv in converters if type(value) in _outer(o) and not (type(value) is bool and o is not bool)]
        if len(fits) == 1:
            return fits[0](value, where)   # names the nested field that is wrong
        for conv in fits:
            try:
                return conv(value, where)
            except BadMessage:
                pass
        raise BadMessage(f"{where}: expected {expected(hint)}, found {_clip(value)}")
    return union


def _list(hint, item, size: int | None):
    test, conv = (_test(item), _converter(item)) if item is not None else (None, None)

    def checked_list(value, where):
        if type(value) is not list or (size is not None and len(value) != size):
            raise BadMessage(f"{where}: expected {expected(hint)}, found {_clip(value)}")
        if conv is None or (test is not None and all(map(test, value))):
            return value   # the common case, checked fast; the walk below names what is wrong
        return [conv(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return checked_list


def _map(hint, item):
    conv = _converter(item) if item is not None else None

    def checked_map(value, where):
        if type(value) is not dict or not all(type(k) is str for k in value):
            raise BadMessage(f"{where}: expected {expected(hint)}, found {_clip(value)}")
        return value if conv is None else {k: conv(v, f"{where}.{k}") for k, v in value.items()}
    return checked_map


def _record(cls):
    hints = typing.get_type_hints(cls, include_extras=True)
    specs = [(f.name, _converter(hints[f.name]), f.default is MISSING and f.default_factory is MISSING)
             for f in fields(cls)]
    rules = [(f.name, rule) for f in fields(cls) for rule in _split(hints[f.name])[4]]

    def record(value, where):
        if type(value) is not dict:
            raise BadMessage(f"{where}: expected {expected(cls)}, found {_clip(value)}")
        values = {}
        for name, conv, required in specs:
            if name in value:
                values[name] = conv(value[name], f"{where}.{name}")
            elif required:
                raise BadMessage(f"{where}: field {name} is missing")
        out = cls(**values)
        for name, rule in rules:
            if (why := rule.problem(out, name)) is not None:
                raise BadMessage(f"{where}: {why}")
        return out
    return record
