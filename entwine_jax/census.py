# The collective census: every collective a compiled program runs, read from its HLO text after SPMD
# partitioning, with its kind, mesh axes, bytes per device, loop trip counts and which op of
# entwine_jax.registry issued it, if any. One parser for the train-step example, the tests and the benchmarks;
# public JAX APIs and the standard library only (it must work on a machine without GPUs).
"""Every collective a compiled program runs, and how many bytes each device moves.

One entry point::

    from entwine_jax import census
    c = census.collectives(train_step, params, batch, mesh=mesh)   # or a Lowered, a Compiled, HLO text
    print(c)                                  # the table: one line per (owner, kind, axes, shape)
    c.select(owner="xla", axis="tp").bytes    # bytes per device per step of XLA's own collectives over tp
    c.per_iteration(c.loops[0])               # one trip of a scanned layer stack

A function (jitted or not) is lowered with ``args`` / ``kwargs`` (arrays or ``jax.ShapeDtypeStruct``:
nothing is allocated) and compiled; the census reads the compiled program, so the collectives the
SPMD partitioner inserts (automatic sharding) are in it. On a machine without GPUs, compile a
program meant for GPUs on fake CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N``).

**Kinds**: all-gather, reduce-scatter, all-reduce, all-to-all, ragged-all-to-all,
collective-permute, collective-broadcast (an async ``-start`` / ``-done`` pair, or an
``async-start`` wrapping one, counts once), and the fused ops' custom calls, each counted as the
collective its op's spec names (``entwine_jax.opspec.OpSpec``; ``entwine_gemm_rs``: a reduce-scatter,
``entwine_ag_gemm``: an all-gather).

**What the ops move on a GPU**: the ops (``OWNERS``: each op's name, then ``"xla"``) own their custom
calls (GPU compiles; ``custom_call`` True) and the collectives of their XLA reference (what they
lower to on CPU, or where the kernels cannot run), which each op wraps in a name scope saying which op it stands for and the
dtype the op's kernels move (``entwine_jax.opspec.moves``). The census counts that dtype, so a
program's numbers are the same whichever path it compiles to: gemm_rs's fp32 reference
reduce-scatter counts in the output dtype (bf16: what the kernels and a bf16 ``psum_scatter`` move),
an FP8 gather one byte per element; the table notes where the compiled program holds another dtype.
An op's backward is the other op (gemm_rs's dx is an ag_gemm) and is labelled so, in bf16 and FP8
alike. ``"xla"`` owns every other collective, also those XLA makes of the ops' results: the
data-parallel gradient all-reduce that AD makes of the ops' operands replicated over ``dp``
(``psum_invariant``), combined by XLA, is XLA's ("gradient sync"), not an op's.

**Bytes per device, per execution** (W: the size of the collective's device groups; ring accounting,
the data each device sends, which is also what it receives):

=======================  ==========================================================
all-gather               (W-1)/W x output bytes = (W-1) x input bytes
reduce-scatter           (W-1)/W x input bytes
all-reduce               2 (W-1)/W x bytes (a reduce-scatter, then an all-gather)
all-to-all               (W-1)/W x input bytes
ragged-all-to-all        (W-1)/W x input buffer bytes (an upper bound: sizes are dynamic)
collective-permute       the input bytes (what a sending device sends)
collective-broadcast     the input bytes (what each receiving device receives)
gemm_rs custom call      (W-1) x output bytes (its reduce-scatter; the output is padded)
ag_gemm custom call      (W-1) x input bytes of x (its all-gather; padded)
=======================  ==========================================================

(An op's custom call: what its spec's ``moved`` says one rank sends, W - 1 times. The MoE ops'
calls count their static layout, C rows per (source, expert): an upper bound where the SM push or
the combine kernel moves only the rows routed, whose number no program shows.)

**Mesh axes**: from ``replica_groups=mesh['dp'=2,'tp'=4] {'tp'}`` where XLA prints the mesh with the
program's axis names; otherwise the groups (explicit ``{{0,1},{2,3}}``, iota ``[2,4]<=[8]`` or
``[2,4]<=[4,2]T(1,0)``, a mesh print with XLA's own ``axis_0`` names) are matched against the mesh's
axes and their combinations (device i of a group = device i of the mesh, flattened, which is the
device assignment jit compiles for); no match: ``"groups of size k"``. A collective-permute's axes
are the mesh axes along which its source and target differ. A custom call carries no groups: its axis
is the one mesh axis of its world size W (from its shapes), when exactly one has that size. The mesh:
the ``mesh`` argument, else the mesh of the arguments' (or the compiled program's) ``NamedSharding``.

**Loops**: a collective inside a ``while`` body counts ``known_trip_count`` times (XLA's
``backend_config``; nested loops multiply); without a known trip count its ``count`` is None and it
is left out of the totals (the table says so). ``per_iteration(loop)`` is one trip of a loop body: a
scanned decoder's forward and backward layer loops give the per-layer numbers. A conditional's
branches are each counted as if taken (an upper bound).

**CPU compiles**: XLA's CPU compiler runs collectives in float32 where the program asks for bfloat16
or float16, and in float16 where it asks for FP8. When this module compiles for CPU it turns off the
passes that do so for data movement (``float-normalization-bf16``, ``float-normalization-f8e4m3fn``
and the other FP8 types: all-gather, collective-permute, all-to-all keep the program's dtype);
reductions are still promoted (the CPU runtime reduces no bf16), and for them the census counts
the dtype before the promotion (their reducer is named ``*_promoted`` and their input is a convert
of it). A ``Compiled`` object or text compiled elsewhere is read as it is. Also unlike GPU
compiles, CPU compiles keep an all-reduce followed by a dynamic-slice where a GPU compile forms a
reduce-scatter (half the bytes); the census reports what the program holds.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Optional

import jax
import numpy as np

from entwine_jax import opspec
from entwine_jax.registry import OPS

__all__ = ["collectives", "compare", "Census", "Collective", "Loop", "KINDS", "OWNERS"]

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute",
         "collective-broadcast")
# Custom-call target -> the op's spec (entwine_jax.opspec: the op says what a call moves).
FUSED_TARGETS = {target: spec for spec in OPS.values() for target in spec.targets}
OWNERS = tuple(OPS) + ("xla",)
# Bits per element of HLO's primitive types (token and opaque types move nothing).
_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32,
         "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128, "tf32": 32,
         "f4e2m1fn": 4, "f8e8m0fnu": 8, "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8,
         "f8e4m3b11fnuz": 8, "f8e4m3": 8, "f8e3m4": 8}
# Passes turned off when this module compiles for CPU (see the module docstring, "CPU compiles").
_CPU_OPTIONS = {"xla_disable_hlo_passes": ",".join(
    f"float-normalization-{t}" for t in ("bf16", "f8e4m3fn", "f8e5m2", "f8e4m3", "f8e3m4", "f8e4m3fnuz", "f8e5m2fnuz",
                                         "f8e4m3b11fnuz"))}


# ----------------------------------------------------------------------------------------------
# The structured form
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Loop:
    """A while loop of the program: its body computation, XLA's known trip count (None: unknown),
    the loop's op_name (``.../while``: a ``lax.scan`` or ``fori_loop``) and the enclosing loop's body."""
    body: str
    trip_count: Optional[int]
    op_name: str
    parent: Optional[str]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the program (once per path of calls that reaches it).

    count: executions per run of the program (the product of the enclosing loops' trip counts;
    None when one of them is unknown). bytes: per device, per execution (module docstring).
    axes: the mesh axes of its device groups, in mesh order; None when they match no axis or
    combination (then ``group`` says "groups of size k"). loops: the bodies of the enclosing
    while loops, outermost first."""
    kind: str
    owner: str
    custom_call: bool
    axes: Optional[tuple]
    group_size: int
    shape: str
    bytes: int
    count: Optional[int]
    loops: tuple
    name: str
    op_name: str
    program_shape: str = ""  # what the compiled program holds, where it differs from `shape` (an op's reference)

    @property
    def group(self) -> str:
        """The axes as the table prints them: "tp", "dp+tp", or "groups of size 4"."""
        if self.axes is not None:
            return "+".join(self.axes) if self.axes else "(none)"
        return f"groups of size {self.group_size}"

    @property
    def total_bytes(self) -> Optional[int]:
        return None if self.count is None else self.count * self.bytes


