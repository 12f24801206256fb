"""Files without a fastckpt manifest (plain ``torch.save``, another checkpointer, a tool).

Nothing records what their bytes should be, so only their own structure can say they are
damaged: an empty file, one that starts with neither a zip nor a pickle header, a zip without its
end record, a pre-zip file shorter than its pickles say (``format.legacy``), or one that torch
fails to read. Whatever torch raises on a damaged byte (a struct or
index error of a truncated legacy file, an unknown opcode, a pickle that pops an empty stack) is
``CorruptCheckpointError`` naming the file, unless the file is sound (``load.soundness``: it loads
with what depends on this process taken away): then torch's error is for what the file holds here
(a GPU file without ``map_location``, a class renamed since) and reaches the caller as it is,
with a note naming the fix; so does it, saying so, when this process could not finish the check.
Only an ``UnpicklingError`` of a file whose pickles
parse (``pickletools``, which runs nothing) is weights_only refusing an object it does not allow:
that error keeps its note saying how to opt in, which must never be advice for a damaged file.
A global of a module not installed here (a training repo's class, loaded in an eval env) is no
damaged byte by itself: a sound file naming one raises torch's error (weights_only's refusal, or
``ModuleNotFoundError``) with a note that it is not damaged and naming the module to install. A name one
byte from ``torch`` or a standard-library module's (``torcj``) is taken for a damaged byte, unless the
zip's CRC-32 of the pickle holds (``_pickle_crc_holds``; a pre-zip file has none); any name in a
pickle whose CRC fails is.
"""

from __future__ import annotations

import _compat_pickle
import functools
import importlib.util
import io
import logging
import pickle
import pickletools
import struct
import sys
import threading
import typing
import zipfile
from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError, CorruptCheckpointError
from ..format.foreign import CUT_SHORT, EMPTY, InertUnpickler, bounded, is_data_pkl
from ..format.legacy import LEGACY_PICKLES, UnboundedPickle, legacy_end
from ..format.manifest import EOCD_SIG, TAIL_BYTES
from ..format.ranges import RangeReader
from .deserialize import deserialize, fetcher
from .image import ZIP_MAGIC
from .soundness import CannotCheck, sound

if TYPE_CHECKING:
    from ..io.engine import ReadResult
    from .loader import LoadOptions

log = logging.getLogger("fastckpt")
#: torch.save's pre-zip format: a pickle (protocol 2 by default; ``pickle_protocol=`` 3 to 5)
LEGACY_MAGIC = tuple(bytes([0x80, p]) for p in range(2, 6))
#: the fixes of what makes torch refuse an intact file here (the note on its error)
FIXES = ("map_location='cpu' for a file saved on a GPU, loaded where that GPU is not; weights_only=False, for a "
         "file you trust, for an object weights_only does not allow; a class importable under the name it was "
         "saved with")
#: what torch's readers raise on damaged bytes (the weights-only unpickler runs no code of the file's)
DAMAGE = (RuntimeError, EOFError, KeyError, ValueError, zipfile.BadZipFile, pickle.PickleError, struct.error,
          IndexError, AttributeError, TypeError, AssertionError, OverflowError)
#: the modules torch.save files name; one of them with one byte changed is damage, not a package to install
_KNOWN = ("torch", *(m for m in sys.stdlib_module_names if len(m) >= 5))
_warned: set[str] = set()  # paths loaded unverified that were reported already
_warned_lock = threading.Lock()


def warn_unverified(url: str) -> None:
    with _warned_lock:
        first = url not in _warned
        _warned.add(url)
    if first:
        log.warning("fastckpt: %s has no fastckpt manifest (written by plain torch.save or another tool?): loading "
                    "it unverified; load(..., verify=True) refuses such files", url)


def damage(res: ReadResult, url: str) -> CorruptCheckpointError | None:
    """What its first and last bytes show is wrong with a file without a manifest (None: nothing):
    cheap enough to run before ``verify=True`` refuses it, so that a checkpoint cut short is
    reported as damaged, not as a plain file to load unverified."""
    if res.size == 0:
        return CorruptCheckpointError(f"{url} {EMPTY}. Load an earlier checkpoint (fastckpt.latest(...)).")
    fetch = fetcher(res.buffer)
    head = fetch(0, min(4, res.size))
    if head != ZIP_MAGIC and not head.startswith(LEGACY_MAGIC):
        return CorruptCheckpointError(f"{url} is not a torch.save file (it starts with {head!r}, not a zip or "
                                      "pickle header): damaged, or not a checkpoint.")
    if head == ZIP_MAGIC and EOCD_SIG not in fetch(max(0, res.size - TAIL_BYTES), res.size):
        return CorruptCheckpointError(f"{url} {CUT_SHORT}. Load an earlier checkpoint (fastckpt.latest(...)).")
    other = _not_torch(res, head == ZIP_MAGIC)
    if other is not None:
        return CorruptCheckpointError(f"{url} is not a torch.save file: {other}. Load it with the tool that wrote "
                                      "it, or give a checkpoint.")
    return _legacy_damage(res, url) if head != ZIP_MAGIC else None


