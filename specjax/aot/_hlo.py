"""Reading a compiled program's optimized HLO: bytes through HBM per call, collectives, and the lint.

XLA's own figure (``compiled.cost_analysis()["bytes accessed"]``) counts a ``while`` body
once, whatever its trip count, so a scanned layer loop's weights are counted for one layer
(experiments/aot/README.md). This module walks the optimized, partitioned (per-device) HLO text instead:

* every computation reached from the entry is weighted by how often it runs: a ``while`` body
  by its trip count (``known_trip_count`` when XLA recorded it, else the constant its
  condition compares the induction variable against), a ``conditional`` by its most
  expensive branch, a ``call`` or async computation once; fused computations are costed at
  their fusion;
* an instruction moves its operands' bytes in and its result's bytes out, as XLA's
  ``HloCostAnalysis`` counts them, with refinements for slicing (a ``dynamic-slice``, ``slice``
  or ``gather``, also inside a fusion or a nested one, reads only what it returns; an in-place
  ``dynamic-update-slice`` writes only its update) and none of the bookkeeping ops
  (parameters, tuples, bitcasts, constants, the ``-done`` half of async pairs);
* only arrays in the default memory space count: a TPU layout's ``S(1)`` (on-chip VMEM) and
  the other scoped spaces are not HBM traffic; ``S(5)`` (host memory) is a host transfer.

The calibration (a lone matmul, a scan against the same layers unrolled) is
tests/test_aot.py's; its figures are in experiments/aot/README.md.

`lint` then names what a decode program should not do (`Finding`): copy a layer's weights or
a whole cache buffer (materialize a slice, transpose or concatenation of one) instead of
reading it in place, move data to or from the host, or leave donated buffers unaliased.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable

_ELEMENT_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1,
    "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0,
}
# one array type: dtype[dims]{layout}; the layout may carry tiles T(..) and a memory space S(n)
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_ELEMENT_BYTES, key=len, reverse=True)) +
                    r")\[([0-9,]*)\](\{[^{}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(")
HOST_SPACE = 5                  # TPU/GPU layouts: S(5) is pinned host memory
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier", "while", "conditional", "call", "add-dependency", "domain"}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")
_HOST_OPS = ("send", "recv", "infeed", "outfeed", "send-done", "recv-done")
_MOVES = {"copy", "transpose", "slice", "dynamic-slice", "concatenate", "copy-start", "reshape", "gather", "pad"}
# what a fusion that only moves data may hold besides moves
_BOOKKEEPING = {"parameter", "bitcast", "tuple", "constant", "broadcast", "convert", "dynamic-update-slice",
                "select", "compare", "iota"}


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]
    space: int           # memory space, 0 = default (HBM on an accelerator)

    @property
    def elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    @property
    def bytes(self) -> float:
        return self.elements * _ELEMENT_BYTES[self.dtype]


def parse_type(text: str) -> list[Array]:
    """Every array of a (possibly tuple) HLO type, in order."""
    out = []
    for m in _ARRAY.finditer(text):
        dims = tuple(int(d) for d in m.group(2).split(",") if d)
        space = _SPACE.search(m.group(3) or "")
        out.append(Array(m.group(1), dims, int(space.group(1)) if space else 0))
    return out


def _matching(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced brackets in HLO: {text[:120]}")


@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    type: list[Array]
    operands: list[str]
    attrs: str
    root: bool = False
    literal: str | None = None       # a constant's value as printed

    @property
    def out_bytes(self) -> float:
        return sum(a.bytes for a in self.type)

    def attr(self, key: str) -> str | None:
        m = re.search(r"(?:^|,\s*)" + re.escape(key) + r"=(%?[\w.\-]+)", self.attrs)
        return m.group(1).lstrip("%") if m else None

    def called(self) -> list[str]:
        """Computations this instruction calls by name (calls=, to_apply=, body=, branches)."""
        names = re.findall(r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)",
                           self.attrs)
        m = re.search(r"branch_computations=\{([^}]*)\}", self.attrs)
        if m:
            names += [n.strip().lstrip("%") for n in m.group(1).split(",") if n.strip()]
        return names

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""


@dataclasses.dataclass
class Computation:
    name: str
    instrs: dict[str, Instr]
    root: str
    entry: bool = False


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    # the result type: a tuple "( ... )" or one array, then the opcode and its operands
    if rest.startswith("("):
        end = _matching(rest, 0)
        type_text, rest = rest[:end + 1], rest[end + 1:].lstrip()
    else:
        sp = rest.find(" ")
        type_text, rest = rest[:sp], rest[sp + 1:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    opcode = op.group(1)
    start = op.end() - 1
    end = _matching(rest, start)
    operands = re.findall(r"%([\w.\-]+)", rest[start:end + 1])
    attrs = rest[end + 1:].lstrip(", ")
    literal = rest[start + 1:end].strip() if opcode in ("constant", "parameter") else None
    return Instr(name, opcode, parse_type(type_text), operands, attrs, root, literal)


@dataclasses.dataclass
class Module:
    computations: dict[str, Computation]
    entry: str
    header: str

    def aliased_parameters(self) -> set[int]:
        """Entry parameter numbers that an output aliases (``input_output_alias``)."""
        m = re.search(r"input_output_alias=\{(.*?)\}\s*(?:,\s*\w+=|$)", self.header)
        if not m:
            return set()
        return {int(p) for p in re.findall(r":\s*\((\d+),", m.group(1))}


def parse_module(text: str) -> Module:
    """The computations of an HLO module's text (``compiled.as_text()``)."""
    comps: dict[str, Computation] = {}
    entry, header, cur = None, "", None
    for line in text.splitlines():
        if line.startswith("HloModule"):
            header = line
            continue
        if cur is None:
            m = _HEADER.match(line)
            if m and line.rstrip().endswith("{"):
                cur = Computation(m.group(2), {}, "", bool(m.group(1)))
                if cur.entry:
                    entry = cur.name
            continue
        if line.startswith("}"):
            comps[cur.name] = cur
            cur = None
            continue
        ins = _parse_instr(line)
        if ins is not None:
            cur.instrs[ins.name] = ins
            if ins.root:
                cur.root = ins.name
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(comps, entry, header)


