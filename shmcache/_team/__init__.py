"""Team roots: one cache shared by the members of a Unix group, declared by the
administrator in a root-owned teams file and served by a daemon running as a service
account. Sits just above :mod:`shmcache._disk` (uses its trust checks); imports nothing
heavier than the standard library."""
