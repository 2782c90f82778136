"""Drop-in replacements for the ``/dev/shm`` caching helpers people already use."""

__all__: list[str] = []