@dataclasses.dataclass(frozen=True)
class Census:
    """The collectives of one program; iterable over Collective. ``count`` and ``bytes`` are per run
    of the program (a train step), bytes per device; collectives with an unknown count are left out
    of both (``unknown`` lists them)."""
    collectives: tuple
    loops: tuple = ()
    mesh_axes: tuple = ()  # ((name, size), ...) of the mesh the axes were matched against
    notes: tuple = ()

    def __iter__(self):
        return iter(self.collectives)

    def __len__(self) -> int:
        return len(self.collectives)

    def __bool__(self) -> bool:
        return bool(self.collectives)

    @property
    def count(self) -> int:
        return sum(c.count for c in self.collectives if c.count is not None)

    @property
    def bytes(self) -> int:
        return sum(c.total_bytes for c in self.collectives if c.count is not None)

    @property
    def unknown(self) -> tuple:
        return tuple(c for c in self.collectives if c.count is None)

    def select(self, *, owner=None, kind=None, axis=None, custom_call: Optional[bool] = None, scope=None,
               outside=None, loop=None) -> "Census":
        """The collectives that match every filter given. owner / kind: a name or a tuple of names;
        axis: collectives whose axes include it (a name, or a tuple: all of them); custom_call: True
        for the fused ops' custom calls, False for XLA collectives; scope / outside: under / not under
        a name scope (a path component of op_name, e.g. "reduce_gradients"); loop: inside that loop
        (a Loop or its body's name)."""
        owners = _names("owner", owner, OWNERS)
        kinds = _names("kind", kind, KINDS)
        if axis is not None and not isinstance(axis, (str, tuple)):
            raise ValueError(f"census select: axis must be a mesh axis name or a tuple of them, got {axis!r}")
        want_axes = (axis,) if isinstance(axis, str) else axis
        body = self._loop_body(loop) if loop is not None else None

        def keep(c: Collective) -> bool:
            return ((owners is None or c.owner in owners) and (kinds is None or c.kind in kinds)
                    and (want_axes is None or (c.axes is not None and set(want_axes) <= set(c.axes)))
                    and (custom_call is None or c.custom_call == custom_call)
                    and (scope is None or scope in _scopes(c.op_name))
                    and (outside is None or outside not in _scopes(c.op_name))
                    and (body is None or body in c.loops))

        return dataclasses.replace(self, collectives=tuple(c for c in self.collectives if keep(c)))

    def per_iteration(self, loop) -> "Census":
        """One trip of `loop` (a Loop or its body's name): its collectives, each counted per
        iteration (loops nested inside it still multiply)."""
        body = self._loop_body(loop)
        found = []
        for c in self.collectives:
            if body not in c.loops:
                continue
            inner = c.loops[c.loops.index(body) + 1:]
            trips = [self._trip(b) for b in inner]
            count = None if any(t is None for t in trips) else math.prod(trips)
            found.append(dataclasses.replace(c, count=count))
        return dataclasses.replace(self, collectives=tuple(found))

    def counts(self, by: str = "kind") -> dict:
        """{key: executions per run}; by "kind", "owner", "axes" (the printed group) or "name"."""
        return {k: n for k, (n, _) in self.totals(by).items()}

    def totals(self, by: str = "owner") -> dict:
        """{key: (executions, bytes per device)} per run; by "owner", "kind", "axes" or "name"."""
        keys = {"owner": lambda c: c.owner, "kind": lambda c: c.kind, "axes": lambda c: c.group,
                "name": lambda c: c.name}
        if by not in keys:
            raise ValueError(f"census totals: by must be one of {tuple(keys)}, got {by!r}")
        out: dict = {}
        for c in self.collectives:
            if c.count is None:
                continue
            n, b = out.get(keys[by](c), (0, 0))
            out[keys[by](c)] = (n + c.count, b + c.total_bytes)
        return dict(sorted(out.items()))

    def rows(self) -> list:
        """[(owner, kind, axes, shape, custom_call, executions or None, bytes each, bytes)] grouped as
        the table prints them."""
        groups: dict = {}
        for c in self.collectives:
            key = (c.owner, c.kind, c.group, c.shape, c.custom_call, c.bytes)
            groups.setdefault(key, []).append(c)
        out = []
        for (owner, kind, group, shape, custom, each), cs in groups.items():
            n = None if any(c.count is None for c in cs) else sum(c.count for c in cs)
            out.append((owner, kind, group, shape, custom, n, each, None if n is None else n * each))
        return sorted(out, key=lambda r: (OWNERS.index(r[0]), r[1], r[2], -(r[7] or 0), r[3]))

    def table(self, title: str = "") -> str:
        """The printable census: one line per (owner, kind, axes, shape), then totals per owner and
        per axis. Bytes per device; counts per run of the program (per trip of a loop for
        per_iteration's census)."""
        lines = [title] if title else []
        head = f"{'owner':<8} {'kind':<22} {'axes':<18} {'shape':<34} {'count':>7} {'each':>10} {'bytes':>10}"
        lines += [head, "-" * len(head)]
        for owner, kind, group, shape, custom, n, each, total in self.rows():
            kind = kind + (" (custom call)" if custom else "")
            lines.append(f"{owner:<8} {kind:<22} {group:<18} {_clip(shape, 34):<34} {_fmt_n(n):>7} "
                         f"{fmt_bytes(each):>10} {fmt_bytes(total):>10}")
        if not self.collectives:
            lines.append("(no collectives)")
        lines.append("totals: " + _fmt_totals(self.totals("owner")) + f"; all {self.count} "
                     f"{fmt_bytes(self.bytes)}")
        lines.append("by axes: " + _fmt_totals(self.totals("axes")))
        if self.unknown:
            lines.append(f"not in the totals: {len(self.unknown)} collective(s) in loops of unknown trip count")
        stand_ins = sorted({(c.shape, c.program_shape) for c in self.collectives if c.program_shape})
        if stand_ins:
            held = ", ".join(f"{p} for {s}" for s, p in stand_ins)
            lines.append(f"note: the ops' collectives are counted as their kernels move them; this compile holds "
                         f"their XLA reference: {held}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _loop_body(self, loop) -> str:
        body = loop.body if isinstance(loop, Loop) else loop
        if not isinstance(body, str) or body not in {l.body for l in self.loops}:
            raise ValueError(f"census: loop must be one of this census' loops (a Loop or one of the body names "
                             f"{[l.body for l in self.loops]}), got {loop!r}")
        return body

    def _trip(self, body: str) -> Optional[int]:
        return next(l.trip_count for l in self.loops if l.body == body)


def fmt_bytes(n: Optional[float]) -> str:
    """1536 -> '1.5 KiB'; None -> '?'."""
    if n is None:
        return "?"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _fmt_n(n) -> str:
    return "?" if n is None else str(n)


def _clip(s: str, width: int) -> str:
    return s if len(s) <= width else s[: width - 3] + "..."


def _fmt_totals(totals: dict) -> str:
    return ", ".join(f"{k} {n} {fmt_bytes(b)}" for k, (n, b) in totals.items()) or "none"


def _names(what: str, value, allowed) -> Optional[tuple]:
    if value is None:
        return None
    names = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (tuple, list)) else None
    bad = [v for v in (names or (value,)) if v not in allowed]
    if names is None or bad:
        raise ValueError(f"census select: {what} must be one of {allowed} (or a tuple of them), got {value!r}")
    return names


