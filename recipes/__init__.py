"""Recipe functions: one module per Qwen-VL family, each returning a Megatron-Bridge ConfigContainer."""
