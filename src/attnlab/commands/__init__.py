"""The leaves of the ``attnlab`` command, one module each.

Every module here has the same shape, which :mod:`attnlab.cli` reads from its one table:

* ``HELP``: one line for the parent's list of commands;
* ``SHARED``: which of the shared options (:func:`attnlab.commands.options.shared`) it
  takes — ``quick`` (its help), ``reps`` (``(default, help)``), ``json`` (``False`` to
  leave ``--json PATH`` out);
* ``add_arguments(parser)``: its own options, each with help text;
* ``run(args) -> int``: the exit status (0 done, 1 something ran and failed, 2 bad
  arguments, said on stderr).

They import the library only inside ``run``, so building the parser stays cheap.
"""
