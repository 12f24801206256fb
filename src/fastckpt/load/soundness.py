"""Whether a file without a manifest that torch failed to load is sound: torch's own error for
an intact file (a GPU file loaded without ``map_location`` on a CPU node, a class renamed since
it was saved) must reach the caller as it is, never as "damaged" (``load.unverified``).

No checksum says so, so the file is loaded once more, the way torch loads it, with everything
that depends on this process rather than on the bytes taken away: every storage left where it
was read (views of the file's bytes: no device to restore, no copy; its location tag must still
name a device type torch knows), and every class outside torch and the standard library an
inert ``Stub`` (``format.foreign``: nothing of the file's runs; what torch's weights-only
unpickler allows is real). What still fails is in the bytes: an unknown opcode, a name torch or
the standard library does not have (``torch._utils._sebuild_tensor_v2``), a storage record that
is missing, a location tag no device has, arguments a rebuild function does not take.

A zip file is loaded from the image in place. A pre-zip file goes through torch's legacy loader
under ``skip_data`` with every storage on the meta device: its pickles are checked, its storages
neither read nor allocated (``load.unverified`` checked first that the file is as long as its
pickles say). What torch checks only as it reads the storages, and ``skip_data`` skips, is checked
on their 8-byte element counts alone: every storage key one the object's pickle named, each
storage's count the one its persistent id gave, and its elements within the file. ``torch.load``
itself is not called: it copied the image and every storage (3x the file's memory, an OOM where
torch's error was wanted), and under ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`` it refuses the stubbing
unpickler outright, which was taken for damage. A check that this process cannot finish (out of
memory, too deep a recursion) says so (``CannotCheck``): that is no damage.
"""

from __future__ import annotations

import io
import pickle
import sys
import types
import typing
from collections.abc import Callable

import torch

from ..format.foreign import Stub
from ..format.legacy import storage_counts
from ..format.ranges import RangeReader
from .deserialize import fetcher
from .image import ZIP_MAGIC, HeapImage


class CannotCheck(Exception):  # noqa: N818 (a verdict, not a failure of the caller's)
    """The check could not run to its end in this process (its message says why): the file may
    be intact or damaged, and is reported as neither."""


def sound(buf, size: int) -> bool:  # noqa: ANN001
    """Whether the file image ``buf[:size]`` loads when nothing of this process can make it fail
    (the caller checked first that its pickles are bounded, and a pre-zip file's length: this runs
    the C unpickler).

    Raises:
        CannotCheck: this process could not finish the check (out of memory, recursion too deep).
    """
    fetch = fetcher(buf)
    try:
        if fetch(0, 4) != ZIP_MAGIC:
            return _legacy_sound(RangeReader(size, fetch), size)
        reader = torch._C.PyTorchFileReader(RangeReader(size, fetch))
        if "byteorder" in reader.get_all_records() and reader.get_record("byteorder") not in (b"little", b"big"):
            return False
        whole = buf if isinstance(buf, HeapImage) else torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()
        torch.serialization._load(reader, _where_read, _MODULE, overall_storage=whole)
    except (MemoryError, RecursionError) as exc:  # this process's limits, not the file's bytes
        raise CannotCheck(f"{type(exc).__name__} while checking it: {exc}") from exc
    except Exception:  # noqa: BLE001 (whatever fails without this process's part is in the bytes)
        return False
    return True


