"""The contract of replacement classes: what a replacement must keep of the class it replaces.

Findings read from sources (signatures against the call sites, unused arguments,
``_no_split_modules``), findings from built structures (weight names, tensor/pipeline-parallel
plans), the source reading both rest on, and the disk cache of what transformers alone decides.
"""