def _scopes(op_name: str) -> list:
    """The path components of an op_name; "transpose(jvp(entwine_gemm_rs))"-style wrappers kept."""
    return op_name.split("/")


def more_than(program: Census, twin: Census) -> dict:
    """{axes: bytes per device per run} over which `program` moves more than `twin` (e.g. a program
    routed through the ops against the same model in plain JAX); {} when it moves no more anywhere."""
    mine, theirs = program.totals("axes"), twin.totals("axes")
    return {axes: b - theirs.get(axes, (0, 0))[1] for axes, (_, b) in mine.items() if b > theirs.get(axes, (0, 0))[1]}


def compare(program: Census, twin: Census, names: tuple = ("program", "twin")) -> str:
    """The bytes per device per run of `program` and its `twin`, per axes, side by side, with a line
    for every axes over which the program moves more than the twin (names: how to call the two)."""
    a, b = program.totals("axes"), twin.totals("axes")
    width = max([len(k) for k in (*a, *b)] + [len("all")])
    lines = [f"{'axes':<{width}} {names[0]:>14} {names[1]:>14}"]
    for axes in sorted(set(a) | set(b)):
        lines.append(f"{axes:<{width}} {fmt_bytes(a.get(axes, (0, 0))[1]):>14} {fmt_bytes(b.get(axes, (0, 0))[1]):>14}")
    lines.append(f"{'all':<{width}} {fmt_bytes(program.bytes):>14} {fmt_bytes(twin.bytes):>14}")
    extra = more_than(program, twin)
    lines += [f"{names[0]} moves {fmt_bytes(n)} more than {names[1]} over {axes} (per device, per run)"
              for axes, n in extra.items()]
    if not extra:
        lines.append(f"{names[0]} moves no more than {names[1]} over any axes")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The entry point
