"""Names of checkpoints: local paths and fsspec URLs, and where a burst-buffer copy lives.

Every path that enters fastckpt is normalised once (``normalize``); the rest of the code
compares and joins normalised names. Which *storage* serves a name is decided in one place,
``storage.homes`` (a directory and a URL are both ``Target``s); this module only parses.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from .errors import ConfigError

#: Storage schemes a lost ':' or '/' is refused for (``s3:/b``, ``s3//b``: ``_refuse_typo``).
_STORES = frozenset(("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "hdfs", "webhdfs", "oci", "oss", "http",
                     "https", "file", "memory"))
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+._-]*")  # RFC 3986's, and the '_' of fsspec's arrow_hdfs
_TAGGED = re.compile(r"(?<![^/])([A-Za-z][A-Za-z0-9+._:-]*)@[0-9a-f]{10}(?=/)")  # a store's place (mirror_path)
MEMORY = "memory"  # fsspec's in-memory store: its URLs have two spellings (``normalize``)
_FORMS = "give a directory path (/data/ckpt, file:///data/ckpt) or a URL such as s3://bucket/prefix"


def is_url(path: str) -> bool:
    """An fsspec URL (``s3://bucket/key``); ``file://`` and plain paths are local."""
    return "://" in path and path[:7].lower() != "file://"


def fspath(path: str | bytes | os.PathLike) -> str:
    """``path`` as a str: a ``PathLike``'s own, a bytes path decoded (``os.fsdecode``; ``os.fspath`` kept
    it bytes, and the str checks after it failed with a TypeError saying the opposite), in UTF-8.

    Raises:
        ConfigError: ``path`` is no name (a file object, ``io.BytesIO``, a number), which ``torch.save``
            accepts: fastckpt writes a named file, in the background, after the call returned; or a
            name that is not UTF-8.
    """
    if isinstance(path, (str, bytes, os.PathLike)):
        name = os.fsdecode(path)
        try:
            name.encode()
        except UnicodeEncodeError as exc:  # a bytes name not in UTF-8 (os.fsdecode's surrogates): names go as UTF-8
            raise ConfigError(f"the checkpoint path {name.encode(errors='surrogateescape')!r} is not UTF-8 (byte "
                              f"{exc.object[exc.start].encode(errors='surrogateescape')!r} at {exc.start}): fastckpt "
                              "names files and their records in UTF-8; give a UTF-8 name") from None
        return name
    raise ConfigError(f"the checkpoint path is a {type(path).__name__}, not a file name or URL: fastckpt saves and "
                      "loads named files or URLs (a str or os.PathLike, e.g. 'ckpt/step-100.pt'); to write into or "
                      "read from a file object or a buffer (io.BytesIO), use torch.save(state, buf) and "
                      "torch.load(buf)")


def canonical(path: str | os.PathLike) -> str:
    """``path`` as fastckpt names it: a URL's scheme in lower case (schemes are case-insensitive,
    RFC 3986, but fsspec knows ``s3`` only, not ``S3``); the rest is left as it is.

    Raises:
        ConfigError: a URL whose scheme has spaces around it (``" s3://b"``, from a config file),
            ``file://localhost/...`` (``_refuse_host``), or a local path that is a URL typo
            (``s3:/b/k``, ``s3:b/k``, ``s3//b/k``: ``_refuse_typo``).
    """
    s = fspath(path)
    if "://" not in s:
        _refuse_typo(s)
        return s
    scheme, rest = s.split("://", 1)
    if scheme != scheme.strip():
        fix = f"{scheme.strip().lower()}://{rest}"
        lead, trail = scheme[:len(scheme) - len(scheme.lstrip())], scheme[len(scheme.rstrip()):]
        where = f"starts with {lead!r} before its scheme" if lead else f"has {trail!r} between its scheme and '://'"
        raise ConfigError(f"{s!r} {where} (a space, a tab: from a config file or a quoted variable?): did you mean "
                          f"{fix!r}? ({_FORMS})")
    if scheme.lower() == "file":
        _refuse_host(s, rest)
    return f"{scheme.lower()}://{rest}"


def _refuse_host(s: str, rest: str) -> None:
    """``file://localhost/x``: RFC 8089's local host, but fastckpt reads what follows ``file://``
    as a path (``file:///x`` is ``/x``; ``f"file://{dirpath}"`` with a relative ``dirpath`` is
    that relative path), so it would be the folder ``./localhost/x``, and ``/x`` to a reader of
    the RFC: two meanings, refused rather than one picked silently."""
    host, _, tail = rest.partition("/")
    if host.lower() == "localhost":
        raise ConfigError(f"{s!r} names the host {host!r} (RFC 8089: this machine), but fastckpt reads "
                          f"what follows 'file://' as a path, so this would be the folder './{host}/{tail}'. Write "
                          f"'file:///{tail}' (or '/{tail}') for the local path, or './{host}/{tail}' for a folder "
                          "of that name")


def _refuse_typo(s: str) -> None:
    """A URL that lost a slash or its colon is a relative local path to ``os.path``: a save to
    ``s3:/bucket/x.pt`` would land in ``./s3:/bucket/x.pt`` on local disk, count as durable, and
    on a fresh node ``latest`` would find nothing. Refused when the path's *first* component is
    ``<scheme>:...`` or ``<scheme>//...`` for a storage scheme (``_STORES``: s3, gs, az, hdfs,
    http...). Not for every protocol fsspec knows: ``data:v2/model.pt``, ``local:run1/x.pt`` and
    ``data//x.pt`` (an empty part) are local names, as is a ':' anywhere else
    (``run:1/epoch=1-step=2.ckpt``, ``/data/run:1``)."""
    head = s.partition("/")[0]
    name, colon, _ = head.strip().partition(":")
    slashes = not colon and s[len(head):].startswith("//") and name.lower() not in ("file", "memory")
    if not (colon or slashes) or not _SCHEME.fullmatch(name) or name.lower() not in _STORES:
        return
    rest = s.lstrip()[len(name):].lstrip(":/")
    scheme = name.lower()
    fix = f"'file:///{rest}' or '/{rest}'" if scheme == "file" else f"'{scheme}://{rest}'"
    raise ConfigError(f"{s!r} looks like a URL without its '://', and would be a local folder {head!r} here: "
                      f"did you mean {fix}? (A local folder of that name: write {'./' + s!r}; {_FORMS})")


def normalize(path: str | os.PathLike) -> str:
    """Absolute path for a local path, the URL itself (no trailing '/', its scheme in lower
    case: ``canonical``, which also refuses URL typos) for a URL. fsspec's memory store has one
    path, ``/b/k``, for ``memory://b/k`` and ``memory:///b/k``: both are named the first way, so
    the two spellings are one root, one group, one file (``spelled_as`` gives answers back as written)."""
    s = canonical(path)
    if is_url(s):
        scheme, rest = s.split("://", 1)
        if scheme == MEMORY:
            rest = rest.lstrip("/")
        return f"{scheme}://{rest.rstrip('/')}"  # "s3://" stays a URL (check_url refuses it), never "s3:"
    return os.path.abspath(local_path(s))


def trimmed(path: str) -> str:
    """A local ``path`` (also ``file://...``) without its trailing '/' (the root stays '/'): the
    command line's ``ls FILE/``, as shell completion leaves it, named FILE/, which does not exist.
    A URL as it is (``normalize`` trims it)."""
    if is_url(path):
        return path
    head = path[: len(path) - len(local_path(path))]  # "file://" or ""
    return head + (local_path(path).rstrip("/") or "/")


def spelled_as(name: str | None, given: str | os.PathLike) -> str | None:
    """``name``, found under ``given`` (both normalised by ``normalize``), spelt as the caller spelt
    ``given``: a memory URL written with three slashes (``memory:///b/run``) gets its answers with
    three, not a name the caller never wrote."""
    if name is None or not canonical(given).startswith(f"{MEMORY}:///") or not name.startswith(f"{MEMORY}://"):
        return name
    return f"{MEMORY}:///{name[len(MEMORY) + 3:]}"


def local_path(path: str) -> str:
    """``path`` without a leading ``file://`` (a local path either way: ``is_url``)."""
    return path[7:] if path[:7].lower() == "file://" else path


def empty(path: str | os.PathLike) -> bool:
    """Whether ``path`` names nothing: blank, or ``file://`` with a blank path after it (what
    ``f"file://{dirpath}"`` gives with ``dirpath`` unset), which ``normalize`` would make the
    working directory."""
    return not local_path(os.fspath(path)).strip()


def named(path: str | os.PathLike, call: str) -> str | os.PathLike:
    """``path`` itself, unless it is empty (``empty``: also a bare ``file://``): ``normalize``
    would make that the working directory, which ``latest`` then scans and ``remove`` deletes
    when it holds one checkpoint (``remove(whole=True)``, Lightning's call, whatever it holds)."""
    if empty(path):
        raise ConfigError(f"{call}: the path is empty: name the checkpoint, or the directory holding them, e.g. "
                          "'ckpt' or 'ckpt/step-100.pt' ('.' for the working directory; 'file://' alone names no "
                          "path: an unset variable after it?)")
    return path


def file_name(path: str | os.PathLike) -> str:
    """``normalize`` the name of a checkpoint *file* (``save``, ``load``), refusing a name that
    cannot be one: empty (it would mean the working directory), ending in a separator, or holding
    a NUL (no file system takes one: a save wrote the whole file to a temp name, then failed to
    publish it with a bare ValueError at ``wait()``), or no name at all (``fspath``)."""
    s = fspath(path)
    if not s.strip():
        raise ConfigError("the checkpoint path is empty: name the file to save or load, e.g. 'ckpt/step-100.pt'")
    if "\x00" in s:
        raise ConfigError(f"{s!r} holds a NUL character ('\\x00'), which no file or object name may hold: remove it "
                          f"(e.g. {s.replace(chr(0), '')!r})")
    if s.endswith(("/", os.sep)):
        raise ConfigError(f"{s!r} ends with a separator, so it names a directory, not a checkpoint file: name the "
                          f"file inside it, e.g. {s + 'step-100.pt'!r}")
    if is_url(s):
        _, key = split_url(s)
        try:
            check_key(key)
        except ConfigError as exc:
            raise ConfigError(f"{s} cannot name a checkpoint: its {exc}") from None
    return normalize(s)


def check_key(key: str) -> str:
    """Validate a key within a target (a bucket, a directory) and return it: relative,
    '/'-separated, no empty, '.' or '..' component (it could lead out of the target, or of
    ``local_dir`` for the burst-buffer copy).

    Raises:
        ConfigError: naming the key and the rule it breaks.
    """
    if not isinstance(key, str) or not key:
        raise ConfigError(f"key {key!r} must be a non-empty str relative to the target root")
    parts = key.split("/")
    if key.startswith("/") or "\\" in key or "\x00" in key or any(p in ("", ".", "..") for p in parts):
        raise ConfigError(f"key {key!r} must be relative to the target root, '/'-separated, without a leading "
                          "'/', empty, '.' or '..' components (e.g. 'run1/step_100/rank0.pt')")
    return key


def nameable(key: str) -> bool:
    """Whether fastckpt could save or load a checkpoint under ``key`` (``check_key``): a listed
    name it refuses (a stray ``notes\\draft.txt`` copied from Windows) is none of its checkpoints,
    passed over by every scan, not an error that stops the scan of the whole directory."""
    try:
        check_key(key)
    except ConfigError:
        return False
    return True


def check_url(url: str) -> str:
    """``url`` when fsspec can open it, its scheme in lower case (``canonical``); a local path
    is returned as it is.

    Raises:
        ConfigError: a malformed URL (``http://[::1``), a scheme fsspec does not know (checked
            when fsspec is installed), or a URL typo (``canonical``), naming the URL and the
            accepted forms.
    """
    url = canonical(url)
    if not is_url(url):
        return url
    from urllib.parse import urlsplit

    try:
        urlsplit(url)
    except ValueError as exc:
        raise ConfigError(f"{url!r} is not a valid URL ({exc}): {_FORMS}") from None
    scheme, rest = url.split("://", 1)
    if not rest.split("/", 1)[0] and scheme.rsplit("::", 1)[-1].lower() != "memory":
        raise ConfigError(f"{url!r} names no bucket or host after {scheme}://: use {scheme}://<bucket>[/<prefix>] "
                          f"(an empty variable in the command line?); {_FORMS}")
    try:
        import fsspec
    except ImportError:  # the storage layer says what to install
        return url
    known = fsspec.available_protocols()
    if any(p not in known for p in scheme.split("::")):  # a chain (simplecache::s3) names several
        raise ConfigError(f"{url!r}: {scheme}:// is not a storage scheme fsspec knows (s3://, gs://, az://, "
                          f"memory://, ...; another needs its fsspec package installed): {_FORMS}")
    return url


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``s3://bucket``, ``a/b``): the target root and the key. fsspec's
    in-memory paths may start at '/' (``memory:///b/a``): the root is then ``memory:///b``, as
    written, so names made from it keep the form the caller gave."""
    scheme, rest = url.split("://", 1)
    lead = len(rest) - len(rest.lstrip("/"))
    bucket, _, key = rest[lead:].partition("/")
    return f"{scheme}://{rest[:lead]}{bucket}", key.strip("/")


def root_url(protocol: str, url_root: str, root: str) -> str:
    """The URL of a target at ``url_root`` whose fsspec path is ``root``, with the slashes
    ``url_root`` has after its '://': fsspec's path of ``memory://b`` is ``/b``, which would name
    it ``memory:///b``, and every checkpoint found under it (``latest``) a name the caller never gave.
    A backend whose path keeps the scheme (fsspec's http(s): ``http://host/run``) has it taken off,
    else every name would be ``http://http://host/run/...``."""
    rest = url_root.split("://", 1)[-1]
    root = root.split("://", 1)[1] if root.lower().startswith(f"{protocol.lower()}://") else root
    return f"{protocol}://{rest[:len(rest) - len(rest.lstrip('/'))]}{root.lstrip('/')}"


def mirror_path(local_dir: str, dest: str, store: str = "") -> str:
    """Where the burst-buffer copy of ``dest`` (path or URL) lives under ``local_dir``: a URL under
    ``<scheme><store>/`` (``store``: which store it is at, ``Homes.store_of``: one bucket and key
    at two endpoints are two checkpoints), a path under its own absolute path, except one whose
    first folder could be such a URL's (``/s3/bucket/k``, ``/file/x``): that one under ``file/``."""
    if is_url(dest):
        scheme, rest = dest.split("://", 1)
        return os.path.join(local_dir, scheme + store, rest.strip("/"))
    rel = os.path.abspath(dest).lstrip(os.sep)
    head = rel.split(os.sep, 1)[0]
    if head.split("@", 1)[0].lower() in _STORES or "::" in head:  # ("file": no URL has it; it holds these)
        rel = os.path.join("file", rel)
    return os.path.join(local_dir, rel)


def mirrored(rel: str) -> bool:
    """Whether ``rel``, a name below a burst buffer's root, is where ``mirror_path`` puts copies: under
    a store's folder (``s3/``, ``s3@<tag>/``, ``file/``), or under a local path's own absolute path,
    whose first folder is one at this node's root (``tmp/``, ``data/``). A user's own folder in the
    buffer's directory (``local_dir`` set to the run's folder: ``ckpt/``) is not."""
    head = rel.split("/", 1)[0]
    return "/" in rel and (head.split("@", 1)[0].lower() in _STORES or "::" in head
                           or os.path.isdir(os.sep + head))


def untagged(path: str) -> str:
    """A burst-buffer copy's path (``mirror_path``) with its store's tag dropped: ``<scheme>@<10 hex>``
    as ``<scheme>`` (``/nv/s3@0123456789/b/k`` -> ``/nv/s3/b/k``), so that it ends with its home
    URL's ``scheme/rest`` (``s3://b/k``) as a copy placed before stores were told apart did. Event-log
    readers tie a copy's events to its home's save this way, in logs of either placement."""
    return _TAGGED.sub(lambda m: m.group(1) if m.group(1).lower() in _STORES else m.group(0), path)  # a
    # plain folder named so (``run@1765000000``: a Unix time is 10 hex digits too) is left as it is


def join(parent: str, rel: str) -> str:
    """``parent`` + ``/`` + ``rel`` for normalised names (paths and URLs alike)."""
    return f"{parent.rstrip('/')}/{rel}" if rel else parent


def is_within(path: str, parent: str) -> bool:
    """Whether normalised ``path`` is ``parent`` or below it."""
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def resolved(path: str) -> str:
    """A normalised name as one key for every spelling of it: a local path with its folder's
    symbolic links resolved (``/ckpt/a.pt`` and ``/lustre/me/ckpt/a.pt`` when ``/ckpt`` links
    there), its own last part kept as named (a link saved over is replaced, not followed); a URL
    as it is. For matching a save in flight, or a group's claim, with what names the same place."""
    if is_url(path):
        return path
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def spellings(path: str) -> list[str]:
    """``path``, and its ``resolved`` spelling where its folders' links make that another name: a
    burst-buffer copy lies under the spelling its save was given (``mirror_path``), so a removal
    through ``/ckpt`` (a link to ``/lustre/me/run``) looks under both."""
    return list(dict.fromkeys((path, resolved(path))))


def same_place(path: str, names: Iterable[str]) -> list[str]:
    """``path``, and, when ``path`` is not one of ``names`` itself, each of them that is another
    spelling of it (``resolved`` makes them one name): what a removal through ``/ckpt/a.pt`` must
    forget of a save tracked as ``/lustre/me/ckpt/a.pt``, and the reverse. A name tracked as given
    is only itself: ``resolved`` follows links as they point now, and a link moved since another
    save would make that save look like this one."""
    names = list(names)
    if path in names:
        return [path]
    key = resolved(path)
    return list(dict.fromkeys([path, *(n for n in names if resolved(n) == key)]))
