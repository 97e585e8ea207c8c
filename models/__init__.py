"""Model definitions as pure functions over parameter pytrees (installed as ``fmoe.models``).

Each model module holds a frozen ``Config`` dataclass, ``init(cfg, seed)``,
``forward(params, tokens, cfg, mesh=None)``, a default sharding ``plan(cfg)`` and the
Hugging Face checkpoint name map. No parallelism logic lives in a model file.
"""
