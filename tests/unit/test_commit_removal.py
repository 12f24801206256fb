"""``commit.removal.failure``: which commit failures are the group's removal (``Checkpointer.remove``).

Without a store, a commit that fails with ENOENT is the group's removal: its directory (or a file
of it) vanished, and nothing else deletes them. A missing S3 bucket (a typo in the URL) carries
ENOENT too; before, it was reported as "removed while it was being committed", and the error
that names the fix only came at the next sync point.
"""

from __future__ import annotations

import errno
import threading
from types import SimpleNamespace

from fastckpt.commit import removal
from fastckpt.storage.types import BucketNotFoundError, storage_error


def _attempt() -> SimpleNamespace:
    """The fields ``removed`` reads: no store, not cancelled by a remove()."""
    return SimpleNamespace(cancel=threading.Event(), channel=None, group="s3://typo/run/t1")


def test_a_missing_bucket_is_not_a_removal_and_is_raised_as_itself() -> None:
    err = storage_error(BucketNotFoundError, "copy of x.pt: bucket 'typo' does not exist at http://s3: create it "
                        "(e.g. `aws s3 mb s3://typo`) or fix the target URL", None, errno.ENOENT)
    att = _attempt()
    assert not removed_by(att, err)
    assert removal.failure(att, 0, err) is err


def test_a_vanished_group_file_is_still_a_removal() -> None:
    assert removed_by(_attempt(), FileNotFoundError(errno.ENOENT, "No such file or directory", "/ckpt/g/r0.pt"))


def removed_by(att: SimpleNamespace, exc: OSError) -> bool:
    return removal.removed(att, exc)  # type: ignore[arg-type] (only the fields above are read)
