"""Sources: every format ``put_file`` reads (array files, tables, blobs, URLs), each checked
and planned before any byte is copied; ``dispatch`` decides which kind a source is, for
``put_file``, ``plan_file`` and the daemon's preloads alike. Imports ``_disk`` and
``_containers``; ``_store`` writes what is planned here.

A new array file format is one module with a planner (``files.Planner``: the entries one
checked file becomes) and one line in ``files.PLANNERS`` (its suffix); a directory put
then collects it too."""