# ----------------------------------------------------------------------------------------------

def collectives(program, *args, mesh=None, **kwargs) -> Census:
    """The census of `program`: a function (jitted or not; lowered with args / kwargs, which may be
    jax.ShapeDtypeStruct, and compiled), a jax.stages.Lowered (compiled here), a jax.stages.Compiled,
    or the text of a compiled HLO module (``compiled.as_text()``).

    mesh: the jax.sharding.Mesh (or AbstractMesh) whose axes name the device groups; default: the
    mesh of the arguments' NamedShardings (or the compiled program's input shardings). A function is
    lowered under ``jax.set_mesh(mesh)`` when a concrete mesh is given.
    """
    if mesh is not None and not (hasattr(mesh, "axis_names") and hasattr(mesh, "axis_sizes")):
        raise ValueError(f"census.collectives: mesh must be a jax.sharding.Mesh or AbstractMesh, got "
                         f"{type(mesh).__name__}")
    notes = []
    if isinstance(program, str):
        _no_args(program, args, kwargs)
        text = program
    elif isinstance(program, jax.stages.Compiled):
        _no_args(program, args, kwargs)
        mesh = mesh if mesh is not None else _mesh_of(program.input_shardings)
        text = program.as_text()
    elif isinstance(program, jax.stages.Lowered):
        _no_args(program, args, kwargs)
        compiled, note = _compile(program)
        notes += [note] if note else []
        mesh = mesh if mesh is not None else _mesh_of(compiled.input_shardings)
        text = compiled.as_text()
    elif callable(program):
        jitted = program if hasattr(program, "lower") else jax.jit(program)
        mesh = mesh if mesh is not None else _mesh_of((args, kwargs))
        if isinstance(mesh, jax.sharding.Mesh):
            with jax.set_mesh(mesh):
                lowered = jitted.lower(*args, **kwargs)
        else:
            lowered = jitted.lower(*args, **kwargs)
        compiled, note = _compile(lowered)
        notes += [note] if note else []
        mesh = mesh if mesh is not None else _mesh_of(compiled.input_shardings)
        text = compiled.as_text()
    else:
        raise ValueError(f"census.collectives: program must be a function, a jax.stages.Lowered or Compiled, or "
                         f"compiled HLO text, got {type(program).__name__}")
    if not isinstance(text, str) or "ENTRY" not in text:
        raise ValueError(f"census.collectives: program text is not an HLO module (no ENTRY computation): "
                         f"{str(text)[:80]!r}")
    return _census(text, mesh, tuple(notes))


def _no_args(program, args, kwargs) -> None:
    if args or kwargs:
        raise ValueError(f"census.collectives: arguments are only taken with a function; program is a "
                         f"{type(program).__name__}, got {len(args)} positional and {sorted(kwargs)} keyword arguments")


def _compile(lowered) -> tuple:
    """(compiled, note): on CPU with float-normalization-bf16 off (module docstring), falling back to
    a plain compile if XLA refuses that."""
    if jax.default_backend() != "cpu":
        return lowered.compile(), None
    try:
        return lowered.compile(compiler_options=_CPU_OPTIONS), None
    except Exception as e:  # any compile error: the plain compile says whether the program compiles at all
        return lowered.compile(), (f"compiled with CPU float normalization ({type(e).__name__} with it off): "
                                   "bf16 / f16 gathers count as f32")


def _mesh_of(tree):
    """The mesh of the first NamedSharding among the leaves of `tree` (arrays, ShapeDtypeStructs,
    shardings), or None."""
    for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)):
        sharding = leaf if isinstance(leaf, jax.sharding.Sharding) else getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.mesh
    return None


