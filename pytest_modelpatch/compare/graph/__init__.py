"""Traced graphs of the patched model: ``torch.export`` and ``torch.compile`` parity with the eager reference.

``export.py`` and ``compile.py`` are the two checks, each with its report; ``parity.py`` what they
share (the traced forward, its inputs, the report's base, the comparison with the eager reference);
``trace_failures.py`` says where a trace gave up, in a few lines; ``dynamo_state.py`` leaves no
compiled code behind. These modules import each other and the rest of ``compare``;
nothing outside imports them but the public API.
"""