def _not_torch(res: ReadResult, is_zip: bool) -> str | None:
    """What an intact file that is no torch.save file is (a ``pickle.dump`` file, another tool's
    zip), so that it is not reported "truncated or damaged"; None: torch's, or cannot say."""
    stream = io.BufferedReader(RangeReader(res.size, fetcher(res.buffer)))
    try:
        if is_zip:
            names = zipfile.ZipFile(stream).namelist()
            whole = any(is_data_pkl(n) for n in names)
            return None if whole else "a zip archive without torch's <archive>/data.pkl"
        if not bounded(stream, res.size):  # (the first pickle only: walked to its STOP, nothing built)
            return None
        stream.seek(0)
        first = InertUnpickler(stream).load()
    except Exception:  # noqa: BLE001 (damaged or cut short: the checks after this one say which)
        return None
    if first != torch.serialization.MAGIC_NUMBER:
        return "a pickle whose first object is not torch's magic number (pickle.dump wrote it?)"
    return None


def _legacy_damage(res: ReadResult, url: str) -> CorruptCheckpointError | None:
    """A pre-zip file has no end record: its pickles say how long it must be (``format.legacy``)."""
    try:
        end = legacy_end(io.BufferedReader(RangeReader(res.size, fetcher(res.buffer))), res.size)
    except UnboundedPickle:
        return _unbounded(url)
    except (EOFError, ValueError) as exc:
        why = f"{exc}"
    except (MemoryError, OverflowError):  # a length field read whole before it is known to run past the end
        why = "a length in its pickles runs past the end of the file"
    else:
        if end is None or end <= res.size:
            return None
        why = f"its pickles put the end of its storages at byte {end}, but it has {res.size} bytes"
    return CorruptCheckpointError(f"{url} is truncated or damaged: a pre-zip torch.save file, and {why}. Load an "
                                  "earlier checkpoint (fastckpt.latest(...)).")


def load_unverified(res: ReadResult, url: str, opts: LoadOptions) -> object:
    """The object in a file without a manifest.

    Raises:
        CorruptCheckpointError: naming ``url``: it is damaged (``damage``), or torch cannot read it
            and it is not sound (``load.soundness``).
        ConfigError: the file is a TorchScript archive, which ``torch.jit.load`` loads.
        pickle.UnpicklingError: weights_only refused an object of a well-formed file (its note
            says how to opt in).
        Exception: torch's own error for a sound file, with a note (a GPU file loaded without
            ``map_location`` on a CPU node, a class renamed since it was saved): an intact file
            is never reported as damaged.
    """
    found = damage(res, url)
    if found is not None:
        raise found
    if not opts.weights_only and not _pickles_bounded(res):  # the C unpickler: see ``format.foreign.bounded``
        raise _unbounded(url)
    try:
        return deserialize(res.buffer, res.size, opts.map_location, opts.weights_only, url)
    except ConfigError:
        raise  # a TorchScript archive (``deserialize``): whole, but no checkpoint
    except pickle.UnpicklingError as exc:
        missing = _unimportable(res)
        if not opts.weights_only or missing is None:
            raise _damaged(url, exc) from exc
        if missing:  # a class of a module not installed here: refused, unless the name is a damaged byte
            _note_sound(res, url, exc, missing)
        raise  # weights_only refused an object: not damage (the error says how to opt in)
    except (*DAMAGE, ImportError) as exc:  # ImportError: weights_only=False, a module not installed here
        missing = _unimportable(res)
        if missing is None:
            raise _damaged(url, exc) from exc
        _note_sound(res, url, exc, missing)
        raise  # a GPU file without map_location, a class renamed since: torch's error names the fix


def _note_sound(res: ReadResult, url: str, exc: BaseException, missing: list[str]) -> None:
    """Notes on torch's error ``exc`` that the file is not damaged (or could not be checked here),
    and the fixes (``missing``: the modules its pickles name that are not installed here).

    Raises:
        CorruptCheckpointError: the file is not sound (``load.soundness``): damage.
    """
    if not _pickles_bounded(res):
        raise _damaged(url, exc) from exc
    try:
        intact, unchecked = sound(res.buffer, res.size), ""
    except CannotCheck as why:
        intact, unchecked = True, str(why)
    if not intact:
        raise _damaged(url, exc) from exc
    said = (f"and fastckpt could not check here whether it is damaged ({unchecked}): if it is not, " if unchecked
            else "but it is not damaged: it loads with its storages left where they are read (no device to "
            "restore) and its classes stubbed (load.soundness). ")
    this = "this" if unchecked else "This"
    fixes = FIXES if not missing else (
        f"make {' and '.join(missing)} importable here (install {'it' if len(missing) == 1 else 'them'}, or put "
        f"{'it' if len(missing) == 1 else 'them'} on sys.path); then, for a file you trust, load it with "
        "weights_only=False (weights_only=True imports nothing and refuses classes it does not allow)")
    exc.add_note(f"{url} has no fastckpt manifest, {said}{this} is torch's own error for what it holds here; the "
                 f"fixes: {fixes}.")

