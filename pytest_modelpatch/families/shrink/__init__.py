"""Config shrinking: a family's default config dict made tiny, and still valid, for a CPU forward in milliseconds.

``configs.py`` walks every level of the config tree (``shrink_config_dict``), with the sizes
and the keys they apply to in ``sizes.py``, the layer count in ``layers.py``, vision and
audio levels in ``vision.py`` and ``audio.py``, and sizes a config derives itself
in ``consistency.py``; ``validator_fit.py`` meets the equalities strict validators state;
``rules/`` holds what generic shrinking cannot derive, per family, each with its reason.
Pure dict work, no torch.
"""
