"""The product layer: GRPO, SFT and DPO on any backend (the loops run on the driver).

``commands`` is what each ``dualrl`` training command does; ``config`` the run configs;
``grpo`` / ``grpo_setup``, ``sft``, ``dpo`` one algorithm each on the shared
``training_run`` + ``loop``; ``warm_start`` builds the built-in models.
"""
