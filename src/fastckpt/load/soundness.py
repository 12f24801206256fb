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

Only a zip file is checked so: torch loads it from the image in place. A pre-zip file is judged
damaged on such an error, as before this check: torch's legacy loader copies the image and every
storage (3x the file's memory, an OOM where torch's error was wanted) and, under
``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1``, refuses the stubbing unpickler outright.
"""

from __future__ import annotations

import pickle
import sys
import types
from collections.abc import Callable

import torch

from ..format.foreign import Stub
from ..format.ranges import RangeReader
from .deserialize import fetcher
from .image import ZIP_MAGIC, HeapImage


def sound(buf, size: int) -> bool:  # noqa: ANN001
    """Whether the file image ``buf[:size]`` loads when nothing of this process can make it fail
    (the caller checked first that its pickles are bounded: this runs the C unpickler); False for
    a pre-zip file, which is not loaded again (see the module's docstring)."""
    fetch = fetcher(buf)
    try:
        if fetch(0, 4) != ZIP_MAGIC:
            return False
        reader = torch._C.PyTorchFileReader(RangeReader(size, fetch))
        if "byteorder" in reader.get_all_records() and reader.get_record("byteorder") not in (b"little", b"big"):
            return False
        whole = buf if isinstance(buf, HeapImage) else torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()
        torch.serialization._load(reader, _where_read, _MODULE, overall_storage=whole)
    except Exception:  # noqa: BLE001 (whatever fails without this process's part is in the bytes)
        return False
    return True


class _Unpickler(pickle.Unpickler):
    """torch's names resolved as its weights-only unpickler allows them, the standard library's and
    torch's other names checked to exist (a ``Stub`` then), everyone else's a ``Stub``; every
    persistent id's location a device torch knows."""

    def find_class(self, module: str, name: str) -> object:
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


def _allowed() -> dict[str, object]:
    from torch import _weights_only_unpickler as wo

    return {**wo._get_allowed_globals(), **wo._get_user_allowed_globals()}


_MODULE = types.SimpleNamespace(Unpickler=_Unpickler, __name__="fastckpt-soundness")  # what the zip load uses
