"""Byte units, defined once (config fields are in GiB; caps are in bytes)."""

MIB = 1 << 20
GIB = 1 << 30
