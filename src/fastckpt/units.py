"""Byte units, defined once (binary: a MiB is 2**20 bytes; SI GB = 1e9 is spelled out where used)."""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
