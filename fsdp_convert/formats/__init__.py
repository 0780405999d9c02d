"""Read side: one module per source format, each owning its index and its reads.

``index.py`` is the data model (no I/O).
"""
