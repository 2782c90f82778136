"""What a pickle would cost to unpickle, found by walking its opcodes without building anything.

The C unpickler has no limits of its own a restricted ``find_class`` could add: one byte
(``]``, EMPTY_LIST) builds an 80-byte list, so a 16 MiB pickle of them holds 1.3 GiB,
and one ``LONG_BINPUT`` of index 2**28 (a 10-byte pickle) makes it allocate and zero a
memo table of 2**29 pointers (4 GiB). :func:`check_pickle_cost` reads every opcode and
its argument (lengths only, nothing decoded), adds up an upper estimate of the bytes each
leaves behind (the object it pushes, a stack or memo slot) and refuses, before the real
unpickler runs, a pickle estimated to hold over ``amplification`` times its own size, a
memo index beyond the memo's size (picklers number entries from 0, one by one), an
unknown opcode, or a pickle that ends before STOP.

A state dict pickled by torch is estimated at 13-20x its size (~120 bytes of pickle and
~1.5 KB of estimate per tensor: its name, storage key, shape and stride tuples, two
REDUCEs, one persistent id); tracemalloc measures 7-10x. The estimate errs high, so a
crafted pickle just under a budget of 40x its size grows a process by ~28x (an 8 MiB one
of EMPTY_LISTs and MARKs: +227 MiB), where it grew by ~80x (+713 MiB for 8 MiB of lists).
"""

from __future__ import annotations

import pickletools

from ..errors import CorruptSourceError

__all__ = ["check_pickle_cost"]

_STACK = 8  # a reference pushed (None, a cached small int, a memo get)
_MEMO = 16  # a memo slot; the table doubles as it grows
_OBJECT = 80  # an int, float or small tuple
_CONTAINER = 128  # a list or dict (empty: ~80), or its first insert (a dict's table: ~230)
_LARGE = 256  # a set, or whatever REDUCE, BUILD, a global or a persistent id makes

_WEIGHTS: dict[str, int] = {
    **dict.fromkeys(["STOP", "PROTO", "FRAME", "POP", "POP_MARK"], 0),
    **dict.fromkeys(["MARK", "NONE", "NEWTRUE", "NEWFALSE", "EMPTY_TUPLE", "BININT1", "DUP"], _STACK),
    **dict.fromkeys(["GET", "BINGET", "LONG_BINGET"], _STACK),
    **dict.fromkeys(["PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"], _MEMO),
    **dict.fromkeys(["INT", "BININT", "BININT2", "LONG", "FLOAT", "BINFLOAT"], _OBJECT),
    **dict.fromkeys(["TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NEXT_BUFFER", "READONLY_BUFFER"], _OBJECT),
    **dict.fromkeys(["EMPTY_LIST", "LIST", "EMPTY_DICT", "DICT"], _CONTAINER),
    **dict.fromkeys(["APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS"], _CONTAINER),
    **dict.fromkeys(["EMPTY_SET", "FROZENSET", "REDUCE", "BUILD", "INST", "OBJ"], _LARGE),
    **dict.fromkeys(["NEWOBJ", "NEWOBJ_EX", "GLOBAL", "STACK_GLOBAL", "PERSID", "BINPERSID"], _LARGE),
    **dict.fromkeys(["EXT1", "EXT2", "EXT4"], _LARGE),
}
"""Estimated bytes an opcode leaves behind; strings, bytes and longs add their length to _OBJECT."""

_LINE, _PAIR = -1, -10  # an argument up to a newline; GLOBAL/INST: two lines
_COUNTED = {
    pickletools.TAKEN_FROM_ARGUMENT1: (1, False),
    pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
    pickletools.TAKEN_FROM_ARGUMENT4U: (4, False),
    pickletools.TAKEN_FROM_ARGUMENT8U: (8, False),
}


def _table() -> dict[int, tuple[str, int, int, bool, int]]:
    """code -> (name, fixed argument bytes or _LINE/_PAIR, counted-length width, signed, weight)."""
    table = {}
    for op in pickletools.opcodes:
        arg = op.arg
        fixed, width, signed = 0, 0, False
        if arg is not None:
            if arg.n in _COUNTED:
                width, signed = _COUNTED[arg.n]
            elif arg.n == pickletools.UP_TO_NEWLINE:
                fixed = _PAIR if arg.name == "stringnl_noescape_pair" else _LINE
            else:
                fixed = arg.n
        weight = _WEIGHTS.get(op.name, _OBJECT)
        table[ord(op.code)] = (op.name, fixed, width, signed, weight)
    return table


_OPCODES = _table()
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})


def check_pickle_cost(data: bytes, amplification: int, floor: int, what: str) -> None:
    """Refuse (:class:`CorruptSourceError` naming ``what``) the pickle ``data`` if unpickling it
    could hold over ``amplification * len(data) + floor`` bytes, or its memo be indexed past
    its size, or it is not a whole pickle. Time: one pass over the opcodes; no memory."""
    budget = amplification * len(data) + floor
    size = len(data)
    pos = cost = puts = 0
    while True:
        if pos >= size:
            raise CorruptSourceError(f"{what}: the pickle is truncated (no STOP opcode at its end)")
        entry = _OPCODES.get(data[pos])
        if entry is None:
            raise CorruptSourceError(
                f"{what}: byte {pos} of the pickle ({data[pos]:#04x}) is not a pickle opcode"
            )
        name, fixed, width, signed, weight = entry
        start = pos = pos + 1
        if width:
            length = int.from_bytes(data[pos : pos + width], "little", signed=signed)
            if length < 0:
                raise CorruptSourceError(f"{what}: a negative length at byte {pos} of the pickle")
            pos += width + length
            weight += length
        elif fixed in (_LINE, _PAIR):
            for _ in range(1 if fixed == _LINE else 2):
                end = data.find(b"\n", pos)
                pos = size + 1 if end < 0 else end + 1
            weight += pos - start
        else:
            pos += fixed
        if pos > size:
            raise CorruptSourceError(f"{what}: the pickle is truncated (in a {name} at byte {start - 1})")
        if name in _PUTS:
            index = _memo_index(name, data[start:pos], puts)
            if index > puts:
                raise CorruptSourceError(
                    f"{what}: the pickle stores memo entry {index} when it has {puts} (a pickler numbers "
                    "them one by one; a far index makes the unpickler allocate a table that large): "
                    "crafted or corrupt"
                )
            puts += 1
        cost += weight
        if cost > budget:
            raise CorruptSourceError(
                f"{what}: unpickling it would build over {budget} bytes of objects from {size} bytes of "
                f"pickle (a state dict's: 13-20x its size; refused at byte {start - 1}): crafted or corrupt"
            )
        if name == "STOP":
            return


def _memo_index(name: str, arg: bytes, puts: int) -> int:
    if name == "MEMOIZE":
        return puts
    if name == "PUT":
        text = arg.strip()
        return int(text) if text.isdigit() and len(text) < 20 else 1 << 64
    return int.from_bytes(arg, "little")
