"""The trainer's machinery, used by train.py and eval.py: config, precision, engine (vLLM /
transformers), data (a run's inputs), batching, grpo and ppo (the updates), constraints
(Lagrange multipliers), distributed (FSDP), lora, checkpoint, tracking, plan (memory plan)."""
