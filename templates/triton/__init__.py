"""The Triton kernel templates: read as text, their holes filled, then imported (``backends.triton``)."""
