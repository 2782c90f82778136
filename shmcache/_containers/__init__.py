"""Shared containers: encoding Python objects into object-free arrays (``encode``) and the
read-only views over them (``shared``, ``group``). Imports only ``_disk`` and errors."""
