"""Hugging Face <-> Megatron-Core bridges for the Qwen-VL families, built on Megatron-Bridge's registry."""
