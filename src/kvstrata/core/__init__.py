"""The bottom layer: errors, units, block layout, field formats, slot runs, block hashing
and the frozen CacheConfig. Pure: imports nothing of kvstrata above it and probes nothing
of the machine at import."""
