"""The bottom layer: the on-disk contract (paths, names, key encoding, ``.npy`` headers,
meta files, atomic publish) and the file-system primitives under it. Imports only
:mod:`shmcache.errors`."""
