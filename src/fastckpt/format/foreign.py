"""Checkpoints written without fastckpt (``torch.save``, Lightning's ``TorchCheckpointIO``,
DeepSpeed's own engine), recognised from their bytes so that a run that switches to fastckpt
resumes from the checkpoints it already has.

A ``torch.save`` file is a zip whose central directory holds ``<archive>/data.pkl``. It is
complete when its end-of-central-directory record (zip64 included) ends the file and the
central directory it points at lies before it: a writer killed mid-file leaves no such record
(it is written last). Nothing here checks the payload: such a file has no checksum, so it loads
unverified.

The training step such a file records is read from its pickle (``data.pkl``) without running
any of its code: every class it names is replaced by an inert stub (a dict that takes the items
of dict and list subclasses, ``Stub``) and every tensor storage by None, so only plain values
(the top-level ``global_step``, ``iteration`` or ``step``) survive. Its opcodes are walked first
(``bounded``): the unpickler sizes memory by the pickle's own fields (its memo array grows to
the largest index a ``PUT`` names), and one damaged byte there would have it allocate gigabytes.

Only bytes are handled here; the reads are the caller's (``commit.discovery``), so the same
code serves a directory and an object store.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
import typing
from dataclasses import dataclass

from .manifest import EOCD_LEN, EOCD_SIG, LOCAL_SIG

STEP_KEYS = ("global_step", "iteration", "step")  # Lightning, Megatron, plain loops (and fastckpt's docs)
CD_SIG = b"PK\x01\x02"
# what is wrong with a file without a manifest, as a load and a listing both say it
EMPTY = "is empty (0 bytes): it was truncated or never written"
CUT_SHORT = "is truncated: it is a zip (a torch.save or fastckpt file) without the end record every zip ends with"
ZIP64_LOCATOR_SIG = b"PK\x06\x07"
ZIP64_EOCD_SIG = b"PK\x06\x06"
LOCAL_HEADER_LEN = 30
MAX_PICKLE_BYTES = 64 << 20  # a pickle this large is not read for its step
MEMO_PUTS = ("PUT", "BINPUT", "LONG_BINPUT")


#: what only a TorchScript archive holds at the top of its zip (``constants.pkl``, ``code/``)
_TORCHSCRIPT_ENTRIES = frozenset({"constants.pkl", "code"})


@dataclass(frozen=True)
class ZipEnd:
    """Where a complete zip's central directory is (from its end-of-central-directory record)."""

    cd_offset: int
    cd_size: int


@dataclass(frozen=True)
class Record:
    """One stored (uncompressed) member of a zip: its local header's offset and its size; ``limit``
    (when known, else 0): the offset its bytes end before, the central directory's (a damaged size
    or offset runs past it, and past the file's end)."""

    name: str
    header_offset: int
    size: int
    limit: int = 0


def zip_end(tail: bytes, size: int, zip64: bytes = b"") -> ZipEnd | int | None:
    """The central directory of a complete zip whose last ``len(tail)`` bytes are ``tail``.

    Returns a ``ZipEnd``; None when the bytes do not end with an end-of-central-directory record
    (not a zip, or one cut short); or, for a zip64 file whose ``zip64`` record was not passed,
    the offset of that record: call again with the 56 bytes read there.
    """
    start = size - len(tail)
    idx = tail.rfind(EOCD_SIG)
    while idx >= 0:
        if idx + EOCD_LEN <= len(tail) and idx + EOCD_LEN + struct.unpack_from("<H", tail, idx + 20)[0] == len(tail):
            break
        idx = tail.rfind(EOCD_SIG, 0, idx)
    else:
        return None
    cd_size, cd_offset = struct.unpack_from("<II", tail, idx + 12)
    if 0xFFFFFFFF in (cd_size, cd_offset):  # zip64: the locator sits right before the record
        loc = idx - 20
        if loc < 0 or tail[loc:loc + 4] != ZIP64_LOCATOR_SIG:
            return None
        (rec,) = struct.unpack_from("<Q", tail, loc + 8)
        if not zip64:
            return rec
        if zip64[:4] != ZIP64_EOCD_SIG or len(zip64) < 56:
            return None
        cd_size, cd_offset = struct.unpack_from("<QQ", zip64, 40)
        end_of_cd = rec
    else:
        end_of_cd = start + idx
    if cd_offset + cd_size > end_of_cd:
        return None
    return ZipEnd(cd_offset, cd_size)


def is_data_pkl(name: str) -> bool:
    """Whether a zip member is a ``torch.save`` file's pickle: ``<archive>/data.pkl``."""
    return name.endswith("/data.pkl") and name.count("/") == 1