def _unbounded(url: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{url} is damaged: its pickle names a memo slot or frame larger than the file "
                                  "(a damaged byte, or a file cut short: unpickling it would allocate gigabytes). "
                                  "Load an earlier checkpoint (fastckpt.latest(...)).")


def _damaged(url: str, exc: BaseException) -> CorruptCheckpointError:
    said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return CorruptCheckpointError(f"{url} is truncated or damaged: torch cannot read it ({type(exc).__name__}: "
                                  f"{said}). Load an earlier checkpoint (fastckpt.latest(...)).")


def _pickles(res: ReadResult) -> tuple[typing.IO[bytes], int]:
    """The stream of the file's pickles, and how many it holds (``data.pkl`` of a zip; the
    ``LEGACY_PICKLES`` of a pre-zip file, one after another)."""
    fetch = fetcher(res.buffer)
    if fetch(0, 4) == ZIP_MAGIC:
        reader = torch._C.PyTorchFileReader(RangeReader(res.size, fetch))
        name = next(r for r in reader.get_all_records() if r.rsplit("/", 1)[-1] == "data.pkl")
        return io.BytesIO(reader.get_record(name)), 1
    return io.BufferedReader(RangeReader(res.size, fetch)), LEGACY_PICKLES


def _pickle_crc_holds(res: ReadResult) -> bool | None:
    """Whether the file's ``data.pkl`` matches the CRC-32 its zip header records (torch.save writes
    one): a module name in it that is not installed here is then the module's own, not a damaged
    byte. None: not a zip, or no CRC recorded (the name check stands)."""
    try:
        zf = zipfile.ZipFile(io.BufferedReader(RangeReader(res.size, fetcher(res.buffer))))
        info = next(i for i in zf.infolist() if is_data_pkl(i.filename))
    except Exception:  # noqa: BLE001 (not a zip, or its directory damaged: torch's read said so already)
        return None
    if info.CRC == 0:
        return None
    try:
        zf.read(info)
    except zipfile.BadZipFile:  # "Bad CRC-32"
        return False
    return True


def _pickles_bounded(res: ReadResult) -> bool:
    """Whether no pickle of the file asks the unpickler for memory it does not pay for (a damaged
    byte of a memo index: ``format.foreign.bounded``); torch's weights-only unpickler keeps its memo
    in a dict, the C one used with ``weights_only=False`` in an array grown to the index."""
    try:
        stream, count = _pickles(res)
        return all(bounded(stream, res.size) for _ in range(count))
    except Exception:  # noqa: BLE001 (a malformed pickle: torch's own read then says what is wrong)
        return True


def _unimportable(res: ReadResult) -> list[str] | None:
    """The top-level modules the file's pickles name that are not installed here ([] : none), or
    None when the pickles are malformed: an unknown opcode, an argument cut short, the stack or memo
    inconsistent before the STOP (``pickletools.dis``, which builds no object), or a global whose
    name is no dotted identifiers (``_module_of``). A module not installed here is no damage by itself:
    a training repo's class in a file loaded in an eval env (``load.soundness`` decides then)."""
    missing: list[str] = []
    crc = functools.cache(lambda: _pickle_crc_holds(res))  # asked once, for the first name not installed here
    try:
        stream, count = _pickles(res)
        for _ in range(count):
            start = stream.tell()
            pickletools.dis(stream, out=_Sink())
            stream.seek(start)
            for op, arg, _pos in pickletools.genops(stream):
                if op.name != "GLOBAL":
                    continue
                top = _module_of(str(arg))
                if top is None:
                    return None  # a name no import could find: a damaged byte
                if top in sys.modules or top in missing or importlib.util.find_spec(top) is not None:
                    continue
                near = any(len(k) == len(top) and sum(a != b for a, b in zip(k, top)) == 1 for k in _KNOWN)
                if (held := crc()) is False or held is None and near:
                    return None  # a pickle its zip's CRC refuses; in a file without one, torcj: a damaged byte
                missing.append(top)
    except Exception:  # noqa: BLE001 (any failure to parse is a malformed pickle)
        return None
    return missing


def _module_of(ref: str) -> str | None:
    """The top-level package of ``module name`` (a GLOBAL's argument; None: not dotted identifiers),
    looked up by the caller, never imported (``find_spec`` of a top-level name imports nothing).
    Python 2 names (``__builtin__ set``, ``copy_reg``) are mapped first, as ``pickle`` does."""
    module, _, name = ref.partition(" ")  # protocol 2 (torch.save) writes Python 2 names: as find_class maps them
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    parts = [*_compat_pickle.IMPORT_MAPPING.get(module, module).split("."), *(name.split(".") if name else ())]
    return parts[0] if all(p.isidentifier() for p in parts) else None


class _Sink(io.TextIOBase):
    """Where ``pickletools.dis`` writes its listing: nowhere (only its checks are wanted)."""

    def write(self, s: str) -> int:
        return len(s)