# ----------------------------------------------------------------------------------------------
# HLO text
# ----------------------------------------------------------------------------------------------

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_CALLED = re.compile(r"\b(to_apply|calls|body|condition|true_computation|false_computation|branch_computations|"
                     r"called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_COMMENT = re.compile(r"/\*.*?\*/")


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: list
    attrs: str


def _split_shape(rest: str) -> tuple:
    """'(f32[2], f32[2]) all-to-all(...)' -> ('(f32[2], f32[2])', 'all-to-all(...)')."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1:].lstrip()
    shape, _, tail = rest.partition(" ")
    return shape, tail


def _parse_instr(line: str) -> Optional[_Instr]:
    m = _INSTR.match(line)
    if m is None:
        return None
    shape, tail = _split_shape(_COMMENT.sub("", m.group(2)).strip())
    om = re.match(r"([\w\-]+)\(", tail)
    if om is None:
        return None
    # The operand list: up to the matching parenthesis.
    depth, start = 0, om.end() - 1
    end = len(tail)
    for i in range(start, len(tail)):
        depth += tail[i] == "("
        depth -= tail[i] == ")"
        if depth == 0:
            end = i
            break
    operands = re.findall(r"%([\w.\-]+)", tail[start:end])
    return _Instr(m.group(1), shape, om.group(1), operands, tail[end + 1:])


def _parse_module(text: str) -> tuple:
    """({computation: [instructions]}, entry name)."""
    comps: dict = {}
    entry, current = None, None
    for line in text.splitlines():
        if not line or line[0] not in " \t}":
            h = _HEADER.match(line)
            if h is not None:
                current = comps.setdefault(h.group(2), [])
                entry = h.group(2) if h.group(1) else entry
            continue
        if current is not None and line.startswith((" ", "\t")):
            instr = _parse_instr(line)
            if instr is not None:
                current.append(instr)
    if entry is None:
        raise ValueError("census.collectives: program text has no ENTRY computation")
    return comps, entry


def _arrays(shape: str) -> list:
    """[(element type, dims)] of the arrays in an HLO shape (a tuple holds several)."""
    out = []
    for ty, dims in _ARRAY.findall(shape):
        if ty in _BITS:
            out.append((ty, tuple(int(d.replace("<=", "")) for d in dims.split(",") if d.strip())))
    return out


def _nbytes(arrays) -> int:
    return sum(math.prod(dims) * _BITS[ty] // 8 for ty, dims in arrays)


def _fmt_shape(arrays) -> str:
    return ", ".join(f"{ty}[{','.join(map(str, dims))}]" for ty, dims in arrays)


def _attr(attrs: str, key: str) -> Optional[str]:
    m = re.search(r"\b" + key + r'="((?:[^"\\]|\\.)*)"', attrs)
    return m.group(1) if m else None


def _trip_count(attrs: str) -> Optional[int]:
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?', attrs)
    return int(m.group(1)) if m else None


def _called(instr: _Instr) -> list:
    """[(attribute, computation)] that `instr` calls."""
    out = []
    for key, value in _CALLED.findall(instr.attrs):
        for name in re.findall(r"%?([\w.\-]+)", value):
            out.append((key, name))
    return out


# ----------------------------------------------------------------------------------------------
# Device groups -> mesh axes
# ----------------------------------------------------------------------------------------------

class _Axes:
    """Device groups to mesh axes, for one mesh (or none)."""

    def __init__(self, mesh):
        self.names = tuple(mesh.axis_names) if mesh is not None else ()
        self.sizes = tuple(int(s) for s in mesh.axis_sizes) if mesh is not None else ()
        self.size = math.prod(self.sizes) if mesh is not None else None
        self._table = None

    def table(self) -> dict:
        """{frozenset of groups (frozensets of flat device indices): axes} for every combination of
        the mesh's axes of size > 1, fewest axes first."""
        if self._table is None:
            self._table = {}
            ids = np.arange(self.size).reshape(self.sizes) if self.names else None
            real = [i for i, s in enumerate(self.sizes) if s > 1]
            for r in range(0, len(real) + 1):
                for combo in itertools.combinations(real, r):
                    key = _groups_key(_along(ids, combo))
                    self._table.setdefault(key, tuple(self.names[i] for i in combo))
        return self._table

    def of_groups(self, groups: Optional[list]) -> tuple:
        """(axes or None, group size) of explicit device groups (None: every device, one group)."""
        if groups is None or not groups:
            if self.size is None:
                return None, 0
            groups = [list(range(self.size))]
        size = len(groups[0])
        if self.size is None or sum(len(g) for g in groups) != self.size:
            return None, size
        return self.table().get(_groups_key(groups)), size

    def of_mesh_print(self, names: list, sizes: list, over: list, order) -> tuple:
        """(axes, group size) of `mesh['a'=2,'b'=4] {'b'}`: the names directly when they are the
        mesh's own (same axes, sizes, order), else the groups they describe, matched."""
        size = math.prod(sizes[names.index(a)] for a in over) if all(a in names for a in over) else 0
        if order is None and tuple(names) == self.names and tuple(sizes) == self.sizes:
            return tuple(a for a in self.names if a in over), size
        ids = np.arange(math.prod(sizes)) if order is None else np.asarray(order)
        groups = _along(ids.reshape(sizes), [names.index(a) for a in over])
        axes, size = self.of_groups(groups)
        if axes is None and self.size is None and not any(re.fullmatch(r"axis_\d+", a) for a in over):
            axes = tuple(over)  # no mesh to match: XLA's names are the program's
        return axes, size

    def of_pairs(self, pairs: list) -> tuple:
        """(axes, group size) of a collective-permute: the axes along which a source and its target
        differ; group size: the length of the longest cycle (the ring it shifts around)."""
        ring = _ring_size(pairs)
        if self.size is None or any(max(p) >= self.size for p in pairs):
            return None, ring
        coords = lambda d: np.unravel_index(d, self.sizes)  # noqa: E731
        differ = set()
        for s, t in pairs:
            differ |= {i for i, (a, b) in enumerate(zip(coords(s), coords(t))) if a != b}
        return tuple(self.names[i] for i in sorted(differ)), ring


def _along(ids: np.ndarray, axes) -> list:
    """Groups of flat indices that vary only along `axes` of the index array."""
    others = [i for i in range(ids.ndim) if i not in axes]
    moved = np.transpose(ids, others + list(axes))
    width = math.prod(ids.shape[i] for i in axes)
    return moved.reshape(-1, width).tolist()


def _groups_key(groups) -> frozenset:
    return frozenset(frozenset(int(d) for d in g) for g in groups)


def _ring_size(pairs: list) -> int:
    nxt = dict(pairs)
    best = 1
    for start in nxt:
        seen, d = {start}, nxt[start]
        while d in nxt and d not in seen:
            seen.add(d)
            d = nxt[d]
        best = max(best, len(seen) if d == start else len(seen) + 1)
    return best


def _iota(dims: list, reshape: list, perm: Optional[list]) -> list:
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if perm is not None:
        ids = np.transpose(ids, perm)
    return ids.reshape(dims).tolist()


def _ints(s: str) -> list:
    return [int(v) for v in re.findall(r"-?\d+", s)]


def _axes_of(instr: _Instr, axes: _Axes) -> tuple:
    """(axes or None, group size) of a collective instruction."""
    a = instr.attrs
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:<=\[([\d,]*)\](?:T\(([\d,]*)\))?)?\s*\{([^}]*)\}", a)
    if m is not None:
        pairs = re.findall(r"'?([\w.\-]+)'?\s*=\s*(\d+)", m.group(1))
        names, sizes = [n for n, _ in pairs], [int(s) for _, s in pairs]
        order = None
        if m.group(2):
            order = _iota([math.prod(sizes)], _ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
        over = re.findall(r"'?([\w.\-]+)'?", m.group(4))
        return axes.of_mesh_print(names, sizes, over, order)
    m = re.search(r"replica_groups=\[([\d,]*)\]<=\[([\d,]*)\](?:T\(([\d,]*)\))?", a)
    if m is not None:
        return axes.of_groups(_iota(_ints(m.group(1)), _ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None))
    m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", a)
    if m is not None:
        groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
        return axes.of_groups(groups or None)
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", a)
    if m is not None:
        return axes.of_pairs([tuple(_ints(p)) for p in re.findall(r"\{(\d+,\d+)\}", m.group(1))])
    return axes.of_groups(None)


# ----------------------------------------------------------------------------------------------
# The walk
# ----------------------------------------------------------------------------------------------

_ASYNC_KINDS = {k + "-start": k for k in KINDS}
# Ops whose called computations are not executed again (the async wrapper's body runs once, for the
# async-start).
_NOT_FOLLOWED = {"async-update", "async-done"}


def _kind(instr: _Instr) -> Optional[str]:
    if instr.opcode in KINDS:
        return instr.opcode
    return _ASYNC_KINDS.get(instr.opcode)


def _owner(op_name: str) -> tuple:
    """(owner, the HLO element type its kernels move or None) of a collective, from the op's
    opspec.moves scope in its op_name (the innermost wins); ("xla", None) without one."""
    found = opspec.moved_by(op_name)
    if found is None or found[0] not in OWNERS:
        return "xla", None
    return found


def _data_arrays(instr: _Instr, kind: str, shapes: dict, users: dict, comps: dict) -> list:
    """The arrays a collective reads (its data operands), with the dtype the program asked for when
    XLA promoted a reduction to float32 (module docstring): per operand, the narrower float type
    that a convert next to it (its producer, or a user of it or of the collective) goes from or to,
    with the same dims."""
    names = instr.operands[:1] if kind in ("collective-permute", "ragged-all-to-all") else instr.operands
    arrays = [_arrays(shapes.get(n, "")) for n in names]
    reducer = re.search(r"\bto_apply=%?([\w.\-]+)", instr.attrs)
    if reducer is None or not reducer.group(1).endswith("_promoted"):
        return [a for group in arrays for a in group]
    # A tuple result is read through get-tuple-element: the users of those count as the result's.
    results = users.get(instr.name, [])
    results = results + [u for r in results if r.opcode == "get-tuple-element" for u in users.get(r.name, [])]
    out = []
    for n, group in zip(names, arrays):
        if len(group) != 1:
            out += group
            continue
        (ty, dims), = group
        out.append((_narrow(ty, dims, users.get(("def", n), []) + users.get(n, []) + results, comps), dims))
    return out


def _narrow(ty: str, dims: tuple, near: list, comps: dict) -> str:
    """The narrower float type (than ty) of a convert among `near` (or inside its fused computation)
    with the same dims, else ty."""
    for instr in near:
        if "convert" not in instr.name and instr.opcode != "convert":
            continue
        inner = [(i, comps[c]) for _, c in _called(instr) if c in comps for i in comps[c] if i.opcode == "convert"]
        for conv, scope in inner or [(instr, [])]:
            # A convert's output and its input: the narrow side is the program's dtype.
            sides = [conv.shape] + [i.shape for i in scope if i.name in conv.operands]
            for cty, cdims in (a for side in sides for a in _arrays(side)):
                if cdims == dims and cty.startswith(("bf", "f")) and _BITS[cty] < _BITS[ty]:
                    return cty
    return ty


def _bytes(kind: str, data: int, w: int) -> int:
    if kind == "all-gather":
        return (w - 1) * data
    if kind in ("reduce-scatter", "all-to-all", "ragged-all-to-all"):
        return (w - 1) * data // w if w else 0
    if kind == "all-reduce":
        return 2 * (w - 1) * data // w if w else 0
    return data  # collective-permute, collective-broadcast


def _custom_call(instr: _Instr, shapes: dict, axes: _Axes) -> Optional[tuple]:
    """(owner, kind, axes, W, arrays, bytes) of a fused op's custom call, or None; the op's spec
    says what one call moves (entwine_jax.opspec)."""
    target = _attr(instr.attrs, "custom_call_target")
    if target not in FUSED_TARGETS:
        return None
    spec = FUSED_TARGETS[target]
    # A target that several ops call (a routed op's moves) is counted as the op whose moves() scope
    # encloses the call, as their references' collectives are.
    scoped = opspec.moved_by(_attr(instr.attrs, "op_name") or "")
    owner = scoped[0] if scoped is not None and scoped[0] in OWNERS else spec.name
    ins = [_arrays(shapes.get(n, "")) for n in instr.operands]
    outs = _arrays(instr.shape)
    # Operands whose shapes the text does not give (moe_transfer has one operand, the others two or more).
    if not ins or not ins[0] or not outs or (len(ins) > 1 and not ins[1]):
        return owner, spec.kind, None, 0, outs, 0
    world, arrays = spec.moved(target, ins, outs, instr.attrs)
    named = [n for n, s in zip(axes.names, axes.sizes) if s == world]
    found = (named[0],) if len(named) == 1 else None
    return owner, spec.kind, found, world, arrays, (world - 1) * _nbytes(arrays)


def _census(text: str, mesh, notes: tuple) -> Census:
    comps, entry = _parse_module(text)
    axes = _Axes(mesh)
    found, loops = [], {}
    tables = {}

    def table(comp: str):
        if comp not in tables:
            instrs = comps.get(comp, [])
            users: dict = {}
            for i in instrs:
                users[("def", i.name)] = [i]
                for n in i.operands:
                    users.setdefault(n, []).append(i)
            tables[comp] = ({i.name: i.shape for i in instrs}, users)
        return tables[comp]

    def walk(comp: str, count: Optional[int], stack: tuple, depth: int):
        if depth > 64:  # recursion in HLO is not allowed; a deeper chain means a parse problem
            raise ValueError(f"census.collectives: computation {comp!r} is nested more than 64 calls deep")
        shapes, users = table(comp)
        for instr in comps.get(comp, []):
            op_name = _attr(instr.attrs, "op_name") or ""
            kind = _kind(instr)
            if kind is not None:
                arrays = _data_arrays(instr, kind, shapes, users, comps)
                owner, moved = _owner(op_name)
                program = ""
                if moved is not None and any(ty != moved for ty, _ in arrays):
                    # An op's reference: counted in the dtype its kernels move (module docstring).
                    program, arrays = _fmt_shape(arrays), [(moved, dims) for _, dims in arrays]
                group_axes, w = _axes_of(instr, axes)
                found.append(Collective(kind=kind, owner=owner, custom_call=False, axes=group_axes,
                                        group_size=w, shape=_fmt_shape(arrays), bytes=_bytes(kind, _nbytes(arrays), w),
                                        count=count, loops=stack, name=instr.name, op_name=op_name,
                                        program_shape=program))
            elif instr.opcode == "custom-call":
                fused = _custom_call(instr, shapes, axes)
                if fused is not None:
                    owner, ckind, group_axes, w, arrays, nbytes = fused
                    found.append(Collective(kind=ckind, owner=owner, custom_call=True, axes=group_axes, group_size=w,
                                            shape=_fmt_shape(arrays), bytes=nbytes, count=count, loops=stack,
                                            name=instr.name, op_name=op_name))
            if instr.opcode in _NOT_FOLLOWED:
                continue
            trip = _trip_count(instr.attrs) if instr.opcode == "while" else None
            for key, callee in _called(instr):
                if callee not in comps:
                    continue
                if instr.opcode == "while" and key == "body":
                    loops.setdefault(callee, Loop(callee, trip, op_name, stack[-1] if stack else None))
                    walk(callee, None if count is None or trip is None else count * trip, stack + (callee,),
                         depth + 1)
                elif instr.opcode == "while" and key == "condition":
                    continue  # a loop condition holds no collective worth counting
                else:
                    walk(callee, count, stack, depth + 1)

    walk(entry, 1, (), 0)
    mesh_axes = tuple(zip(axes.names, axes.sizes))
    return Census(collectives=tuple(found), loops=tuple(loops.values()), mesh_axes=mesh_axes, notes=notes)


# ----------------------------------------------------------------------------------------------
# The command line: python -m entwine_jax census MODULE:FUNCTION --mesh ... --arg ...
# ----------------------------------------------------------------------------------------------

_SHORT_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "e4m3": "float8_e4m3fn",
                 "f8e4m3fn": "float8_e4m3fn", "e5m2": "float8_e5m2", "f8e5m2": "float8_e5m2"}
