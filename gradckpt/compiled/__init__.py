"""The compiled path: a plan run under ``torch.compile``, and byte budgets held there.

Its own layer, above ``apply`` (whose eager wrappers it builds on) and below
``api`` (``gradckpt.fit(..., compile=True)`` calls :mod:`.hold`). One module per
concern:

* :mod:`~gradckpt.compiled.in_graph`: ``gradckpt.compile``: the plan's
  decisions as selective-checkpoint tags inside one compiled graph;
* :mod:`~gradckpt.compiled.segments`: segments (one region over several units)
  inside that graph;
* :mod:`~gradckpt.compiled.watch`: Dynamo's recompiles, counted
  (``gradckpt.compile_stats``);
* :mod:`~gradckpt.compiled.hold`: ``fit(..., compile=True)`` measures the
  compiled step and plans again tighter until it fits;
* :mod:`~gradckpt.compiled.budget`: ``fit_compiled``: plans and the compiler's
  partitioner options measured together, the fastest that fits chosen;
* :mod:`~gradckpt.compiled.knapsack`: the partitioner held to a cap in saved
  bytes (``SavedBytesSolver``);
* :mod:`~gradckpt.compiled.around_regions`: ``compile_model``: region bodies
  compiled inside gradckpt's eager regions, the rest compiled around them.

Nothing is imported here: ``knapsack`` pulls in torch's inductor, and
``import gradckpt`` stays light (it imports ``in_graph`` and what that needs).
"""
