"""The vLLM plugin: ``model.py`` (the drafter class whose context precompute runs
``torch.ops.dflash.context_kv_``), ``context.py`` (its plan and store), ``cache.py`` (K/V views of
vLLM's cache layouts) and ``attention.py`` (the draft attention backend).

The entry point vLLM loads, ``register``, lives in the top-level package ``dflash_ops_vllm`` (its
docstring says what the plugin does), so that loading the plugin in each vLLM process imports
neither this package nor CUDA; it is re-exported here.
"""
from dflash_ops_vllm import (ARCH, BACKEND_CLS, MODEL_CLS, TESTED, enabled,  # noqa: F401
                             register, supported, vllm_version)