def pickle_record(cd: bytes) -> Record | None:
    """The ``<archive>/data.pkl`` member named in a central directory; None when there is none
    (a zip that is not a ``torch.save`` file), it is compressed (torch never compresses it), or
    the zip is a TorchScript archive (``torch.jit.save``: it has a ``data.pkl`` too, beside
    ``constants.pkl`` and ``code/``, and is a model export, not a checkpoint; ``torch.load``
    tells them apart the same way)."""
    pos, found = 0, None
    while pos + 46 <= len(cd) and cd[pos:pos + 4] == CD_SIG:
        method, = struct.unpack_from("<H", cd, pos + 10)
        csize, = struct.unpack_from("<I", cd, pos + 20)
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", cd, pos + 28)
        offset, = struct.unpack_from("<I", cd, pos + 42)
        name = cd[pos + 46:pos + 46 + name_len].decode("utf-8", "replace")
        if "/" in name and name.split("/", 2)[1] in _TORCHSCRIPT_ENTRIES:
            return None
        if is_data_pkl(name) and found is None:
            if method != 0:
                return None
            if 0xFFFFFFFF in (csize, offset):
                csize, offset = _zip64_extra(cd[pos + 46 + name_len:pos + 46 + name_len + extra_len], csize, offset)
            found = Record(name, offset, csize)
        pos += 46 + name_len + extra_len + comment_len
    return found


def _zip64_extra(extra: bytes, csize: int, offset: int) -> tuple[int, int]:
    """Sizes and offset from a zip64 extra field (only the fields that overflowed are there)."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if tag == 0x0001:  # a damaged length may claim more bytes than the field has: read those it has
            vals = list(struct.unpack_from(f"<{min(n, len(extra) - pos - 4) // 8}Q", extra, pos + 4))
            # order: uncompressed size, compressed size, header offset (each only if overflowed)
            usize = vals.pop(0) if csize == 0xFFFFFFFF and vals else None
            csize = vals.pop(0) if csize == 0xFFFFFFFF and vals else (usize if usize is not None else csize)
            offset = vals.pop(0) if offset == 0xFFFFFFFF and vals else offset
            return csize, offset
        pos += 4 + n
    return csize, offset


def data_offset(local_header: bytes) -> int | None:
    """Where a member's bytes start, relative to its local header (None: not a local header)."""
    if local_header[:4] != LOCAL_SIG or len(local_header) < LOCAL_HEADER_LEN:
        return None
    name_len, extra_len = struct.unpack_from("<HH", local_header, 26)
    return LOCAL_HEADER_LEN + name_len + extra_len


class Stub(dict):
    """Stands in for every class a pickle names: accepts any arguments and state, runs nothing.

    It is a dict, and accepts appends, because the pickles of dict and list subclasses set or
    append their items after building the object (``SETITEMS``, ``APPENDS``): Lightning saves
    ``model.state_dict()`` (an ``OrderedDict``), hyper-parameters in an ``AttributeDict``, loop
    states in ``defaultdict``s. A stub that refused them failed the whole parse, and the step
    beside them was lost. Items set are kept (a top-level ``OrderedDict`` still shows its step);
    appended ones are dropped. Hashable by identity, as a plain object is, for a stub used as a key.
    """

    __hash__ = object.__hash__

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__()

    def __setstate__(self, state: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> Stub:
        return Stub()

    def append(self, item: object) -> None:
        pass

    def extend(self, items: object) -> None:
        pass


class InertUnpickler(pickle.Unpickler):
    """Runs no code of the pickle: every class it names is a ``Stub``, every storage None."""

    def find_class(self, module: str, name: str) -> type:
        return Stub

    def persistent_load(self, pid: object) -> None:
        return None


def plain_in_pickle(data: bytes) -> object | None:
    """A ``torch.save`` pickle's object, built without running any of its code (every class a
    ``Stub``, every storage None): its plain values (strings, numbers, dicts, lists) only; None when
    it does not parse. Never raises."""
    try:
        if not bounded(data):
            return None
        return InertUnpickler(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 (whatever a damaged pickle makes the unpickler raise)
        return None


def step_in_pickle(data: bytes) -> int | None:
    """The step a ``torch.save`` pickle records at its top level (``STEP_KEYS``, in that order of
    preference), read without running any of its code; None when it records none or does not
    parse. Never raises: a damaged pickle only costs its file its step (``latest`` orders it by time)."""
    obj = plain_in_pickle(data)
    if isinstance(obj, dict):
        for key in STEP_KEYS:
            value = obj.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def bounded(data: bytes | typing.IO[bytes], size: int | None = None) -> bool:
    """Whether no opcode of ``data`` asks the unpickler for memory the pickle does not pay for.

    Every counted argument (a string's or bytes' length) must lie inside ``data`` (``genops``
    reads it, and fails when it does not), a frame must fit in ``data``, and each memo index a
    ``PUT`` names must be no larger than the number of opcodes before it (a pickler numbers its
    memo 0, 1, 2, ...): the C unpickler grows and zeroes its memo array up to that index, so one
    flipped high byte of a ``LONG_BINPUT`` (torch uses them past 255 memo entries) asked for 32 GiB.
    """
    limit = len(data) if size is None else size  # type: ignore[arg-type]
    for n, (op, arg, _) in enumerate(pickletools.genops(data)):  # one pickle: a stream is read to its STOP
        if op.name in MEMO_PUTS and int(arg) > n or op.name == "FRAME" and arg > limit:
            return False
    return True
