"""The simulator: a plan's predicted peak bytes and step time on a profiled step.

:mod:`.simulate` edits the plain step's event line (:mod:`.event_line`) the
way the engine runs the plan's regions (:mod:`.regions`) and adds what the
engine itself costs (:mod:`.costs`). It dispatches on decision kinds only
through the registry (:mod:`gradckpt.planning.handlers`).
"""
