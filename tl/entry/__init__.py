"""The operational entry points: building a served engine from an EngineConfig (tl/entry/build.py),
the `tl` command line, pulling models, and the multi-host group (the step channel and its
start-up bounds).

May import: every layer of tl. Only tl/entry/build.py reads the environment.
"""
