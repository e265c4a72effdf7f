"""The catalog of model families: what each of transformers' families needs to be tiny and fed.

Owns config shrinking (:mod:`.shrink`, with the per-family rules generic
shrinking cannot derive in :mod:`.shrink.rules`), each family's tiny config and model class (:mod:`.catalog`), example
inputs for every modality (:mod:`.inputs`) and the hypothesis strategies over configs and inputs
(:mod:`.strategies`). Pure knowledge about transformers' families: imports only ``errors``, never
the rooms that build, compare or report.
"""
