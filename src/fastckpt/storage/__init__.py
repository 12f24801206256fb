"""Durable homes (above io/): the ``Target`` seam (``base``) and its backends (``posix``,
``fsspec``, ``s3``), the data that crosses it (``types``), the retry policy (``retry``), a
directory-like ``Place`` in a target (``places``) and the one resolver of names (``homes``).
A POSIX directory, a URL and a group's place are all reached through a Target."""
