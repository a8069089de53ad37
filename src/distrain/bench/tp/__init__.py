"""``distrain bench tp``: blocks.py measures a tensor-parallel GPT's all-reduce payload per block
against Megatron's count, and the activation bytes a block keeps for backward."""
