"""Where a pre-zip ``torch.save`` file (``_use_new_zipfile_serialization=False``) should end.

Such a file is five pickles (magic number, protocol, system info, the object, the list of its
storages' keys), then each storage in that list's order: its element count (8 bytes, the byte
order the system info names) and its elements. Nothing records a checksum, and no end record
says it is whole, as a zip's does; but its pickles say how long it must be. Reading them costs
a walk of the pickles (the object's with the inert unpickler of ``format.foreign``: no code of
the file runs, no tensor is built) and one 8-byte read per storage: cheap enough to run before
``verify=True`` refuses the file as unverifiable, so that one cut short is named as damaged
(torch itself finds that only by loading every storage).
"""

from __future__ import annotations

import pickletools
import typing

import torch

from .foreign import InertUnpickler, Stub, bounded

LEGACY_PICKLES = 5  # magic number, protocol, sys info, the object, storage keys
_VALUES = {2: "info", 3: "object", 4: "keys"}  # the pickles read for their values (0-based), not only walked
COUNT_BYTES = 8  # each storage's element count, before its elements
# the storage classes a pre-zip file names (torch's own table, as its legacy save names them): element bytes
_ITEM_BYTES = {name: dtype.itemsize for dtype, name in torch.storage._dtype_to_storage_type_map().items()}
_ITEM_BYTES["UntypedStorage"] = 1


class UnboundedPickle(ValueError):
    """A pickle names a memo slot or frame no whole pickle can (``format.foreign.bounded``)."""


class _StorageTypes(InertUnpickler):
    """The inert unpickler, keeping each storage's class name by its key (``persistent_load``)."""

    def __init__(self, stream: typing.IO[bytes]) -> None:
        super().__init__(stream)
        self.types: dict[str, str] = {}

    def find_class(self, module: str, name: str) -> type:
        # torch.FloatStorage, torch.storage.UntypedStorage, an old file's torch.cuda.FloatStorage
        return type(name, (Stub,), {}) if module.split(".")[0] == "torch" and name.endswith("Storage") else Stub

    def persistent_load(self, pid: object) -> type | None:
        # ('storage', storage class, key, location, element count, view metadata); ('module', class, file, source)
        if isinstance(pid, tuple) and len(pid) > 2 and pid[0] == "storage" and isinstance(pid[1], type):
            self.types[str(pid[2])] = pid[1].__name__
        return Stub if isinstance(pid, tuple) and pid[:1] == ("module",) else None


def legacy_end(stream: typing.IO[bytes], size: int) -> int | None:
    """The size the pre-zip file read by ``stream`` (``size`` bytes) must have at least.

    Returns None where this cannot say, never a false alarm: an object the inert unpickler cannot
    stand in for, a storage class not known here.

    Raises:
        EOFError: the file ends inside its pickles or its storages' counts (cut short).
        UnboundedPickle: a pickle names a memo slot or frame no whole pickle can (a damaged byte,
            or a frame past the end of a file cut short).
        ValueError: a pickle does not parse (a damaged byte), or a storage's count is negative.
    """
    got: dict[str, object] = {}
    types: dict[str, str] = {}
    for n in range(LEGACY_PICKLES):
        start, which = stream.tell(), f"pickle {n + 1} of {LEGACY_PICKLES}"
        try:
            whole = bounded(stream, size)  # walks the pickle to its STOP (genops): nothing is built
        except ValueError as exc:  # genops: an opcode unknown, or an argument or the STOP past the end
            if stream.tell() >= size:
                raise EOFError(f"it ends inside its {which}") from exc
            raise ValueError(f"its {which} does not parse ({exc})") from exc
        if not whole:
            stream.seek(start)
            if _frame_past_end(stream, size):
                raise EOFError(f"it ends inside its {which} (a frame of it runs past the end)")
            raise UnboundedPickle(f"its {which} names a memo slot or frame larger than the file")
        if n in _VALUES:
            stream.seek(start)
            reader = _StorageTypes(stream)
            try:
                got[_VALUES[n]] = reader.load()
            except Exception:  # noqa: BLE001 (an object the inert unpickler cannot stand in for: no verdict)
                return None
            types.update(reader.types)
    keys, info = got["keys"], got["info"]
    if not isinstance(keys, list) or any(types.get(str(k)) not in _ITEM_BYTES for k in keys):
        return None
    end = stream.tell()
    for _key, _count, end in storage_counts(stream, keys, info, lambda k: _ITEM_BYTES[types[str(k)]]):  # noqa: B007
        pass  # (to the last storage's end)
    return end


def storage_counts(stream: typing.IO[bytes], keys: typing.Iterable[object], info: object,
                   width: typing.Callable[[object], int]) -> typing.Iterator[tuple[object, int, int]]:
    """Each storage of a pre-zip file, in the order of its storage keys (``keys``), from where
    ``stream`` stands (just past the keys' pickle): its key, its element count, and where its
    elements end (``width(key)``: the bytes of one). One 8-byte read each, the elements skipped:
    the walk ``legacy_end`` and ``load.soundness`` share, which torch makes only by reading every
    storage (so torch's checks of it can be repeated without reading or allocating one).

    Raises:
        EOFError: the file ends before a storage's element count.
        ValueError: a storage's element count is negative.
    """
    order = "big" if isinstance(info, dict) and info.get("little_endian") is False else "little"
    end = stream.tell()
    for k in keys:
        stream.seek(end)
        count = stream.read(COUNT_BYTES)
        if len(count) < COUNT_BYTES:
            raise EOFError(f"it ends before the element count of its storage {k}")
        elements = int.from_bytes(count, order, signed=True)
        if elements < 0:
            raise ValueError(f"its storage {k} has a negative element count ({elements})")
        end += COUNT_BYTES + elements * width(k)
        yield k, elements, end


def _frame_past_end(stream: typing.IO[bytes], size: int) -> bool:
    """Whether a frame (protocol 4 and 5) of the pickle at ``stream`` runs past the end of the
    file: cut short, where ``bounded`` sees only a frame larger than it allows."""
    try:
        for op, arg, _ in pickletools.genops(stream):
            if op.name == "FRAME" and stream.tell() + int(arg) > size:
                return True
    except ValueError:  # (the walk ends at the cut)
        pass
    return False
