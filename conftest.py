"""Repository-level pytest settings.

``--doctest-modules`` (pyproject.toml) would also import every ``conftest.py`` under
tests/ as a module named ``conftest``; the test directories are not packages, so two of
them collide ("import file mismatch").  They are conftests, not doctest modules: do not
collect them (pytest still loads them as conftests).
"""

collect_ignore_glob = ["tests/*conftest.py"]
