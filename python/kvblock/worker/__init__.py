"""Worker-side torch code, as vLLM keeps it under ``vllm/v1/worker/``: the block tables and
slot mapping a model runner reads (:mod:`kvblock.worker.block_table`) and the paged-attention
demo that runs a tiny decoder on them with caching on and off (:mod:`kvblock.worker.demo`,
``kvblock demo``; its argument parser, :mod:`kvblock.worker.demo_args`, imports no torch).

Nothing here is imported by ``import kvblock``: torch loads only when one of these modules is.
"""
