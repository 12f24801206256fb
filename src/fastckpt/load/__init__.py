"""The load path (above commit/): choosing and reading a copy, verifying it (``loader``), and
zero-copy deserialisation (``deserialize``)."""
