"""Byte movement (above format/): the ``FileOps`` system-call seam (``ops``), parallel aligned
reads, writes and copies (``engine``), the temp -> fsync -> rename recipe (``atomic``) and
GPUDirect Storage writes (``gds``). Every byte fastckpt moves on a file system goes through here."""
