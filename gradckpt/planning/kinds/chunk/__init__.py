"""The ``Chunk`` kind: an LM head and its loss run in slices of tokens.

:mod:`.span` (where it applies, read off a profile), :mod:`.effect` (per-token
storages one slice's size in the simulator) and :mod:`.handler` (the
``ChunkHandler``, registered). Its engine is :mod:`gradckpt.engine.chunking`.
"""
