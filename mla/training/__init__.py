"""Fine-tuning: the paper's LR schedule, DeepSpeed configs, the Trainer run, multi-process launch."""