_ARG = re.compile(r"^(\w+)\[([\d,\s]*)\](?:@(.*))?$")

CLI_EPILOG = """\
An argument is DTYPE[dims] or DTYPE[dims]@SPEC: bf16[256,512]@dp+tp,_ is a bfloat16 [256, 512] array
with its rows sharded over dp and tp together and its columns replicated (SPEC: one entry per dim,
an axis name, axes joined by +, or _ for none). Nothing is allocated: the function is lowered on
jax.ShapeDtypeStructs under jax.set_mesh(mesh) and compiled; on a machine without GPUs it compiles for
as many fake CPU devices as the mesh has. The function may call jax.shard_map without a mesh (the
mesh is set) and entwine_jax.gemm_rs / ag_gemm inside it.

example (from the repository root):
  python -m entwine_jax census examples/census_mlp.py:routed --grad --mesh dp=2,tp=4 \\
      --arg 'bf16[256,512]@dp+tp,_' --arg 'bf16[512,1024]@_,tp' --arg 'bf16[1024,512]@tp,_' \\
      --twin examples/census_mlp.py:plain"""


def _load(target: str):
    """MODULE:FUNCTION or path/to/file.py:FUNCTION -> the function."""
    import importlib
    import importlib.util
    import os
    import sys
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"census: the function must be MODULE:FUNCTION or FILE.py:FUNCTION, got {target!r}")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(where))[0], where)
        if spec is None or not os.path.exists(where):
            raise ValueError(f"census: no file {where!r} (from {target!r})")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())  # a module of the directory the command runs in
        module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"census: {where} has no function {name!r}")
    return fn


