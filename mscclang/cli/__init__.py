"""Command-line interface (``mscclang``)."""
