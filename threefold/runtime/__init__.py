"""The runtime: runs generated per-rank modules on a pipeline schedule.

It never imports threefold.compiler, threefold.passes or threefold.codegen, so a saved
artifact runs without the compiler or the model's source.
"""
