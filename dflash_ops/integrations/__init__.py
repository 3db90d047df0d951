"""Integrations of dflash_ops into serving engines (today: vLLM, ``integrations/vllm``)."""
