"""Sources: every format ``put_file`` reads (local files, directories, tables, blobs, URLs),
each checked and planned before any byte is copied. Imports ``_disk`` and ``_containers``;
``_store`` writes what is planned here."""
