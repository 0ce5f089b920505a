"""The engine core: requests and their admission rules, the scheduler, the KV block manager with
its prefix cache, sequences, the synchronous Engine and the AsyncEngine that serve/ drives, and
the records that cross the step seam (tl/core/plan.py: the Runner protocol the device side
implements).

May import: the standard library and tl.core only; never jax, numpy or flax. Anything the core
needs from another layer (a runner, a constraint's matcher, a grammar compiler) arrives as an
object behind a protocol declared here.
"""