def _parse_mesh(text: str) -> tuple:
    """'dp=2,tp=4' -> (('dp', 'tp'), (2, 4))."""
    names, sizes = [], []
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        if not eq or not name.isidentifier() or not size.isdigit() or int(size) < 1:
            raise ValueError(f"census: --mesh must be NAME=SIZE[,NAME=SIZE...] with sizes >= 1, e.g. dp=2,tp=4; "
                             f"got {text!r}")
        names.append(name)
        sizes.append(int(size))
    return tuple(names), tuple(sizes)


def _parse_arg(text: str, mesh):
    """'bf16[256,512]@dp+tp,_' -> a jax.ShapeDtypeStruct sharded over `mesh` (CLI_EPILOG)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec
    m = _ARG.match(text.replace(" ", ""))
    if m is None:
        raise ValueError(f"census: --arg must be DTYPE[dims] or DTYPE[dims]@SPEC, e.g. bf16[256,512]@dp,_; "
                         f"got {text!r}")
    try:
        dtype = jnp.dtype(_SHORT_DTYPES.get(m.group(1), m.group(1)))
    except TypeError:
        raise ValueError(f"census: --arg {text!r}: unknown dtype {m.group(1)!r}") from None
    shape = tuple(int(d) for d in m.group(2).split(",") if d)
    entries = []
    for entry in (m.group(3).split(",") if m.group(3) else []):
        axes = tuple(a for a in entry.split("+") if a not in ("", "_", "None"))
        bad = [a for a in axes if a not in mesh.axis_names]
        if bad:
            raise ValueError(f"census: --arg {text!r}: axis {bad[0]!r} is not one of the mesh's {mesh.axis_names}")
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    if len(entries) > len(shape):
        raise ValueError(f"census: --arg {text!r}: {len(entries)} spec entries for a rank-{len(shape)} array")
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(*entries)))


def main(argv=None, prog: str = "python -m entwine_jax census") -> int:
    """Print the census of a user's function (and, with --twin, how it compares with its twin)."""
    import argparse
    import os
    parser = argparse.ArgumentParser(prog=prog, description="The collectives a function's compiled program runs, "
                                     "and the bytes each device moves (entwine_jax.census).",
                                     epilog=CLI_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("function", help="MODULE:FUNCTION or FILE.py:FUNCTION")
    parser.add_argument("--mesh", required=True, help="axis names and sizes, e.g. dp=2,tp=4")
    parser.add_argument("--arg", action="append", default=[], help="one positional argument (repeat, in order)")
    parser.add_argument("--grad", action="store_true",
                        help="census of jax.grad of the function with respect to every argument (a training step's "
                             "collectives; the function returns a scalar)")
    parser.add_argument("--twin", help="MODULE:FUNCTION of the same model another way (e.g. plain JAX): its table, "
                                       "and the axes over which the function moves more")
    args = parser.parse_args(argv)
    try:
        names, sizes = _parse_mesh(args.mesh)
        # Fake CPU devices for the mesh, set before JAX starts its backends (no effect on GPU platforms).
        if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                       + f" --xla_force_host_platform_device_count={math.prod(sizes)}").strip()
        if len(jax.devices()) < math.prod(sizes):
            raise ValueError(f"census: the mesh {args.mesh} needs {math.prod(sizes)} devices, found "
                             f"{len(jax.devices())} (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})")
        mesh = jax.make_mesh(sizes, names)
        shapes = [_parse_arg(a, mesh) for a in args.arg]
        programs = [(args.function, _load(args.function))] + ([(args.twin, _load(args.twin))] if args.twin else [])
        found = []
        for target, fn in programs:
            fn = jax.grad(fn, argnums=tuple(range(len(shapes)))) if args.grad else fn
            c = collectives(fn, *shapes, mesh=mesh)
            print(c.table(title=f"{target}{' (grad)' if args.grad else ''} on mesh {args.mesh}: bytes per device"))
            print()
            found.append(c)
    except ValueError as e:
        print(f"{prog}: {e}", file=__import__("sys").stderr)
        return 2
    if args.twin:
        print(compare(found[0], found[1], (args.function.rpartition(":")[2], args.twin.rpartition(":")[2])))
    return 0
