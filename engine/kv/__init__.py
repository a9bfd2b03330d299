"""The KV cache on the machine: the RAM prompt cache, the SSD file format and the disk under it."""
