"""Training a small DeepSeek-V4.1-architecture model (tools/train_default_model.py): data, the differentiable
model, straight-through quantisers, training-form attention ops, evaluation."""
