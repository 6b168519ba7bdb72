"""Recipe functions: one module per Qwen-VL family, each returning a Megatron-Bridge ConfigContainer.

Training a recipe is one floor up: `qvl.training.train(config, run_dir=...)`.
"""