# ---------------------------------------------------------------------------------------
# Trip counts and multiplicities
# ---------------------------------------------------------------------------------------
def trip_count(module: Module, comp: Computation, w: Instr) -> int | None:
    """How often a ``while`` runs: XLA's ``known_trip_count``, else ``N - start`` for a
    condition ``i < N`` on a tuple element whose initial value is a constant (0 assumed when it
    is not a constant in the caller)."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', w.attrs)
    if m:
        return int(m.group(1))
    cond = module.computations.get(w.attr("condition") or "")
    if cond is None or cond.root not in cond.instrs:
        return None
    root = cond.instrs[cond.root]
    if root.opcode != "compare" or len(root.operands) != 2:
        return None
    direction = re.search(r"direction=(\w+)", root.attrs)
    a, b = (cond.instrs.get(n) for n in root.operands)
    if a is None or b is None or direction is None:
        return None
    bound, index = (b, a) if b.opcode == "constant" else (a, b) if a.opcode == "constant" else (None, None)
    if bound is None or index.opcode != "get-tuple-element":
        return None
    n = _constant_int(bound)
    if n is None:
        return None
    start = 0
    element = index.attr("index")
    init = comp.instrs.get(w.operands[0]) if w.operands else None
    if init is not None and init.opcode == "tuple" and element is not None and int(element) < len(init.operands):
        first = comp.instrs.get(init.operands[int(element)])
        if first is not None and first.opcode == "constant":
            start = _constant_int(first) or 0
    d = direction.group(1)
    count = (n - start) if (d == "LT" and bound is b) or (d == "GT" and bound is a) else \
        (n - start + 1) if (d == "LE" and bound is b) or (d == "GE" and bound is a) else None
    return None if count is None else max(count, 0)


def _constant_int(ins: Instr) -> int | None:
    try:
        return int(ins.literal) if ins.literal is not None else None
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------
# Bytes per instruction
# ---------------------------------------------------------------------------------------
def _hbm(arrays: Iterable[Array]) -> float:
    return sum(a.bytes for a in arrays if a.space == 0)


def _users(comp: Computation) -> dict[str, list[Instr]]:
    users: dict[str, list[Instr]] = {}
    for i in comp.instrs.values():
        for o in i.operands:
            users.setdefault(o, []).append(i)
    return users


def _params(comp: Computation) -> dict[str, int]:
    return {i.name: int(i.literal) for i in comp.instrs.values()
            if i.opcode == "parameter" and i.literal is not None and i.literal.isdigit()}


def _param_read(module: Module, comp: Computation, pname: str, whole: float, depth: int = 0) -> float:
    """HBM bytes a fused computation reads of its parameter ``pname`` (``whole`` bytes): the
    slices it takes when every use slices it (through bitcasts and nested fusions), else all."""
    if depth > 8 or whole == 0:
        return whole
    if pname == comp.root:            # it leaves the computation whole (a nested bitcast fusion)
        return whole
    uses = _users(comp).get(pname, [])
    if not uses:
        return 0.0
    total = 0.0
    for u in uses:
        if u.opcode in ("dynamic-slice", "slice", "gather") and u.operands[0] == pname:
            total += sum(a.bytes for a in u.type)
        elif u.opcode == "bitcast":
            total += _param_read(module, comp, u.name, whole, depth + 1)
        elif u.opcode == "fusion" and (inner := module.computations.get(u.attr("calls") or "")) is not None:
            number = u.operands.index(pname)
            inner_name = next((n for n, k in _params(inner).items() if k == number), None)
            total += whole if inner_name is None else _param_read(module, inner, inner_name, whole, depth + 1)
        else:
            return whole
    return min(total, whole)


def _fusion_bytes(module: Module, comp: Computation, ins: Instr) -> tuple[float, float]:
    """(read, written) HBM bytes of a fusion: each operand whole, except one that the fused
    computation only slices (the slices' bytes) or updates in place (nothing read; the
    update's bytes written instead of the whole result)."""
    fused = module.computations.get(ins.attr("calls") or "")
    operand_types = [comp.instrs[n].type if n in comp.instrs else [] for n in ins.operands]
    if fused is None:
        return sum(_hbm(t) for t in operand_types), _hbm(ins.type)
    params = _params(fused)
    users = _users(fused)
    in_place: set[int] = set()
    root = fused.instrs.get(fused.root)
    roots = [fused.instrs[o] for o in root.operands] if root is not None and root.opcode == "tuple" else [root]
    # the fusion's own result types carry the memory spaces (the fused root's do not)
    outs = [[a] for a in ins.type] if len(roots) == len(ins.type) else [ins.type] * len(roots)
    written = 0.0
    for r, out in zip(roots, outs):
        in_hbm = bool(out) and out[0].space == 0
        if r is not None and r.opcode == "dynamic-update-slice" and r.operands and \
                params.get(r.operands[0]) is not None and len(users.get(r.operands[0], [])) == 1:
            in_place.add(params[r.operands[0]])
            upd = fused.instrs.get(r.operands[1])
            written += sum(a.bytes for a in upd.type) if upd is not None and in_hbm else 0.0
        elif r is not None and r.opcode == "scatter" and r.operands and \
                params.get(r.operands[0]) is not None and len(users.get(r.operands[0], [])) == 1:
            # a scatter into a fusion parameter runs in place (the output shares its buffer, as
            # for dynamic-update-slice): only the updates are written, the operand is not read
            in_place.add(params[r.operands[0]])
            half = (len(r.operands) - 1) // 2          # operands: inputs..., indices, updates...
            for name in r.operands[half + 1:]:
                upd = fused.instrs.get(name)
                written += sum(a.bytes for a in upd.type) if upd is not None and in_hbm else 0.0
        elif r is not None:
            written += _hbm(out)
        if len(roots) == 1:
            break
    read = 0.0
    for pname, number in params.items():
        if number >= len(operand_types) or number in in_place:
            continue
        read += _param_read(module, fused, pname, _hbm(operand_types[number]))
    return read, written


def instr_bytes(module: Module, comp: Computation, ins: Instr) -> tuple[float, float]:
    """(read, written) HBM bytes of one instruction (see the module docstring)."""
    op = ins.opcode
    if op in _FREE or op.endswith("-done"):
        return 0.0, 0.0
    if op == "fusion":
        return _fusion_bytes(module, comp, ins)
    operand = lambda k: comp.instrs[ins.operands[k]].type if k < len(ins.operands) and \
        ins.operands[k] in comp.instrs else []       # noqa: E731
    if op in ("dynamic-slice", "slice"):
        return _hbm(ins.type), _hbm(ins.type)
    if op == "gather":                  # the gathered rows and the indices, not the whole table
        return _hbm(ins.type) + _hbm(operand(1)), _hbm(ins.type)
    if op == "dynamic-update-slice":
        upd = _hbm(operand(1))
        return upd, upd
    if op == "custom-call" and re.search(r'custom_call_target="__(cublas|cudnn)', ins.attrs) and \
            len(ins.type) > 1 and ins.type[-1].dtype == "s8" and len(ins.type[-1].dims) == 1:
        # a cuBLAS/cuDNN call's last result is its scratch workspace, not data it writes out
        return sum(_hbm(operand(k)) for k in range(len(ins.operands))), _hbm(ins.type[:-1])
    if op == "scatter":                 # in place: indices and updates read, updates written
        half = (len(ins.operands) - 1) // 2
        upd = sum(_hbm(operand(k)) for k in range(half + 1, len(ins.operands)))
        return upd + _hbm(operand(half)), upd
    if op == "copy-start":              # result (destination, source, context)
        return sum(_hbm(operand(k)) for k in range(len(ins.operands))), _hbm(ins.type[:1])
    if op.endswith("-start"):           # result ((operands...), destination, context)
        n = len(ins.operands)
        dest = ins.type[n:n + 1] if len(ins.type) > n else ins.type[:1]
        if op in ("slice-start", "dynamic-slice-start"):
            return sum(a.bytes for a in dest), _hbm(dest)
        return sum(_hbm(operand(k)) for k in range(n)), _hbm(dest)
    return sum(_hbm(operand(k)) for k in range(len(ins.operands))), _hbm(ins.type)


# ---------------------------------------------------------------------------------------
# The walk
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Site:
    """One instruction as it runs per call of the program: ``times`` = its computation's
    multiplicity (loop trip counts multiplied)."""
    comp: str
    instr: Instr
    times: int
    read: float
    written: float
    in_loop: bool

    @property
    def bytes(self) -> float:
        return (self.read + self.written) * self.times


@dataclasses.dataclass
class Traffic:
    """HBM bytes of one call of a program, per device, and where they come from."""
    sites: list[Site]
    loops: list[dict]                 # each while: name, trip count (None: unknown), op_name
    unknown_trips: int

    @property
    def bytes(self) -> float:
        return sum(s.bytes for s in self.sites)

    def collectives(self) -> dict:
        """Collectives per call: count and operand bytes, by kind."""
        out: dict[str, dict] = {}
        for s in self.sites:
            kind = s.instr.opcode.removesuffix("-start")
            if kind in COLLECTIVES:
                d = out.setdefault(kind, {"count": 0, "bytes": 0.0})
                d["count"] += s.times
                d["bytes"] += s.read * s.times
        return out

    def top(self, n: int = 8) -> list[dict]:
        """The ``n`` sites that move the most bytes (for the report's explanations)."""
        rows = sorted(self.sites, key=lambda s: -s.bytes)[:n]
        return [{"op": s.instr.opcode, "name": s.instr.name, "times": s.times, "bytes": s.bytes,
                 "op_name": s.instr.op_name[-120:]} for s in rows if s.bytes > 0]


def traffic(module: Module) -> Traffic:
    sites: list[Site] = []
    loops: list[dict] = []
    unknown = 0

    def walk(name: str, times: int, in_loop: bool, seen: tuple):
        nonlocal unknown
        comp = module.computations.get(name)
        if comp is None or name in seen:
            return
        for ins in comp.instrs.values():
            if ins.opcode == "while":
                n = trip_count(module, comp, ins)
                loops.append({"name": ins.name, "trips": n, "op_name": ins.op_name[-120:], "times": times})
                if n is None:
                    unknown += 1
                body = ins.attr("body")
                cond = ins.attr("condition")
                walk(body, times * (n if n is not None else 1), True, seen + (name,))
                if cond:
                    walk(cond, times * ((n + 1) if n is not None else 1), True, seen + (name,))
                continue
            if ins.opcode == "conditional":
                branches = ins.called()
                best, best_sites = -1.0, []
                for b in branches:
                    before = len(sites)
                    walk(b, times, in_loop, seen + (name,))
                    got = sites[before:]
                    del sites[before:]
                    total = sum(s.bytes for s in got)
                    if total > best:
                        best, best_sites = total, got
                sites.extend(best_sites)
                continue
            if ins.opcode in ("call", "async-start") or (ins.opcode.endswith("-start") and ins.called()
                                                           and ins.opcode.removesuffix("-start") not in COLLECTIVES):
                for c in ins.called():
                    walk(c, times, in_loop, seen + (name,))
                if ins.opcode in ("call", "async-start"):
                    continue
            r, w = instr_bytes(module, comp, ins)
            sites.append(Site(name, ins, times, r, w, in_loop))

    walk(module.entry, 1, False, ())
    return Traffic(sites, loops, unknown)


# ---------------------------------------------------------------------------------------
# The lint
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Finding:
    rule: str            # weight_copy | cache_copy | host_transfer | donation | unknown_trip_count
    detail: str
    bytes: float = 0.0   # per call

    def as_dict(self) -> dict:
        return {"rule": self.rule, "detail": self.detail, "bytes": self.bytes}


def _moves_only(module: Module, ins: Instr) -> bool:
    """A fusion whose every instruction only moves data (copy, transpose, slice, concat, ...)."""
    fused = module.computations.get(ins.attr("calls") or "")
    if fused is None:
        return False
    ops = {i.opcode for i in fused.instrs.values()}
    return ops <= _MOVES | _BOOKKEEPING and bool(ops & _MOVES)


def lint(module: Module, tr: Traffic, *, weight_bytes: Iterable[float], cache_bytes: Iterable[float],
         min_bytes: float = 1 << 20) -> list[Finding]:
    """What a decode program should not do, with the bytes it costs per call:

    * ``weight_copy``: an instruction that only moves data (a copy, transpose, slice or
      concatenation, or a fusion of nothing else) into HBM and writes as many bytes as one
      weight tensor (one layer's, per device; within 2%): the weights are copied before use;
    * ``cache_copy``: the same for one layer's cache buffer (also concatenated with a block's
      new entries), or a move of anything the compiler names after the cache;
    * ``host_transfer``: send/recv/infeed/outfeed, or any array in host memory (``S(5)``);
    * ``unknown_trip_count``: a loop whose trip count could not be read (its bytes count once).

    ``weight_bytes`` / ``cache_bytes``: the per-device sizes of one layer's weight tensors and
    cache buffers (what a copy would match); only moves of at least ``min_bytes`` are looked at.
    """
    weights = sorted({float(b) for b in weight_bytes if b >= min_bytes})
    caches = sorted({float(b) for b in cache_bytes if b >= min_bytes})
    near = lambda size, sizes: any(abs(size - b) <= 0.02 * b for b in sizes)      # noqa: E731
    out: list[Finding] = []
    for s in tr.sites:
        ins = s.instr
        if ins.opcode in _HOST_OPS or any(a.space == HOST_SPACE for a in ins.type):
            out.append(Finding("host_transfer", f"{ins.opcode} {ins.name} ({ins.op_name[-80:]})", s.bytes))
            continue
        moves = ins.opcode in _MOVES or (ins.opcode == "fusion" and _moves_only(module, ins))
        if not moves or s.written < min_bytes:
            continue
        if ins.opcode == "copy-start" and ins.type and ins.type[0].space != 0:
            continue          # a prefetch into on-chip memory, the way a TPU streams operands
        size = s.written
        where = f"{ins.opcode} {ins.name} x{s.times}" + (f" ({ins.op_name[-90:]})" if ins.op_name else "")
        # a cache buffer (also concatenated with the block's new entries: within 2%), by name or size
        if "cache" in ins.op_name or (near(size, caches) and not near(size, weights)):
            out.append(Finding("cache_copy", where + f": {size / 2**20:.1f} MiB each", s.bytes))
        elif near(size, weights):
            out.append(Finding("weight_copy", where + f": {size / 2**20:.1f} MiB each", s.bytes))
    for loop in tr.loops:
        if loop["trips"] is None:
            out.append(Finding("unknown_trip_count", f"while {loop['name']} ({loop['op_name']})"))
    return out


def summarize(findings: list[Finding]) -> dict:
    """{rule: {"count", "bytes"}} over the findings."""
    out: dict[str, dict] = {}
    for f in findings:
        d = out.setdefault(f.rule, {"count": 0, "bytes": 0.0})
        d["count"] += 1
        d["bytes"] += f.bytes
    return out