class _Unpickler(pickle.Unpickler):
    """torch's names resolved as its weights-only unpickler allows them, the standard library's and
    torch's other names checked to exist (a ``Stub`` then), everyone else's a ``Stub``; every
    persistent id's location a device torch knows."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):
            return _rebuild_from_type
        allowed = _allowed()
        if f"{module}.{name}" in allowed:
            return allowed[f"{module}.{name}"]
        top = module.split(".")[0]
        if top == "torch" or top in sys.stdlib_module_names:
            obj: object = sys.modules.get(module)  # not imported here: nothing to check without running its code
            for part in name.split(".") if obj is not None else ():
                obj = getattr(obj, part)  # AttributeError: a name it does not have (a damaged byte)
        return Stub

    @property
    def persistent_load(self) -> Callable[[object], object]:
        return pickle.Unpickler.persistent_load.__get__(self)  # type: ignore[attr-defined]

    @persistent_load.setter
    def persistent_load(self, load: Callable[[object], object]) -> None:
        def checked(pid: object) -> object:
            if isinstance(pid, tuple) and len(pid) > 3:  # a storage's: (..., location, ...)
                where = pid[3].decode("ascii") if isinstance(pid[3], bytes) else pid[3]
                if not isinstance(where, str):
                    raise TypeError(f"a storage's location is a {type(where).__name__}, not a device name")
                torch.device(where)  # RuntimeError: no device type of that name (a damaged tag)
            return load(pid)

        pickle.Unpickler.persistent_load.__set__(self, checked)  # type: ignore[attr-defined]


def _where_read(storage: torch.UntypedStorage, _location: str) -> torch.UntypedStorage:
    """``map_location``: every storage stays where it was read (views of the file's bytes)."""
    return storage


def _legacy_sound(file: RangeReader, size: int) -> bool:
    """Whether the pre-zip file read by ``file`` (``size`` bytes) loads, its storages neither read
    nor allocated: torch's legacy loader under ``skip_data`` checks its pickles, then skips the checks
    torch makes as it reads the storages, which are repeated here on their 8-byte element counts alone
    (``format.legacy.storage_counts``): every storage key is one the object's pickle named, and each
    storage's count is the one its persistent id gave (torch: "storage has wrong byte size"), and it
    ends within the file."""
    check, stream = _LegacyCheck(), io.BufferedReader(file)
    with torch.serialization.skip_data():  # thread-local: the storages' bytes are not read
        torch.serialization._legacy_load(stream, _where_read, check, encoding="utf-8")  # torch.load's (Python 2 str)
    file.seek(stream.tell())  # the counts read unbuffered: 8 bytes each, not a buffer of the storage's elements
    info, keys = check.loaded[2], check.loaded[3]  # magic number, protocol, sys info, storage keys
    storages = check.Unpickler.storages
    if not all(k in storages for k in keys):
        return False  # torch: "storage key ... not found"
    widths = {k: torch._utils._element_size(storages[k].dtype) for k in keys}
    return all(count * widths[k] == storages[k]._untyped_storage.nbytes() and end <= size
               for k, count, end in storage_counts(file, keys, info, widths.__getitem__))


class _MetaUnpickler(_Unpickler):
    """A pre-zip file's pickle: each storage a meta storage of its size, which holds no memory
    (torch's legacy loader allocates every storage, even under ``skip_data``: a large file's
    check could then fail for want of memory, and that was taken for damage). Each is kept by its
    key, root or view, as torch keeps them (``storages``, one dict per check: ``_LegacyCheck``)."""

    storages: dict[object, torch.storage.TypedStorage]

    @_Unpickler.persistent_load.setter
    def persistent_load(self, load: Callable[[object], object]) -> None:
        storages = self.storages

        def on_meta(pid: object) -> object:
            if isinstance(pid, tuple) and pid[:1] in (("module",), (b"module",)):
                # a whole module's class (pid[1]: ('module', class, source file, source)): torch compares its source
                # with the one saved, which says nothing of the bytes (a Stub has no dump_patches: an error taken for
                # damage), and may write a .patch file into the working directory
                return pid[1]
            if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] in ("storage", b"storage")):
                return load(pid)  # what torch itself refuses
            _, storage_type, root_key, location, numel, view = pid
            where = location.decode("ascii") if isinstance(location, bytes) else location
            torch.device(where)  # RuntimeError, TypeError: no device type of that name (a damaged tag)
            dtype, width = storage_type.dtype, torch._utils._element_size(storage_type.dtype)
            if root_key not in storages:  # torch's legacy persistent_load: the first id of a root sets its dtype
                meta = torch.UntypedStorage(numel * width, device="meta")
                storages[root_key] = torch.storage.TypedStorage(wrap_storage=meta, dtype=dtype, _internal=True)
            root = storages[root_key]
            if view is None:
                return root
            view_key, offset, count = view  # in elements
            if view_key not in storages:
                part = root._untyped_storage[offset * width:(offset + count) * width]
                storages[view_key] = torch.storage.TypedStorage(wrap_storage=part, dtype=dtype, _internal=True)
            return storages[view_key]

        pickle.Unpickler.persistent_load.__set__(self, on_meta)  # type: ignore[attr-defined]


class _LegacyCheck:
    """The pickle module torch's legacy loader is given for one check (``pickle_module``): its
    ``Unpickler`` a ``_MetaUnpickler`` keeping this check's storages, its ``load`` (the headers
    and the storage keys) keeping what it read."""

    __name__ = "fastckpt-soundness"

    def __init__(self) -> None:
        self.Unpickler = type("_MetaUnpickler", (_MetaUnpickler,), {"storages": {}})
        self.loaded: list[object] = []

    def load(self, stream: typing.IO[bytes], **kwargs: object) -> object:
        self.loaded.append(_Unpickler(stream, **kwargs).load())
        return self.loaded[-1]


def _rebuild_from_type(func: Callable[..., torch.Tensor], new_type: type, args: tuple, state: object) -> object:
    """``torch._tensor._rebuild_from_type_v2`` (a ``Tensor`` subclass's pickle): a stubbed subclass
    leaves the plain tensor (``as_subclass`` wants a tensor type, not a ``Stub``: a TypeError that
    was taken for damage), its state still set on it."""
    from torch._tensor import _rebuild_from_type_v2

    return _rebuild_from_type_v2(func, torch.Tensor if new_type is Stub else new_type, args, state)


def _allowed() -> dict[str, object]:
    from torch import _weights_only_unpickler as wo

    return {**wo._get_allowed_globals(), **wo._get_user_allowed_globals()}


_MODULE = types.SimpleNamespace(Unpickler=_Unpickler, __name__="fastckpt-soundness")  # the pickle module torch uses
